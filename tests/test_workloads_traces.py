"""Trace readers on small files the tests write, and on the real public traces when present."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kvbench.core.errors import UserError
from kvbench.workloads.describe import describe
from kvbench.workloads.registry import build_spec
from kvbench.workloads.tokenizer import get_tokenizer
from kvbench.workloads.traces import TraceSpec, guess_format
from kvbench.workloads.traces.azure import parse_timestamp
from kvbench.workloads.traces.lmcache_agent import common_prefix_len

TOK = get_tokenizer()


def real_traces() -> Path:
    env = os.environ.get("KVBENCH_TRACES")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "traces"
    if not d.is_dir():
        pytest.skip(f"real traces not found at {d} (set KVBENCH_TRACES to their folder)")
    return d


def trace(tmp_path, fmt, content, **kw):
    if isinstance(content, dict):  # lmcache: {file name: lines}
        p = tmp_path / "sessions"
        p.mkdir()
        for name, lines in content.items():
            (p / name).write_text("\n".join(lines) + "\n")
    else:
        p = tmp_path / ("t.csv" if fmt == "azure" else "t.jsonl")
        p.write_text(content)
    return build_spec("tr", TraceSpec(format=fmt, path=str(p), **kw), TOK, 0)


def _mc(ts, n_in, n_out, ids):
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": ids})


def _sent_tokens(r):
    return TOK.tokens(TOK.render_chat(r.messages) if r.messages is not None else r.prompt)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_mooncake_blocks_and_exact_lengths(tmp_path, api):
    lines = [_mc(0, 1200, 50, [1, 2, 3]), _mc(0, 1100, 60, [1, 2, 4]),
             _mc(3000, 600, 0, [9, 10]), _mc(3000, 1536, 7, [1, 2, 3])]
    wl = trace(tmp_path, "mooncake", "\n".join(lines) + "\n", api=api)
    reqs = list(wl.requests())
    assert [r.prompt_tokens for r in reqs] == [1200, 1100, 600, 1536]
    assert [r.max_tokens for r in reqs] == [50, 60, 1, 7]
    assert [r.arrival_offset_s for r in reqs] == [0.0, 0.0, 3.0, 3.0]
    assert wl.has_arrivals and all(r.request_class == "trace" for r in reqs)
    t = [_sent_tokens(r) for r in reqs]
    assert [len(x) for x in t] == [r.prompt_tokens for r in reqs]
    head = 5 if api == "chat" else 0  # the chat template's opening tokens
    # ids [1, 2] in common: exactly 1024 tokens of equal text, then different text
    assert t[0][: head + 1024] == t[1][: head + 1024]
    assert t[0][head + 1024] != t[1][head + 1024]
    # same ids [1, 2, 3]: the longer prompt starts with the shorter one's blocks
    assert t[3][: head + 1024] == t[0][: head + 1024]
    assert t[2][head] != t[0][head]
    assert [r.shared_prefix_tokens for r in reqs] == [0, head + 1024, 0, head + 1536 - (
        11 if api == "chat" else 0)]
    d = describe(wl)
    assert d["block_tokens"] == 512
    # leading full blocks seen before: the 2nd and 4th requests hit blocks 1, 2; block 3 was
    # partial in the 1st request, and partial blocks are never cached
    assert d["theoretical_hit_ratio_unbounded"] == pytest.approx((1024 + 1024) / 4436)


def test_mooncake_jitter_speedup_limit(tmp_path):
    lines = [_mc(3000 * (i // 4), 10, 5, [i]) for i in range(40)]
    content = "\n".join(lines) + "\n"
    plain = trace(tmp_path, "mooncake", content, speedup=2.0, limit=12)
    offs = [r.arrival_offset_s for r in plain.requests()]
    assert offs == [0.0] * 4 + [1.5] * 4 + [3.0] * 4
    (tmp_path / "t.jsonl").unlink()
    jit = trace(tmp_path, "mooncake", content, jitter_s=3.0, seed=1)
    a = [r.arrival_offset_s for r in jit.requests()]
    assert a == sorted(a) and len(set(a)) == 40
    assert all(0 <= x < 30 for x in a)
    b = [r.arrival_offset_s for r in jit.requests()]
    assert a == b


def test_mooncake_malformed_lines(tmp_path):
    good = _mc(0, 10, 5, [1])
    content = "\n".join([good, "{not json", _mc(0, 1000, 5, [1]), good, "[1]",
                         json.dumps({"timestamp": 0})]) + "\n"
    with pytest.raises(UserError, match=r"t\.jsonl:2: not valid JSON"):
        trace(tmp_path, "mooncake", content)
    wl = build_spec("tr", TraceSpec(format="mooncake", path=str(tmp_path / "t.jsonl"),
                                    skip_bad_lines=True), TOK, 0)
    assert len(list(wl.requests())) == 2
    assert wl.skipped_lines == 4
    assert "skipped 4 malformed" in describe(wl)["notes"][0]
    (tmp_path / "t.jsonl").write_text(good + "\n" + _mc(0, 1000, 5, [1]) + "\n")
    with pytest.raises(UserError, match=r"t\.jsonl:2: hash_ids has 1 ids but input_length "
                                        r"1000 needs 2"):
        build_spec("tr", TraceSpec(format="mooncake", path=str(tmp_path / "t.jsonl")), TOK, 0)


@settings(max_examples=30, deadline=None)
@given(recs=st.lists(st.tuples(st.integers(0, 10**7), st.integers(1, 3000),
                               st.integers(0, 2000)), min_size=1, max_size=8))
def test_mooncake_property_lengths(tmp_path_factory, recs):
    d = tmp_path_factory.mktemp("mc")
    lines = [_mc(ts, n, o, list(range(i * 10, i * 10 + -(-n // 512))))
             for i, (ts, n, o) in enumerate(recs)]
    (d / "t.jsonl").write_text("\n".join(lines))
    wl = build_spec("p", TraceSpec(format="mooncake", path=str(d / "t.jsonl"),
                                   api="completions"), TOK, 0)
    reqs = list(wl.requests())
    assert sorted(r.prompt_tokens for r in reqs) == sorted(n for _, n, _ in recs)
    assert all(TOK.count(r.prompt) == r.prompt_tokens for r in reqs)
    offs = [r.arrival_offset_s for r in reqs]
    assert offs == sorted(offs)


def test_azure_reader(tmp_path):
    content = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
               "2023-11-16 18:17:03.9799600,4808,10\n"
               "2023-11-16 18:17:04.0319600,31,8\n"
               "\n"
               "2023-11-17 00:00:00.0000001,200,0\n")
    wl = trace(tmp_path, "azure", content, max_output_tokens=9)
    reqs = list(wl.requests())
    assert [r.prompt_tokens for r in reqs] == [4808, 31, 200]
    assert [r.max_tokens for r in reqs] == [9, 8, 1]
    assert reqs[0].arrival_offset_s == 0.0
    assert reqs[1].arrival_offset_s == pytest.approx(0.052)
    assert reqs[2].arrival_offset_s == pytest.approx(
        parse_timestamp("2023-11-17 00:00:00.0000001")
        - parse_timestamp("2023-11-16 18:17:03.9799600"), abs=1e-6)
    assert all(len(_sent_tokens(r)) == r.prompt_tokens for r in reqs)
    assert describe(wl)["theoretical_hit_ratio_unbounded"] == 0.0


def test_azure_timestamp_parsing():
    assert parse_timestamp("1970-01-02 00:00:01.5") == 86401.5
    assert parse_timestamp("2023-11-16 18:17:04.0319600") - \
        parse_timestamp("2023-11-16 18:17:03.9799600") == pytest.approx(0.052)


def test_azure_malformed(tmp_path):
    bad = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
           "2023-11-16 18:17:03.9799600,4808,10\n"
           "2023-11-16 18:17:0x.9,10,10\n"
           "2023-11-16 18:17:05.0,ten,10\n"
           "2023-11-16 18:17:06.0,10\n")
    with pytest.raises(UserError, match=r"t\.csv:3: TIMESTAMP"):
        trace(tmp_path, "azure", bad)
    wl = build_spec("a", TraceSpec(format="azure", path=str(tmp_path / "t.csv"),
                                   skip_bad_lines=True), TOK, 0)
    assert len(list(wl.requests())) == 1 and wl.skipped_lines == 3
    (tmp_path / "t.csv").write_text("time,tokens\n1,2\n")
    with pytest.raises(UserError, match=r"t\.csv:1: the header lacks"):
        build_spec("a", TraceSpec(format="azure", path=str(tmp_path / "t.csv"),
                                  skip_bad_lines=True), TOK, 0)


def test_lmcache_agent_reader(tmp_path):
    def rec(ts, i, o, sid="s1"):
        return json.dumps({"timestamp": ts, "input": i, "output": o, "session_id": sid})

    base = "You are an agent. Fix the bug in parse.py."
    files = {
        "a.jsonl": [rec(3_000_000, base + " step 2 result", "done"),
                    rec(1_000_000, base, "look at the file"),
                    rec(2_000_000, "", "empty input"),
                    rec(2_500_000, base + " x", "")],
        "b.jsonl": [rec(2_000_000, "Other task entirely.", "ok", "s2")],
    }
    wl = trace(tmp_path, "lmcache_agent", files, speedup=2.0)
    reqs = list(wl.requests())
    assert wl.skipped_records == 2
    assert any("skipped 2 record" in n for n in wl.notes)
    assert [r.session_id for r in reqs] == ["tr-s1", "tr-s2", "tr-s1"]
    assert [r.arrival_offset_s for r in reqs] == [0.0, 0.5, 1.0]
    assert reqs[0].messages[0]["content"] == base
    assert reqs[2].turn == 1 and reqs[0].turn == 0
    assert reqs[0].max_tokens == TOK.count("look at the file")
    assert all(r.prompt_tokens == TOK.count_chat(r.messages) for r in reqs)
    # turn 1 shares the first prompt's text: header plus the base prompt
    assert reqs[2].shared_prefix_tokens == 5 + TOK.count(base)
    assert reqs[0].shared_prefix_tokens == 0
    sessions = list(wl.sessions())
    assert [s.turns for s in sessions] == [2, 1]
    s = sessions[0]
    assert s.next_request() == reqs[0]
    s.feed_response("whatever the endpoint said")
    assert s.next_request() == reqs[2] and s.next_request() is None


def test_lmcache_bad_line_and_empty_dir(tmp_path):
    with pytest.raises(UserError, match=r"a\.jsonl:1: not valid JSON"):
        trace(tmp_path, "lmcache_agent", {"a.jsonl": ["{oops"]})
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(UserError, match="no .jsonl session files"):
        build_spec("x", TraceSpec(format="lmcache_agent", path=str(empty)), TOK, 0)
    with pytest.raises(UserError, match="does not exist"):
        build_spec("x", TraceSpec(format="azure", path=str(tmp_path / "nope.csv")), TOK, 0)


@settings(max_examples=200, deadline=None)
@given(a=st.text(alphabet="ab", max_size=9000), b=st.text(alphabet="ab", max_size=9000))
def test_common_prefix_len(a, b):
    n = common_prefix_len(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


def test_guess_format(tmp_path):
    (tmp_path / "m.jsonl").write_text(_mc(0, 1, 1, [1]) + "\n")
    (tmp_path / "l.jsonl").write_text('{"timestamp": 1, "input": "x", "output": "y"}\n')
    (tmp_path / "a.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert guess_format(tmp_path / "m.jsonl") == "mooncake"
    assert guess_format(tmp_path / "l.jsonl") == "lmcache_agent"
    assert guess_format(tmp_path / "a.csv") == "azure"
    assert guess_format(tmp_path) == "lmcache_agent"


# ---- the real traces (numbers nobody on the project computed: from their READMEs) ----

def test_real_mooncake():
    d = real_traces() / "mooncake"
    wl = build_spec("mc", TraceSpec(format="mooncake",
                                    path=str(d / "conversation_trace.jsonl")), TOK, 0)
    assert len(wl) == 12031
    s = describe(wl, capacity_tokens=2_000_000)
    assert s["requests"] == 12031 and s["block_tokens"] == 512
    assert 0 < s["theoretical_hit_ratio_lru"] < s["theoretical_hit_ratio_unbounded"] < 1
    it = wl.requests()
    for _ in range(20):
        r = next(it)
        assert r.prompt_tokens == TOK.count_chat(r.messages)
    syn = build_spec("ms", TraceSpec(format="mooncake", path=str(d / "synthetic_trace.jsonl"),
                                     limit=100), TOK, 0)
    assert len(list(syn.requests())) == 100


def test_real_azure():
    d = real_traces() / "azure2023"
    code = build_spec("az", TraceSpec(format="azure",
                                      path=str(d / "AzureLLMInferenceTrace_code.csv")), TOK, 0)
    conv = build_spec("az", TraceSpec(format="azure",
                                      path=str(d / "AzureLLMInferenceTrace_conv.csv")), TOK, 0)
    assert (len(code), len(conv)) == (8819, 19366)
    assert code.offsets_s[code.order[-1]] > 3000  # about an hour of arrivals
    r = next(iter(code.requests()))
    assert (r.prompt_tokens, r.max_tokens) == (4808, 10)


def test_real_lmcache_agent():
    d = real_traces() / "lmcache-agent"
    mini = build_spec("mini", TraceSpec(format="lmcache_agent", path=str(d / "miniswe")),
                      TOK, 0)
    mag = build_spec("mag", TraceSpec(format="lmcache_agent", path=str(d / "magagent")),
                     TOK, 0)
    assert len(list(mini.sessions())) == 20 and len(list(mag.sessions())) == 25
    assert mag.skipped_records > 0
    # consecutive mini-SWE requests share most of their prefix (the README says ~95%)
    s = describe(mini)
    assert s["theoretical_hit_ratio_unbounded"] > 0.85
    assert s["shared_prefix_ratio"] > 0.85


# ---------------------------------------------------------------- damaged and empty traces

@pytest.mark.parametrize("fmt, content", [
    ("mooncake", ""), ("mooncake", "\n\n"), ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n"),
    ("azure", ""), ("lmcache_agent", {"a.jsonl": [""]}),
    ("lmcache_agent", {"a.jsonl": [json.dumps({"timestamp": 1, "input": "", "output": "x"})]}),
])
def test_empty_or_header_only_trace_is_an_error(tmp_path, fmt, content):
    with pytest.raises(UserError) as ei:
        trace(tmp_path, fmt, content)
    msg = str(ei.value)
    assert str(tmp_path) in msg and "\n" not in msg
    assert "no requests" in msg or "empty" in msg


def test_all_lines_skipped_is_an_error_naming_the_first(tmp_path):
    with pytest.raises(UserError,
                       match=r"all 2 of its lines are malformed, the first: .*t\.jsonl:1"):
        trace(tmp_path, "mooncake", "{oops\n[1]\n", skip_bad_lines=True)


@pytest.mark.parametrize("line, field", [
    (_mc(1e30, 10, 5, [1]), "timestamp"),
    (_mc(-1, 10, 5, [1]), "timestamp"),
    (_mc(True, 10, 5, [1]), "timestamp"),
    (_mc(0, 10, True, [1]), "output_length"),
    (_mc(0, 10, 5.0, [1]), "output_length"),
    (_mc(0, 10, 10**12, [1]), "output_length"),
    (_mc(0, True, 5, [1]), "input_length"),
    (_mc(0, 10**12, 5, [1]), "input_length"),
    (_mc(0, 10, 5, [True]), "hash_ids"),
])
def test_mooncake_rejects_damaged_fields(tmp_path, line, field):
    good = _mc(0, 10, 5, [1])
    with pytest.raises(UserError, match=rf"t\.jsonl:2: {field} "):
        trace(tmp_path, "mooncake", good + "\n" + line + "\n")


@pytest.mark.parametrize("sid", [1.5, True, None, 7, "", "x" * 300])
def test_lmcache_rejects_a_session_id_that_is_not_a_name(tmp_path, sid):
    line = json.dumps({"timestamp": 1, "input": "a", "output": "b", "session_id": sid})
    with pytest.raises(UserError, match=r"a\.jsonl:1: session_id "):
        trace(tmp_path, "lmcache_agent", {"a.jsonl": [line]})


@pytest.mark.parametrize("ts", [1e30, -5, True, "1"])
def test_lmcache_rejects_damaged_timestamps(tmp_path, ts):
    line = json.dumps({"timestamp": ts, "input": "a", "output": "b", "session_id": "s"})
    with pytest.raises(UserError, match=r"a\.jsonl:1: timestamp "):
        trace(tmp_path, "lmcache_agent", {"a.jsonl": [line]})


# Values a damaged line may hold in any field, besides sane ones.
_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
                 st.lists(st.integers(0, 5), max_size=3))


def _mc_valid(rec) -> bool:
    ts, n_in, n_out, ids = (rec.get(k) for k in ("timestamp", "input_length", "output_length",
                                                 "hash_ids"))
    return (type(ts) in (int, float) and 0 <= ts <= 366 * 86400e3
            and type(n_in) is int and 0 < n_in <= 10**7
            and type(n_out) is int and 0 <= n_out <= 10**7
            and isinstance(ids, list) and all(type(h) is int for h in ids)
            and len(ids) == -(-n_in // 512))


_mc_record = st.fixed_dictionaries({}, optional={
    "timestamp": st.one_of(st.integers(0, 10**9), _ANY),
    "input_length": st.one_of(st.integers(1, 1500), _ANY),
    "output_length": st.one_of(st.integers(0, 100), _ANY),
    "hash_ids": st.one_of(st.lists(st.integers(0, 9), min_size=1, max_size=3), _ANY)})


@settings(max_examples=150, deadline=None)
@given(recs=st.lists(_mc_record, min_size=1, max_size=6), skip=st.booleans())
def test_mooncake_property_damaged_lines(tmp_path_factory, recs, skip):
    d = tmp_path_factory.mktemp("mcd")
    (d / "t.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    valid = [_mc_valid(r) for r in recs]
    spec = TraceSpec(format="mooncake", path=str(d / "t.jsonl"), skip_bad_lines=skip,
                     api="completions")
    if all(valid) or (skip and any(valid)):
        wl = build_spec("p", spec, TOK, 0)
        reqs = list(wl.requests())
        assert sorted(r.prompt_tokens for r in reqs) == sorted(
            r["input_length"] for r, ok in zip(recs, valid) if ok)
        assert wl.skipped_lines == valid.count(False)
        return
    with pytest.raises(UserError) as ei:
        build_spec("p", spec, TOK, 0)
    msg = str(ei.value)
    assert "\n" not in msg and str(d / "t.jsonl") in msg
    if not skip:
        assert f"t.jsonl:{valid.index(False) + 1}: " in msg


_lm_record = st.fixed_dictionaries({"input": st.one_of(st.text("ab ", min_size=1, max_size=8),
                                                       _ANY),
                                    "output": st.one_of(st.just("ok"), _ANY)}, optional={
    "timestamp": st.one_of(st.integers(0, 2 * 10**15), _ANY),
    "session_id": st.one_of(st.sampled_from(["s1", "s2"]), _ANY)})


def _lm_kind(rec) -> str:
    """"bad" (a malformed line), "empty" (skipped record) or "ok"."""
    ts, i, o = rec.get("timestamp"), rec.get("input"), rec.get("output")
    sid = rec.get("session_id", "file")
    if type(ts) not in (int, float) or not 0 <= ts <= 4_102_444_800e6:
        return "bad"
    if not isinstance(sid, str) or not sid.strip() or len(sid) > 256:
        return "bad"
    if not isinstance(i, (str, type(None))) or not isinstance(o, (str, type(None))):
        return "bad"
    return "ok" if i and o else "empty"


@settings(max_examples=150, deadline=None)
@given(recs=st.lists(_lm_record, min_size=1, max_size=6), skip=st.booleans())
def test_lmcache_property_damaged_lines(tmp_path_factory, recs, skip):
    d = tmp_path_factory.mktemp("lmd")
    (d / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    kinds = [_lm_kind(r) for r in recs]
    spec = TraceSpec(format="lmcache_agent", path=str(d), skip_bad_lines=skip)
    if "ok" in kinds and (skip or "bad" not in kinds):
        wl = build_spec("p", spec, TOK, 0)
        assert len(list(wl.requests())) == kinds.count("ok")
        assert wl.skipped_lines == kinds.count("bad")
        assert wl.skipped_records == kinds.count("empty")
        return
    with pytest.raises(UserError) as ei:
        build_spec("p", spec, TOK, 0)
    msg = str(ei.value)
    assert "\n" not in msg and str(d) in msg
    if not skip and "bad" in kinds:
        assert f"a.jsonl:{kinds.index('bad') + 1}: " in msg


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(
    st.one_of(st.just("2023-11-16 18:17:03.97"), st.text("0123456789-: .x", max_size=26)),
    st.one_of(st.integers(1, 5000).map(str), st.text("0123456789-x", max_size=12)),
    st.one_of(st.integers(0, 500).map(str), st.text("0123456789-x", max_size=12))),
    max_size=5), skip=st.booleans())
def test_azure_property_damaged_rows(tmp_path_factory, rows, skip):
    d = tmp_path_factory.mktemp("az")
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{t},{c},{g}\n" for t, c, g in rows)
    (d / "t.csv").write_text(text)
    spec = TraceSpec(format="azure", path=str(d / "t.csv"), skip_bad_lines=skip)
    try:
        wl = build_spec("p", spec, TOK, 0)
    except UserError as exc:
        msg = str(exc)
        assert "\n" not in msg and str(d / "t.csv") in msg
        return
    reqs = list(wl.requests())
    assert 1 <= len(reqs) <= len(rows)
    assert all(0 < r.prompt_tokens for r in reqs)
    offs = [r.arrival_offset_s for r in reqs]
    assert offs == sorted(offs) and offs[0] == 0.0
