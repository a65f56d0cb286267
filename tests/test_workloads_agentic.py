"""The agentic-coding trace reader (issue 36): generated conversations round-trip through it
(requests, token counts, KV-block equality as the server tokenizes the prompt), malformed
files get one sentence naming the file and the field, and on the real public traces (when
present) ``kvbench workloads describe`` reports what plain JSON recomputes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbench.core.errors import UserError
from kvbench.workloads.base import Request, Spawn
from kvbench.workloads.registry import build_spec
from kvbench.workloads.tokenizer import get_tokenizer
from kvbench.workloads.traces import TraceSpec, guess_format

TOK = get_tokenizer()


def real_traces() -> Path:
    env = os.environ.get("KVBENCH_TRACES")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "traces"
    d = d / "agentic-coding"
    if not d.is_dir():
        pytest.skip(f"real agentic-coding traces not found at {d} (set KVBENCH_TRACES to the "
                    "folder holding agentic-coding/)")
    return d


def load(path, **kw):
    return build_spec("ag", TraceSpec(format="agentic", path=str(path), **kw), TOK, 0)


def server_tokens(r: Request) -> list[str]:
    """What the built-in server tokenizes: the rendered chat, or the completions prompt."""
    return TOK.tokens(TOK.render_chat(r.messages) if r.messages is not None else r.prompt)


def blocks(toks: list[str], bs: int) -> list[tuple]:
    return [tuple(toks[i:i + bs]) for i in range(0, len(toks) - bs + 1, bs)]


def drain(session) -> list:
    """Requests and Spawns of a session, sub-sessions drained depth first after each Spawn."""
    out = []
    while (x := session.next_request()) is not None:
        out.append(x)
        if isinstance(x, Spawn):
            for s in x.sessions:
                out.extend(drain(s))
    return out


# -- generated conversations --------------------------------------------------------------

@st.composite
def conversation(draw, cid: str = "c0", with_subs: bool = True, bs: int | None = None):
    """A valid conversation: hash-id chains that grow, branch (the context was edited) and
    repeat, a tool/system prefix, optional sub-agents with their own id range."""
    if bs is None:
        bs = draw(st.sampled_from([8, 16, 64]))  # a block longer than the template head
    prefix = draw(st.integers(0, 3 * bs))
    tool = draw(st.integers(0, prefix))
    next_id = [1]

    def fresh(n):
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    def chain(n_req, base_ids):
        out, ids, t = [], list(base_ids), 0.0
        for _ in range(n_req):
            keep = draw(st.integers(0, len(ids)))
            ids = ids[:keep] + fresh(draw(st.integers(0 if keep else 1, 4)))
            n_in = len(ids) * bs + draw(st.integers(0, bs - 1))
            rec = {"t": t, "type": draw(st.sampled_from(["s", "n"])), "in": n_in,
                   "out": draw(st.integers(0, 40)), "hash_ids": list(ids)}
            if draw(st.booleans()):
                rec["think_time"] = draw(st.floats(0, 30, allow_nan=False))
            if draw(st.booleans()):
                rec["api_time"] = draw(st.floats(0, 30, allow_nan=False))
            out.append(rec)
            t += draw(st.floats(0, 60, allow_nan=False))
        return out, t

    main_prefix = fresh(prefix // bs)
    reqs, t_end = chain(draw(st.integers(1, 5)), main_prefix)
    if with_subs and draw(st.booleans()):
        sub_prefix = fresh(draw(st.integers(0, 2)))
        for _ in range(draw(st.integers(1, 3))):
            sreqs, _ = chain(draw(st.integers(1, 3)), sub_prefix)
            entry = {"t": t_end, "type": "subagent", "tool_tokens": 0,
                     "system_tokens": len(sub_prefix) * bs, "requests": sreqs}
            if draw(st.booleans()):
                entry["duration_ms"] = draw(st.integers(0, 100_000))
            reqs.append(entry)
            t_end += draw(st.floats(0, 30, allow_nan=False))
        more, _ = chain(draw(st.integers(0, 2)), main_prefix)
        for r in more:
            r["t"] += t_end
        reqs.extend(more)
    return {"id": cid, "block_size": bs, "hash_id_scope": "local", "tool_tokens": tool,
            "system_tokens": prefix - tool, "requests": reqs}


def flat_records(doc) -> list[tuple]:
    """(session key, record) in file order; key -1 for the main session, else the
    sub-agent's order in the conversation."""
    out, k = [], 0
    for rec in doc["requests"]:
        if rec["type"] == "subagent":
            out.extend((k, r) for r in rec["requests"])
            k += 1
        else:
            out.append((-1, rec))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=conversation(), api=st.sampled_from(["chat", "completions"]))
def test_generated_conversation_round_trips(tmp_path_factory, doc, api):
    d = tmp_path_factory.mktemp("ag")
    (d / "c0.json").write_text(json.dumps(doc))
    wl = load(d, api=api, shared_prefix="per_conversation")
    bs = doc["block_size"]
    recs = flat_records(doc)
    got = [x for x in drain(next(wl.sessions()))]
    reqs = [x for x in got if isinstance(x, Request)]
    assert len(reqs) == len(recs) == len(wl)
    tail = wl.tail
    toks = []
    prev_key = -1
    prev_of: dict = {}  # the session's previous record (none after a spawn)
    for (key, rec), r in zip(recs, reqs):
        if key >= 0 and key != prev_key:
            prev_of.pop(-1, None)
        prev_key = key
        sent = server_tokens(r)
        toks.append(sent)
        assert r.prompt_tokens == len(sent)
        # the trace's input length exactly, unless the template's closing tokens do not fit
        # after the last full block
        assert r.prompt_tokens == max(rec["in"], len(rec["hash_ids"]) * bs + tail,
                                      wl.head + tail + 1)
        assert r.max_tokens == max(rec["out"], 1) and r.min_tokens == 0
        assert r.stream is (rec["type"] == "s")
        assert r.subagent_index == key
        assert (r.parent_session_id == "") is (key == -1)
        if key >= 0:
            assert r.parent_session_id == f"ag-{doc['id']}"
            assert r.session_id == f"ag-{doc['id']}-s{key}"
        prev = prev_of.get(key)
        assert r.api_time_s == (None if prev is None else prev.get("api_time"))
        prev_of[key] = rec
        assert r.think_time_s >= 0
    # equal hash-id prefixes give exactly that many equal blocks, and no more
    for i in range(len(recs)):
        for j in range(i):
            a, b = recs[i][1]["hash_ids"], recs[j][1]["hash_ids"]
            c = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            ba, bb = blocks(toks[i], bs), blocks(toks[j], bs)
            assert ba[:c] == bb[:c]
            if c < len(a) and c < len(b):
                assert ba[c] != bb[c], (i, j, c)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), frac=st.sampled_from(["shared", "per_conversation", 0.5]))
def test_tool_and_system_prefix_shared_across_conversations(tmp_path_factory, data, frac):
    a = data.draw(conversation("a", with_subs=False))
    bs = a["block_size"]
    b = data.draw(conversation("b", with_subs=False, bs=bs))
    for doc in (a, b):  # the prefix in full blocks of the common size
        n = len(doc["requests"][0]["hash_ids"])
        doc["tool_tokens"], doc["system_tokens"] = 0, bs * min(n, 2)
    d = tmp_path_factory.mktemp("ag")
    (d / "a.json").write_text(json.dumps(a))
    (d / "b.json").write_text(json.dumps(b))
    wl = load(d, shared_prefix=frac)
    sa, sb = wl.sessions()
    ra, rb = sa.next_request(), sb.next_request()
    pa = a["system_tokens"] // bs
    pb = b["system_tokens"] // bs
    want = min(pa, pb) if frac == "shared" else (
        0 if frac == "per_conversation" else min(int(0.5 * pa * bs) // bs,
                                                 int(0.5 * pb * bs) // bs))
    ba, bb = blocks(server_tokens(ra), bs), blocks(server_tokens(rb), bs)
    assert ba[:want] == bb[:want]
    if want < min(len(ba), len(bb)):
        assert ba[want] != bb[want]


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["requests"][0].pop("in"), "requests[0].in"),
    (lambda d: d["requests"][0].pop("hash_ids"), "requests[0].hash_ids"),
    (lambda d: d["requests"][0].update(out="many"), "requests[0].out"),
    (lambda d: d["requests"][0].update(t=-1), "requests[0].t"),
    (lambda d: d["requests"][0].update(type="x"), "requests[0].type"),
    (lambda d: d["requests"][0].update(think_time="3"), "requests[0].think_time"),
    (lambda d: d["requests"][0].update(hash_ids=[1, "2"]), "requests[0].hash_ids"),
    (lambda d: d["requests"][0].update(hash_ids=[1] * 99), "requests[0].hash_ids"),
    (lambda d: d.pop("requests"), "requests"),
    (lambda d: d.update(requests=[]), "requests"),
    (lambda d: d.pop("tool_tokens"), "tool_tokens"),
    (lambda d: d.update(system_tokens=1.5), "system_tokens"),
    (lambda d: d.update(block_size=0), "block_size"),
    (lambda d: d["requests"].append({"t": 1, "type": "subagent", "tool_tokens": 0,
                                     "system_tokens": 0}), "requests[1].requests"),
    (lambda d: d["requests"].append({"t": 1, "type": "subagent", "tool_tokens": 0,
                                     "system_tokens": 0, "requests": [{"t": 0}]}),
     "requests[1].requests[0].type"),
])
def test_malformed_field_named_in_one_sentence(tmp_path, mutate, field):
    doc = {"id": "x", "block_size": 8, "tool_tokens": 0, "system_tokens": 8,
           "requests": [{"t": 0, "type": "n", "in": 17, "out": 3, "hash_ids": [1, 2]}]}
    mutate(doc)
    f = tmp_path / "x.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(UserError) as err:
        load(f)
    msg = str(err.value)
    assert msg.startswith(f"{f}: ") and field in msg and "\n" not in msg
    assert msg.count("; ") == 1 and not msg.rstrip(".").count(". ")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=conversation(), cut=st.integers(1, 400), junk=st.binary(max_size=8))
def test_bad_json_names_the_file_and_skipping_counts_it(tmp_path_factory, doc, cut, junk):
    d = tmp_path_factory.mktemp("ag")
    text = json.dumps(doc).encode()
    (d / "good.json").write_bytes(text)
    (d / "bad.json").write_bytes(text[: min(cut, len(text) - 1)] + junk)
    try:
        json.loads((d / "bad.json").read_bytes())
        return  # the cut happened to leave valid JSON
    except ValueError:
        pass
    with pytest.raises(UserError) as err:
        load(d)
    assert str(err.value).startswith(f"{d / 'bad.json'}: ")
    wl = load(d, skip_bad_lines=True)
    assert wl.skipped_lines == 1 and len(wl.conversations) == 1
    assert "skipped 1 malformed file" in wl.notes[0]


def test_spawn_groups_overlapping_subagents_and_think_times(tmp_path):
    sub = {"t": 0, "type": "n", "in": 8, "out": 2, "hash_ids": [50, 51], "think_time": 0}
    doc = {"id": "c", "block_size": 4, "tool_tokens": 0, "system_tokens": 0, "requests": [
        {"t": 0, "type": "n", "in": 8, "out": 2, "hash_ids": [1, 2], "api_time": 2.0},
        {"t": 10, "type": "subagent", "tool_tokens": 0, "system_tokens": 4,
         "duration_ms": 30_000, "requests": [sub]},
        {"t": 20, "type": "subagent", "tool_tokens": 0, "system_tokens": 4,
         "duration_ms": 5_000, "requests": [sub]},  # starts before the first ends: one Spawn
        {"t": 50, "type": "subagent", "tool_tokens": 0, "system_tokens": 4,
         "duration_ms": 1_000, "requests": [sub]},  # after both ended: a Spawn of its own
        {"t": 55, "type": "s", "in": 12, "out": 2, "hash_ids": [1, 2, 3], "think_time": 53},
        {"t": 70, "type": "s", "in": 12, "out": 2, "hash_ids": [1, 2, 3], "api_time": 1},
        {"t": 80, "type": "s", "in": 12, "out": 2, "hash_ids": [1, 2, 3]},
    ]}
    f = tmp_path / "c.json"
    f.write_text(json.dumps(doc))
    wl = load(f, speedup=2.0)
    s = next(wl.sessions())
    first = s.next_request()
    assert first.think_time_s == 0 and first.conversation_offset_s == 0
    sp1 = s.next_request()
    assert isinstance(sp1, Spawn) and len(sp1.sessions) == 2
    assert sp1.think_time_s == pytest.approx((10 - 2.0) / 2)  # from the answer's end, scaled
    kids = [k.next_request() for k in sp1.sessions]
    assert [k.subagent_index for k in kids] == [0, 1]
    assert [k.conversation_offset_s for k in kids] == [0, 10]  # from the Spawn's start
    assert [k.arrival_offset_s for k in kids] == [5, 10]  # from the conversation's, scaled
    assert kids[0].api_time_s is None
    assert all(k.parent_session_id == "ag-c" for k in kids)
    sp2 = s.next_request()
    assert isinstance(sp2, Spawn) and len(sp2.sessions) == 1
    assert sp2.think_time_s == pytest.approx((50 - 40) / 2)  # after the group's last end
    after = s.next_request()
    assert after.think_time_s == pytest.approx((55 - 51) / 2)  # not the recorded 53
    assert s.next_request().think_time_s == pytest.approx((70 - 55) / 2)  # no api_time: t gap
    assert s.next_request().think_time_s == pytest.approx((80 - 71) / 2)  # t - (t + api_time)
    assert s.next_request() is None
    assert any("after sub-agents" in n for n in wl.notes)
    # the open-loop order: original timestamps, every conversation from 0
    offs = [r.arrival_offset_s for r in wl.requests()]
    assert offs == sorted(offs) and len(offs) == 7


def test_min_tokens_and_limits(tmp_path):
    doc = {"id": "c", "block_size": 4, "tool_tokens": 0, "system_tokens": 0, "requests": [
        {"t": 0, "type": "n", "in": 8, "out": 20, "hash_ids": [1, 2]}]}
    for k in range(3):
        (tmp_path / f"c{k}.json").write_text(json.dumps({**doc, "id": f"c{k}"}))
    r = next(load(tmp_path, min_tokens=True, max_output_tokens=9).requests())
    assert r.max_tokens == r.min_tokens == 9
    assert len(load(tmp_path, conversations=2).conversations) == 2
    orders = {tuple(x.session_id for x in build_spec(
        "ag", TraceSpec(format="agentic", path=str(tmp_path)), TOK, seed).sessions())
        for seed in range(6)}
    assert len(orders) > 1 and all(sorted(o) == ["ag-c0", "ag-c1", "ag-c2"] for o in orders)
    assert [x.session_id for x in load(tmp_path).sessions()] == \
        [x.session_id for x in load(tmp_path).sessions()]  # the same seed, the same order
    assert guess_format(tmp_path) == "agentic" and guess_format(tmp_path / "c0.json") == "agentic"
    with pytest.raises(ValueError, match="agentic"):
        TraceSpec(format="mooncake", path="x", shared_prefix=0.5)


# -- the real traces ----------------------------------------------------------------------

def independent_summary(d: Path) -> dict:
    """Plain JSON, no reader: conversations, requests (sub-agents' included), sub-agent
    sessions, and the block hit ratios: an id seen earlier in the request's own session or,
    for a sub-agent, in its parent before the spawn; and an id seen earlier in the file."""
    convs = reqs = subs = blocks_n = hits = wide = 0
    for f in sorted(d.glob("*.json")):
        doc = json.loads(f.read_text())
        convs += 1
        main_seen, file_seen = set(), set()
        for r in doc["requests"]:
            if r["type"] == "subagent":
                subs += 1
                own, parent = set(), set(main_seen)
            else:
                own, parent = main_seen, set()
            for q in r["requests"] if r["type"] == "subagent" else [r]:
                reqs += 1
                blocks_n += len(q["hash_ids"])
                hits += sum(h in own or h in parent for h in q["hash_ids"])
                wide += sum(h in file_seen for h in q["hash_ids"])
                own.update(q["hash_ids"])
                file_seen.update(q["hash_ids"])
    return {"conversations": convs, "requests": reqs, "subagent_sessions": subs,
            "ratio": hits / blocks_n, "wide": wide / blocks_n}


def test_describe_real_folder_matches_plain_json(capsys):
    from kvbench.cli import main

    d = real_traces()
    want = independent_summary(d)
    assert want["conversations"] == 244 and want["requests"] == 4412
    assert want["subagent_sessions"] == 14
    assert main(["workloads", "describe", str(d), "--json", "--config", "/nonexistent"]) == 0
    out = json.loads(capsys.readouterr().out)[str(d)]
    a = out["agentic"]
    assert out["requests"] == a["requests"] == 4412 and a["conversations"] == 244
    assert a["subagent_sessions"] == 14
    assert a["within_conversation_block_hit_ratio"] == pytest.approx(want["ratio"], abs=1e-12)
    assert a["conversation_wide_block_hit_ratio"] == pytest.approx(want["wide"], abs=1e-12)
    assert a["context_last_request"]["p50"] > a["context_first_request"]["p50"]
    from kvbench.commands.workloads import format_table

    text = format_table({str(d): out})  # what the command prints without --json
    assert "244 conversations, 4,412 requests" in text
    assert "earlier request of its own session or, for a sub-agent, of its parent" in text


def test_real_blocks_align_as_the_server_sees_them():
    d = real_traces()
    wl = load(d / "trace_0274.json")  # three sub-agents, two of them overlapping
    sess = next(wl.sessions())
    items = drain(sess)
    spawns = [x for x in items if isinstance(x, Spawn)]
    assert sum(len(s.sessions) for s in spawns) == 3
    reqs = [x for x in items if isinstance(x, Request)][:12]
    docs = json.loads((d / "trace_0274.json").read_text())
    by_id = {}
    for rec in docs["requests"]:
        for r in rec.get("requests", [rec]) if rec["type"] == "subagent" else [rec]:
            by_id.setdefault(len(by_id), r)
    toks = [blocks(server_tokens(r), 64) for r in reqs]
    recs = [by_id[i] for i in range(len(reqs))]
    for i in range(len(reqs)):
        assert reqs[i].prompt_tokens == max(recs[i]["in"], 64 * len(recs[i]["hash_ids"]) + wl.tail)
        for j in range(i):
            a, b = recs[i]["hash_ids"], recs[j]["hash_ids"]
            for k in range(min(len(a), len(b))):
                assert (toks[i][k] == toks[j][k]) is (a[k] == b[k])


# -- bench/bakeoff_sim.py learns the format ------------------------------------------------

PROFILE = """[profiles.p]
pacing = "poisson"
stages = [{ rate_rps = 1.0, duration_s = 1 }]
"""

def test_bakeoff_sim_replays_agentic_sessions(tmp_path):
    """The sim's loading path (the config's workload through the registry) turns an agentic
    trace into sessions: equal hash ids give equal engine block hashes, sub-agents become
    spawns, and the --users grid replays them on the built-in engines."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from kvbench_cli import tiny_chat_config

    d = tmp_path / "traces"
    d.mkdir()
    sub = {"t": 0, "type": "s", "in": 70, "out": 5, "hash_ids": [90], "think_time": 0}
    for k in range(3):
        doc = {"id": f"c{k}", "block_size": 64, "tool_tokens": 30, "system_tokens": 34,
               "requests": [
                   {"t": 0, "type": "s", "in": 130, "out": 8, "hash_ids": [1, 2],
                    "api_time": 1.0},
                   {"t": 3, "type": "subagent", "tool_tokens": 0, "system_tokens": 0,
                    "duration_ms": 2000, "requests": [sub, {**sub, "t": 1}]},
                   {"t": 4, "type": "subagent", "tool_tokens": 0, "system_tokens": 0,
                    "requests": [sub]},
                   {"t": 9, "type": "n", "in": 200, "out": 8, "hash_ids": [1, 2, 3],
                    "think_time": 2.0}]}
        (d / f"c{k}.json").write_text(json.dumps(doc))
    cfg = tmp_path / "bench.toml"
    cfg.write_text(tiny_chat_config("tiny", 4, PROFILE, 500.0)
                   .replace("@RESULTS@", str(tmp_path / "results"))
                   + f'\n[workloads.ag]\nkind = "trace"\nformat = "agentic"\npath = "{d}"\n')
    sys.path.insert(0, str(root / "bench"))
    import bakeoff_sim

    convs, slo = bakeoff_sim.prompts(cfg, "ag")
    assert len(convs) == 3 and slo["chat"]["ttft_ms"] == 500
    c0 = convs[0]
    kinds = [x[0] for x in c0]
    assert kinds == ["req", "spawn", "req"]  # the overlapping sub-agents are one spawn
    first, spawn, last = c0
    assert len(spawn[2]) == 2 and spawn[1] == pytest.approx(2.0)  # 3 - (0 + 1.0)
    assert last[3][:8] == first[3][:8]  # blocks 1, 2 (4 engine blocks each) hit
    assert len(first[3]) == 8 and last[3][8] not in first[3]
    assert convs[1][0][3][:4] == first[3][:4]  # the shared tool/system block
    assert convs[1][0][3][4] != first[3][4]  # the conversation's own block
    assert last[7] is False and first[7] is True
    # the recorded offsets, never before the previous answer: sub-agents overlap, the parent
    # waits for both; non-streaming requests have no TTFT
    rows = bakeoff_sim.run_sessions("colocated", {"max_num_seqs": 4, "replicas": 1},
                                    convs[:1], 1, 10.0, 1, replay="timestamps")
    ts = [r["t"] for r in rows[:5]]
    assert len(rows) >= 5 and all(r["ok"] for r in rows)
    assert ts[0] == pytest.approx(0, abs=0.01) and min(ts[1:4]) >= 3 - 1e-9 and ts[4] >= 9
    subs = rows[1:4]
    # sub-agent 0 at 3 and 3 + 1, sub-agent 1 at 4: both at 4 at once (run one after the
    # other, the second would wait for the first's answer)
    assert sorted(ts[1:4]) == pytest.approx([3, 4, 4], abs=1e-6)
    assert ts[4] >= max(r["t"] + r["e2e_ms"] / 1e3 for r in subs) - 1e-9
    assert np.isnan(rows[4]["ttft_ms"]) and not np.isnan(rows[0]["ttft_ms"])
    p = subprocess.run(
        [sys.executable, str(root / "bench" / "bakeoff_sim.py"), "--config", str(cfg),
         "--workload", "ag", "--topologies", "colocated", "--users", "1,3", "--seconds",
         "20", "--warmup-s", "0", "--time-scale", "1"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ag: 3 conversations" in p.stdout and "sessions at 95%" in p.stdout
    rows = [line.split() for line in p.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "3"] and all(int(r[1]) > 0 for r in rows)
    assert all(0 < float(r[-1]) < 1 for r in rows)  # the engine's prefix hit ratio


def test_warm_cache_primes_only_the_shared_tool_and_system_prefix(tmp_path):
    """``cache = "warm"`` primes what every conversation shares, not each one's history."""
    from kvbench.runs.cache import shared_prefixes

    for k in range(3):
        doc = {"id": f"c{k}", "block_size": 16, "tool_tokens": 16, "system_tokens": 16,
               "requests": [{"t": 0, "type": "s", "in": 50, "out": 2, "hash_ids": [1, 2, 3]},
                            {"t": 5, "type": "s", "in": 70, "out": 2,
                             "hash_ids": [1, 2, 3, 4]}]}
        (tmp_path / f"c{k}.json").write_text(json.dumps(doc))
    wl = load(tmp_path)
    reqs = list(wl.sessions())[0]
    first, second = reqs.next_request(), reqs.next_request()
    assert not first.prefix_from_responses and second.prefix_from_responses
    assert second.shared_prefix_tokens > first.shared_prefix_tokens > 0
    primed = shared_prefixes(wl, TOK)
    assert len(primed) == 1 and TOK.count(primed[0]) == first.shared_prefix_tokens


# -- a HuggingFace tokenizer with its own chat template --------------------------------------

HF_TEMPLATE = ("{{ bos_token }}\n"
               "{% for m in messages %}\n"
               "    <|{{ m['role'] }}|> {{ m['content'] }}\n"
               "{% endfor %}\n"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    """A word-level tokenizer with BOS added by its post-processor and rendered by its chat
    template (built here, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from kvbench.workloads.tokenizer import HFTokenizer, _builtin_vocabulary

    d = tmp_path_factory.mktemp("hf")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|user|>": 3, "<|assistant|>": 4}
    vocab.update({w: i for i, w in enumerate(_builtin_vocabulary()[:300], len(vocab))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": HF_TEMPLATE}))
    return HFTokenizer(d / "tokenizer.json")


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=conversation(), api=st.sampled_from(["chat", "completions"]))
def test_blocks_align_under_a_models_chat_template(tmp_path_factory, hf_tok, doc, api):
    d = tmp_path_factory.mktemp("ag")
    (d / "c0.json").write_text(json.dumps(doc))
    wl = build_spec("ag", TraceSpec(format="agentic", path=str(d), api=api), hf_tok, 0)
    assert (wl.head, wl.tail) == ((2, 1) if api == "chat" else (1, 0))  # BOS, role; asst
    bs = doc["block_size"]
    reqs = [x for x in drain(next(wl.sessions())) if isinstance(x, Request)]
    recs = flat_records(doc)
    toks = []
    for (_, rec), r in zip(recs, reqs):
        ids = hf_tok.encode(hf_tok.render_chat(r.messages)) if api == "chat" \
            else hf_tok.encode_prompt(r.prompt)
        assert r.prompt_tokens == len(ids)
        assert r.prompt_tokens == max(rec["in"], len(rec["hash_ids"]) * bs + wl.tail,
                                      wl.head + wl.tail + 1)
        toks.append(blocks(ids, bs))
    for i in range(len(recs)):
        for j in range(i):
            a, b = recs[i][1]["hash_ids"], recs[j][1]["hash_ids"]
            c = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            assert toks[i][:c] == toks[j][:c]
            if c < len(a) and c < len(b):
                assert toks[i][c] != toks[j][c]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=conversation(), engine_block=st.sampled_from([8, 16, 32]))
def test_describe_sent_from_hash_ids_equals_tokenizing_the_prompts(tmp_path_factory, doc,
                                                                  engine_block):
    """A run's report names the sent requests' blocks from the hash ids; what it finds is what
    tokenizing the very prompts finds (full trace blocks hit alike, the text after the last
    one is each request's own)."""
    from kvbench.workloads.describe import describe_sent

    if doc["block_size"] % engine_block:
        return
    d = tmp_path_factory.mktemp("ag")
    (d / "c0.json").write_text(json.dumps(doc))
    wl = load(d)
    reqs = list(wl.requests())
    ids = [r.request_id for r in reqs] + ["ag-nope-t0000"]
    fast = describe_sent(wl, ids, block_tokens=engine_block)

    class Plain:  # the same requests, without sent_blocks: tokenized
        tokenizer = TOK

        def requests(self):
            return iter(reqs)

    slow = describe_sent(Plain(), ids, block_tokens=engine_block)
    for key in ("requests", "unmatched", "total_prompt_tokens"):
        assert fast[key] == slow[key]
    assert fast["unique_tokens"] == slow["unique_tokens"]
    assert fast["theoretical_hit_ratio_unbounded"] == slow["theoretical_hit_ratio_unbounded"]


def test_hash_id_scope_and_repeated_ids(tmp_path):
    """"local" ids name blocks within their file (equal ids in two files differ), "global"
    ones across the files; two files with one id stay two sessions."""
    def write(name, cid, scope):
        doc = {"id": cid, "block_size": 8, "tool_tokens": 0, "system_tokens": 0,
               "hash_id_scope": scope,
               "requests": [{"t": 0, "type": "s", "in": 24, "out": 1, "hash_ids": [7, 8, 9]}]}
        (tmp_path / name).write_text(json.dumps(doc))

    for scope, equal in (("local", False), ("global", True)):
        write("a.json", "x", scope)
        write("b.json", "x", scope)
        wl = load(tmp_path)
        ra, rb = (s.next_request() for s in wl.sessions())
        assert ra.session_id != rb.session_id
        assert (blocks(server_tokens(ra), 8) == blocks(server_tokens(rb), 8)) is equal
    write("a.json", "x", "galactic")
    with pytest.raises(UserError, match="a.json: hash_id_scope"):
        load(tmp_path)


def test_cli_describe_small_folder_and_shared_prefix_option(tmp_path, capsys):
    from kvbench.cli import main

    doc = {"id": "c", "block_size": 8, "tool_tokens": 8, "system_tokens": 8, "requests": [
        {"t": 0, "type": "s", "in": 24, "out": 1, "hash_ids": [1, 2, 3]},
        {"t": 5, "type": "n", "in": 32, "out": 1, "hash_ids": [1, 2, 3, 4]}]}
    for k in range(2):
        (tmp_path / f"c{k}.json").write_text(json.dumps({**doc, "id": f"c{k}"}))
    args = ["workloads", "describe", str(tmp_path), "--json", "--config", "/nonexistent"]
    got = {}
    for opt in ("shared", "per_conversation", "0.5"):
        assert main(args + ["--shared-prefix", opt]) == 0
        got[opt] = json.loads(capsys.readouterr().out)[str(tmp_path)]
    a = got["shared"]["agentic"]
    assert (a["conversations"], a["requests"], a["blocks"], a["block_hits"]) == (2, 4, 14, 6)
    # the second conversation's 2 prefix blocks hit only when shared (1 when half of it is)
    hits = {k: v["total_prompt_tokens"] - v["unique_tokens"] for k, v in got.items()}
    assert hits["shared"] - hits["per_conversation"] == 2 * 8
    assert hits["0.5"] - hits["per_conversation"] == 8
    assert main(args + ["--shared-prefix", "1.5"]) != 0
    assert "--shared-prefix '1.5' is not shared, per_conversation or a fraction" in \
        capsys.readouterr().err


# -- end to end: the reader's sessions through the real driver and the built-in endpoint -----

def test_replay_through_locust_hits_exactly_the_blocks_the_ids_share(tmp_path):
    """A real Locust run of a config's agentic workload against the built-in endpoint: every
    request carries its session's header, sub-agents their parent, the non-streaming turn
    goes without streaming, the server counts the trace's input lengths, and its cache finds
    exactly the blocks whose hash ids were sent before (the theoretical hit, per request)."""
    import subprocess
    import sys

    from kvbench.core.store import read_table

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from kvbench_cli import tiny_chat_config

    d = tmp_path / "traces"
    d.mkdir()
    sub = {"t": 0, "type": "s", "in": 300, "out": 5, "hash_ids": [90, 91, 92, 93],
           "think_time": 0}
    doc = {"id": "c0", "block_size": 64, "tool_tokens": 64, "system_tokens": 64, "requests": [
        {"t": 0, "type": "s", "in": 400, "out": 8, "hash_ids": [1, 2, 3, 4, 5, 6],
         "api_time": 0.2},
        {"t": 1, "type": "subagent", "tool_tokens": 0, "system_tokens": 128,
         "duration_ms": 2000, "requests": [
             sub, {**sub, "t": 0.5, "in": 400, "hash_ids": [90, 91, 92, 93, 94, 95]}]},
        {"t": 1.2, "type": "subagent", "tool_tokens": 0, "system_tokens": 128,
         "requests": [sub]},
        {"t": 4, "type": "n", "in": 500, "out": 8, "hash_ids": [1, 2, 3, 4, 5, 6, 7],
         "think_time": 0.3}]}
    (d / "c0.json").write_text(json.dumps(doc))
    cfg = tmp_path / "bench.toml"
    closed = '[profiles.p]\npacing = "closed"\nstages = [{ users = 1, duration_s = 60 }]\n'
    cfg.write_text(tiny_chat_config("tiny", 4, closed, 500.0)
                   .replace("@RESULTS@", str(tmp_path / "results"))
                   + f'\n[workloads.ag]\nkind = "trace"\nformat = "agentic"\npath = "{d}"\n')
    log = tmp_path / "requests.log"
    srv = subprocess.Popen([sys.executable, str(root / "tests" / "agentic_sessions.py"),
                            json.dumps({"time_scale": 0.1}), str(log)], cwd=root,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        assert "listening on" in line, line + srv.stderr.read()
        url = line.split("listening on", 1)[1].strip()
        p = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadgen/job.py", "--headless", "--host",
             url, "-u", "1", "-r", "1", "-t", "90s", "--only-summary", "--kvbench-config",
             str(cfg), "--kvbench-workload", "ag", "--kvbench-requests", "5",
             "--kvbench-results", str(tmp_path / "res"), "--kvbench-run-id", "r"],
            cwd=root, capture_output=True, text=True, timeout=150)
        assert p.returncode == 0, p.stderr[-3000:]
    finally:
        srv.kill()
        srv.wait(10)
        srv.stdout.close()
        srv.stderr.close()
    rows = {r["request_id"]: r for r in read_table(tmp_path / "res" / "r",
                                                   "requests").to_pylist()}
    want = {  # request id: (parent, sub-agent index, streamed, input, blocks sent before)
        "ag-c0-t0000": ("", -1, True, 400, 0),
        "ag-c0-s0-t0000": ("ag-c0", 0, True, 300, None),
        "ag-c0-s1-t0000": ("ag-c0", 1, True, 300, None),  # the siblings' 4 shared blocks
        "ag-c0-s0-t0001": ("ag-c0", 0, True, 400, 4),
        "ag-c0-t0001": ("", -1, False, 500, 6),
    }
    assert set(rows) == set(want)
    for rid, (parent, idx, streamed, n_in, hit_blocks) in want.items():
        r = rows[rid]
        assert (r["parent_session_id"], r["subagent_index"], r["streamed"]) == \
            (parent, idx, streamed) and r["status"] == "ok"
        assert r["prompt_tokens"] == n_in
        if hit_blocks is not None:
            assert r["cached_tokens"] == 64 * hit_blocks
        assert (r["ttft_ns"] is None) is (not streamed)
    # the siblings start at once: whichever the engine computes second finds the first's 4
    # blocks, unless both were prefilled together
    assert sorted(rows[f"ag-c0-s{i}-t0000"]["cached_tokens"] for i in (0, 1)) in \
        ([0, 0], [0, 256])
    sent = [json.loads(x) for x in log.read_text().splitlines()]
    assert {(rid, sid) for rid, sid, _ in sent} == {(rid, rows[rid]["session_id"])
                                                    for rid in want}
    assert all(body["stream"] is rows[rid]["streamed"] for rid, _, body in sent)
