"""The agentic replay's session driver, session affinity and records (issue 36), with hand-built
sessions (tests/agentic_sessions.py), never the trace reader.

End to end: a real Locust subprocess replays the sessions against the built-in endpoint, run
in a subprocess with a middleware logging every request's headers (the endpoint's request
log). Times asserted are the records' own (t_sent, e2e, t_scheduled) and the
endpoint's modelled service times, never this host's wall-clock margins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from kvbench.core.checks import check_requests, scalar_problems
from kvbench.core.errors import DataError
from kvbench.core.store import read_table
from kvbench.endpoints.router import Router
from kvbench.endpoints.seq import Seq
from kvbench.loadgen.plan.sessions import SessionDriver
from kvbench.loadgen.timing.openai import parse_answer, request_body
from kvbench.workloads.base import Request, Spawn

import agentic_sessions as A

ROOT = Path(__file__).resolve().parent.parent
HEADER = "X-Session-ID"


# --------------------------------------------------------------------------- the endpoint

class LoggedEndpoint:
    """The built-in endpoint on 127.0.0.1 in a subprocess whose middleware logs every
    generation request (``agentic_sessions.serve_logged``); ``log``: (X-Request-Id,
    X-Session-ID or None, body JSON) of each, as the endpoint received them."""

    def __init__(self, log_path: Path, **options) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("agentic_sessions.py")),
             json.dumps(options), str(log_path)], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"the endpoint did not start: {line}{self.proc.stderr.read()}")
        self.url = line.split("listening on", 1)[1].strip()

    @property
    def log(self) -> list:
        if not self.log_path.exists():
            return []
        return [tuple(json.loads(ln)) for ln in self.log_path.read_text().splitlines()]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def endpoint(tmp_path):
    # 4 replicas behind round-robin: only the pin keeps a session's requests together
    ep = LoggedEndpoint(tmp_path / "requests.log", topology="routed", regions=1, replicas_per_region=4,
                        router="ROUND_ROBIN", pin_header=HEADER, time_scale=0.1)
    yield ep
    ep.close()


def locust(url: str, results: Path, workload: str, n: int, *extra, env=None):
    """A real headless Locust run of ``n`` requests of ``agentic_sessions:<workload>``."""
    import os

    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadgen/job.py", "--headless", "--host", url,
         "-u", "1", "-r", "1", "-t", "90s", "--only-summary", "--kvbench-config", "none",
         "--kvbench-workload", f"agentic_sessions:{workload}", "--kvbench-requests", str(n),
         "--kvbench-results", str(results), "--kvbench-run-id", "r", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return read_table(results / "r", "requests").to_pylist()


# --------------------------------------------------------------------------- end to end

def test_spawned_subagents_overlap_and_the_parent_waits_for_all(endpoint, tmp_path):
    rows = locust(endpoint.url, tmp_path, "spawn", 16)  # the session twice
    assert len(rows) == 16 and {r["status"] for r in rows} == {"ok"}
    # the second pass: every id renamed with its pass, the sub-agents' parent too
    again = [r for r in rows if r["session_id"].endswith("#1")]
    assert len(again) == 8
    assert {(r["session_id"], r["parent_session_id"], r["subagent_index"]) for r in again
            if r["parent_session_id"]} == {(f"p-sub{i}#1", "p#1", i) for i in range(3)}
    log = [e for e in endpoint.log if not e[0].endswith("#1")]
    rows = [r for r in rows if not r["session_id"].endswith("#1")]
    subs = [r for r in rows if r["parent_session_id"]]
    assert len(subs) == 6
    assert {(r["session_id"], r["parent_session_id"], r["subagent_index"]) for r in subs} == {
        (f"p-sub{i}", "p", i) for i in range(3)}
    parent = sorted((r for r in rows if r["session_id"] == "p"), key=lambda r: r["turn"])
    assert [(r["parent_session_id"], r["subagent_index"]) for r in parent] == [("", -1)] * 2

    def end(r):
        return r["t_sent"] + r["e2e_ns"]

    # the three sub-agents ran at once: their first requests' intervals overlap pairwise
    first = [r for r in subs if r["turn"] == 0]
    assert max(r["t_sent"] for r in first) < min(end(r) for r in first)
    # each sub-agent sends its own turns one after another
    for i in range(3):
        a, b = sorted((r for r in subs if r["session_id"] == f"p-sub{i}"),
                      key=lambda r: r["turn"])
        assert b["t_sent"] >= end(a) - 1_000_000  # (epoch send + monotonic e2e: 1 ms slack)
    # the parent's spawn came after its first answer; its next turn after every sub-agent
    assert min(r["t_sent"] for r in subs) >= end(parent[0]) - 1_000_000
    assert parent[1]["t_sent"] >= max(end(r) for r in subs) - 1_000_000

    # every request carried its session's id as the header, and the pin kept each session
    # on one replica of four (round-robin would have moved every next request)
    by_id = {r["request_id"]: r for r in rows + again}
    assert len(endpoint.log) == 16 and len(log) == 8
    for rid, sid, body in endpoint.log:
        assert sid == by_id[rid]["session_id"]
        assert body["min_tokens"] == A.MAX_TOKENS and "user" not in body
    for sid in {r["session_id"] for r in rows}:
        assert len({r["server_replica"] for r in rows if r["session_id"] == sid}) == 1
    assert len({r["server_replica"] for r in rows}) > 1

    # the parent's second turn went without streaming: e2e, no TTFT, no chunks, and the
    # data checks (run at compaction, and here again) take it
    plain = parent[1]
    assert plain["streamed"] is False and parent[0]["streamed"] is True
    assert plain["ttft_ns"] is None and plain["chunk_offsets_ns"] == []
    assert plain["e2e_ns"] > 0 and plain["completion_tokens"] == A.MAX_TOKENS
    assert next(b for rid, _, b in endpoint.log if rid == plain["request_id"])["stream"] is False
    check_requests(read_table(tmp_path / "r", "requests"), tmp_path)


def test_timestamps_replay_records_lateness_behind_a_slow_endpoint(endpoint, tmp_path):
    rows = locust(endpoint.url, tmp_path, "timestamps", 4, "--kvbench-replay", "timestamps",
                  "--kvbench-time-scale", "2", "--kvbench-session-user")
    rows.sort(key=lambda r: r["turn"])
    assert [r["status"] for r in rows] == ["ok"] * 4
    t0 = rows[0]["t_scheduled"]
    # intended sends: the session's start + the recorded offset x the time scale, exactly
    assert [r["t_scheduled"] - t0 for r in rows] == [int(0.02 * k * 2 * 1e9) for k in range(4)]
    # the endpoint answers slower than 40 ms apart: each next request goes when the previous
    # answer came, late by that, and t_scheduled keeps the intended time
    for prev, r in zip(rows, rows[1:]):
        if prev["t_sent"] + prev["e2e_ns"] > r["t_scheduled"]:
            assert r["t_sent"] - r["t_scheduled"] >= \
                prev["t_sent"] + prev["e2e_ns"] - r["t_scheduled"] - 1_000_000
    assert rows[-1]["t_sent"] - rows[-1]["t_scheduled"] > 0  # some lateness recorded
    assert sum(r["e2e_ns"] for r in rows[:-1]) > 0.12e9  # (why: slower than the 40 ms gaps)
    assert all(b.get("user") == "ts" for _, _, b in endpoint.log)  # --kvbench-session-user


# --------------------------------------------------------------------------- the driver alone

class _Res:
    def __init__(self, t_sent_ns: int, status: str = "ok") -> None:
        self.t_sent_ns, self.status, self.text = t_sent_ns, status, "answer"


class _Never:
    def is_set(self) -> bool:
        return False

    def wait(self, s: float) -> bool:
        import gevent

        gevent.sleep(s)
        return False


def _drive(sessions, replay="think", scale=1.0):
    """The driver with a fake send that answers after 10 ms; returns (req, t_sched, t_sent)."""
    import time

    import gevent

    sent = []

    def send(req, t_sched):
        t = time.time_ns()
        sent.append((req, t_sched, t))
        gevent.sleep(0.01)
        return _Res(t)

    d = SessionDriver(send, _Never(), replay=replay, time_scale=scale)
    for s in sessions:
        d.run(s)
    return sent


def test_think_waits_after_the_answer_and_api_scaled_keeps_the_recorded_gap():
    s = A.ListSession("x", [A._req("x", 0, think=5.0, api=0.3),
                            A._req("x", 1, think=0.2, api=0.3)])
    sent = _drive([s], "think", 0.25)
    assert sent[0][1] is None and sent[1][1] is None  # intended = actual
    assert sent[1][2] - sent[0][2] >= int((0.01 + 0.05) * 1e9)  # answer, then 0.2 s x 0.25
    assert s.fed == ["answer", "answer"]
    s = A.ListSession("y", [A._req("y", 0, api=0.3), A._req("y", 1, think=0.1, api=0.3)])
    sent = _drive([s], "api_scaled", 0.5)
    # the recorded gap (0.3 s server time + 0.1 s think) x 0.5, from the previous send
    assert sent[1][1] == sent[0][2] + int(0.2 * 1e9)
    assert sent[1][2] >= sent[1][1]


def test_subagents_fill_parent_ids_and_a_failed_subagent_still_lets_the_parent_go():
    import time

    import gevent

    subs = (A.ListSession("s0", [A._req("s0", 0), A._req("s0", 1)]),
            A.ListSession("s1", [A._req("s1", 0)]))
    parent = A.ListSession("P", [A._req("P", 0), Spawn(subs), A._req("P", 1)])
    sent = []

    def send(req, t_sched):
        sent.append(req)
        gevent.sleep(0.005)
        return _Res(time.time_ns(), "http_error" if req.session_id == "s0" else "ok")

    assert SessionDriver(send, _Never()).run(parent)
    ids = [(r.session_id, r.turn, r.parent_session_id, r.subagent_index) for r in sent]
    # s0 failed at its first turn (its second never went); the parent went on after both
    assert ids[0] == ("P", 0, "", -1) and ids[-1] == ("P", 1, "", -1)
    assert sorted(ids[1:-1]) == [("s0", 0, "P", 0), ("s1", 0, "P", 1)]


def test_a_refused_send_ends_the_session_and_its_subagents():
    subs = tuple(A.ListSession(f"s{i}", [A._req(f"s{i}", k) for k in range(3)])
                 for i in range(3))
    parent = A.ListSession("P", [Spawn(subs), A._req("P", 1)])
    left = [4]

    def send(req, t_sched):
        import gevent

        if left[0] == 0:
            return None
        left[0] -= 1
        gevent.sleep(0.001)
        return _Res(0)

    d = SessionDriver(send, _Never())
    assert d.run(parent) is False and d.refused
    assert left == [0]


def test_driver_rejects_unknown_strategies():
    with pytest.raises(ValueError, match="replay 'wall'"):
        SessionDriver(lambda r, t: None, _Never(), replay="wall")
    with pytest.raises(ValueError, match="time_scale"):
        SessionDriver(lambda r, t: None, _Never(), time_scale=0)


# --------------------------------------------------------------------------- bodies, records

def test_request_body_stream_min_tokens_and_user():
    r = A._req("b", 0, stream=False)
    body = json.loads(request_body(r, "m", user="b"))
    assert body["stream"] is False and "stream_options" not in body
    assert body["min_tokens"] == A.MAX_TOKENS and body["user"] == "b"
    body = json.loads(request_body(Request("i", "chat", 4, 3, 0, "s", prompt="x"), "m"))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "min_tokens" not in body and "user" not in body


def test_parse_answer_reads_usage_text_and_errors():
    got = parse_answer(json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": {
        "prompt_tokens": 5, "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 4}}}).encode())
    assert got == {"text": "hi", "prompt_tokens": 5, "completion_tokens": 1,
                   "cached_tokens": 4, "error": None}
    assert parse_answer(b'{"error": {"message": "nope", "code": 400}}')["error"] == \
        "nope (code 400)"
    assert parse_answer(b"not json")["error"].startswith("unparseable answer")
    assert parse_answer(b'{"choices": []}')["error"] == "the answer has no choices"


def _records(streamed, ttft, chunks, tokens=3):
    n = len(streamed)
    return pa.table({"request_id": [f"r{i}" for i in range(n)], "worker": ["w"] * n,
                     "status": ["ok"] * n, "ttft_ns": pa.array(ttft, pa.int64()),
                     "e2e_ns": [10_000_000] * n, "completion_tokens": [tokens] * n,
                     "chunk_offsets_ns": pa.array(chunks, pa.list_(pa.int64())),
                     "streamed": pa.array(streamed, pa.bool_())})


def test_checks_know_a_request_sent_without_streaming():
    # a non-streamed answer: no TTFT, no chunks: a true record
    check_requests(_records([False, True], [None, 1_000], [[], [1_000, 2_000, 3_000]]), "x")
    # an old run (streamed null) keeps today's rules
    check_requests(_records([None], [None], [[]], tokens=0), "x")
    # a TTFT or chunks on a request sent without streaming cannot be
    with pytest.raises(DataError, match="ttft_ns is set on a request sent without streaming"):
        check_requests(_records([False], [1_000], [[]]), "x")
    assert ("chunk_offsets_ns", "set on a request sent without streaming") in scalar_problems(
        _records([False], [None], [[1_000]]))
    # an ok streamed answer of tokens with no TTFT cannot be either
    with pytest.raises(DataError, match="null on an ok streamed answer"):
        check_requests(_records([True], [None], [[]]), "x")


def test_old_records_without_the_new_columns_still_read(tmp_path):
    import pyarrow.parquet as pq

    from kvbench.core.schema import REQUESTS

    old = pa.schema([f for f in REQUESTS if f.name not in (
        "streamed", "parent_session_id", "subagent_index")])
    run = tmp_path / "old"
    run.mkdir()
    pq.write_table(old.empty_table(), run / "requests.parquet")
    t = read_table(run, "requests")
    assert {"streamed", "parent_session_id", "subagent_index"} <= set(t.schema.names)


# --------------------------------------------------------------------------- the router

class _Eng:
    def __init__(self, name: str, region: str, load: float = 0.0) -> None:
        self.name, self.region, self.load = name, region, load
        self.num_running = self.num_waiting = 0
        self.dram = self.disk = None
        self.cache = self

    def match(self, hashes) -> int:
        return 0

    def load_ms(self) -> float:
        return self.load


def test_cache_aware_router_pins_a_session_to_its_first_replica():
    engines = [_Eng(f"e{i}", "r0") for i in range(3)]
    router = Router("REGIONAL", {"r0": engines}, 0.0, 40.0, 16)

    def seq(i):
        return Seq(f"q{i}", 64, [i * 10 + k for k in range(4)], 4, 0.0)

    first, _ = router.pick(seq(0), session="S")
    first.load = 1e6  # now the busiest: a cache-aware estimate would move the session
    assert all(router.pick(seq(i), session="S")[0] is first for i in range(1, 6))
    assert router.pick(seq(9))[0] is not first  # no session: the policy as before
    assert router.pick(seq(9), session="T")[0] is not first  # a new session: routed, pinned


def test_cache_aware_router_spreads_a_burst_of_new_sessions():
    # sessions starting together: none has reached an engine's queue yet (the front end sits
    # between routing and the queue), so every replica looks idle; the router counts what it
    # routed in transit and spreads them, and forgets each as it arrives
    engines = [_Eng(f"e{i}", "r0") for i in range(4)]
    router = Router("REGIONAL", {"r0": engines}, 0.0, 40.0, 16)
    seqs = [Seq(f"q{i}", 20_000, [i * 10**6 + k for k in range(1250)], 4, 0.0)
            for i in range(8)]
    picked = [router.pick(q, session=f"S{i}")[0].name for i, q in enumerate(seqs)]
    assert sorted(picked) == ["e0", "e0", "e1", "e1", "e2", "e2", "e3", "e3"]
    for q in seqs:
        router.arrived(q)
    assert all(t == [0, 0] for t in router._transit.values())
    router.arrived(seqs[0])  # twice (a dropped request): no effect


# --------------------------------------------------------------------------- the options

def test_replay_options_travel_from_the_profile_to_the_job_file(tmp_path):
    from kvbench.config import parse_config
    from kvbench.core.errors import UserError
    from kvbench.runs.job import Job, resolve

    data = {"endpoints": [{"name": "e", "kind": "openai", "url": "http://127.0.0.1:9",
                           "model": "m"}],
            "workloads": {"chat": {"kind": "chat"}},
            "profiles": {"agents": {"pacing": "closed", "stages": [{"users": 2,
                                                                   "duration_s": 5}],
                                    "replay": "timestamps", "time_scale": 0.1,
                                    "session_header": "X-Agent-Session",
                                    "session_user": True}}}
    job = resolve(parse_config(data), workload="chat", endpoint="e", profile="agents",
                  results_dir=tmp_path)
    assert (job.replay, job.time_scale, job.session_header, job.session_user) == (
        "timestamps", 0.1, "X-Agent-Session", True)
    again = Job.load(job.save(tmp_path / "job.json"))
    assert (again.replay, again.time_scale, again.session_header) == (
        "timestamps", 0.1, "X-Agent-Session")
    # an older job file (none of the fields): the defaults
    old = {k: v for k, v in job.to_dict().items()
           if k not in ("replay", "time_scale", "session_header", "session_user")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    legacy = Job.load(tmp_path / "old.json")
    assert (legacy.replay, legacy.time_scale, legacy.session_header) == (
        "think", 1.0, "X-Session-ID")
    # command-line options win over the profile
    job = resolve(parse_config(data), workload="chat", endpoint="e", profile="agents",
                  replay="api_scaled", time_scale=3.0, session_header="",
                  results_dir=tmp_path)
    assert (job.replay, job.time_scale, job.session_header) == ("api_scaled", 3.0, "")
    for bad in ({"replay": "wall"}, {"time_scale": 0}, {"session_header": "X Session"}):
        prof = {**data["profiles"]["agents"], **bad}
        with pytest.raises(UserError, match=next(iter(bad))):
            parse_config({**data, "profiles": {"agents": prof}})


# --------------------------------------------------------------------------- in virtual time

class _Virtual:
    """A clock and a stop event in virtual ns: waiting advances the clock (never stops)."""

    def __init__(self) -> None:
        self.now = 10**18

    def clock(self) -> int:
        return self.now

    def is_set(self) -> bool:
        return False

    def wait(self, s: float) -> bool:
        self.now += int(s * 1e9)
        return False


_turn = st.tuples(st.floats(0, 5), st.floats(0, 5), st.floats(0, 5) | st.none(),
                  st.integers(1, 5_000_000_000))  # think, offset step, api, service ns


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(_turn, min_size=1, max_size=8), replay=st.sampled_from(
    ("think", "timestamps", "api_scaled")), scale=st.sampled_from((0.1, 0.5, 1.0, 3.0)))
def test_each_strategy_sends_when_it_says(turns, replay, scale):
    """In virtual time: ``think`` sends think x scale after the previous answer (t_scheduled
    left to the send); ``timestamps`` at the start + offset x scale or at the previous answer,
    whichever is later, t_scheduled the former; ``api_scaled`` at the previous send + (api +
    think) x scale or at the previous answer, whichever is later."""
    v = _Virtual()
    offsets, reqs, acc = [], [], 0.0
    for k, (think, step, api, _) in enumerate(turns):
        acc += step
        offsets.append(acc if k else 0.0)
        reqs.append(A._req("v", k, think=think, api=api, offset=offsets[-1]))
    sent = []

    def send(req, t_sched):
        sent.append((t_sched, v.now))
        v.now += turns[req.turn][3]
        return _Res(sent[-1][1])

    t0 = v.now
    SessionDriver(send, v, replay=replay, time_scale=scale, clock=v.clock).run(
        A.ListSession("v", reqs))
    assert len(sent) == len(turns)
    for k, (t_sched, t_sent) in enumerate(sent):
        think, _, api, _ = turns[k]
        prev_end = sent[k - 1][1] + turns[k - 1][3] if k else t0
        if replay == "timestamps":
            due = t0 + int(offsets[k] * scale * 1e9)
            assert t_sched == due and abs(t_sent - max(due, prev_end)) <= 1  # (ns rounding)
        elif replay == "api_scaled" and k and api is not None:
            due = sent[k - 1][1] + int((api + think) * scale * 1e9)
            assert t_sched == due and abs(t_sent - max(due, prev_end)) <= 1  # (ns rounding)
        else:
            assert t_sched is None
            wait = int(think * scale * 1e9) if k and think > 0 else 0
            assert abs(t_sent - (prev_end + wait)) <= 1  # (float seconds round trip)
