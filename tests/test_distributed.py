"""Distributed runs on Locust's master and workers with no shared disk (issue 15): the transport
(batches once each, acknowledged, lost workers accounted), the load split (merged Poisson
arrivals), clock offsets, and real master + 2 workers against the built-in endpoint, each with
its own directory: every request the endpoint served is one row on the master; a worker killed
with SIGKILL is named with its missing requests."""

from __future__ import annotations

import json
import signal
import socket
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

import distributed_helpers as H
from kvbench.core import store
from kvbench.core.rows import REQUEST_COLUMNS, shard_files
from kvbench.core.schema import REQUESTS
from kvbench.loadgen.plan.pacing import OpenLoopDispatcher, StagePlan
from kvbench.runs import finalize, transport as T
from kvbench.runs.locust import free_port


def _cols(worker: str, ids: list[str]) -> list[list]:
    """A requests batch as a sink hands it over: column lists in REQUEST_COLUMNS order."""
    n = len(ids)
    cols = {"run_id": ["r"] * n, "endpoint": ["e"] * n, "status": ["ok"] * n,
            "request_id": ids, "worker": [worker] * n, "t_scheduled": [1] * n, "t_sent": [2] * n,
            "chunk_offsets_ns": [[]] * n, "chunk_tokens": [[]] * n}
    return [cols.get(name, [None] * n) for name in REQUEST_COLUMNS]


def _batch(worker: str, ids: list[str]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array(c, f.type) for c, f in zip(
        _cols(worker, ids), REQUESTS)], schema=REQUESTS)


def _meta(started: int, written: int, closed: bool) -> dict:
    return {"counts": {"requests_started": started, "records_written": written,
                       "dropped_at_cap": 0}, "stages": [], "incomplete": [], "closed": closed,
            "worker": "h1:10", "host": "h1", "updated_ns": time.time_ns()}


def test_batches_cross_once_each_and_a_silent_worker_is_named(tmp_path):
    box = T.Outbox("h1:10")
    inbox = T.Inbox(tmp_path, master_host="master")
    box.put("requests", _cols("h1:10", ["a", "b"]))
    box.put("meta", _meta(3, 2, False))
    msgs = box.take(now=0.0)
    assert [m["seq"] for m in msgs] == [1, 2] and box.pending() == 2
    acks = [inbox.receive(m, now=0.0) for m in msgs]
    box.ack(acks[:1])  # the second acknowledgement is lost on the way
    assert box.take(now=1.0) == []  # not yet due again
    again = box.take(now=10.0)
    assert [m["seq"] for m in again] == [2]
    box.ack([inbox.receive(m, now=10.0) for m in again])
    assert box.pending() == 0 and inbox.workers["h1:10"].duplicates == 1
    box.put("requests", _cols("h1:10", ["c"]))  # sent, never reaches the master
    box.take(now=11.0)
    inbox.close(now=20.0)  # never closed its sink: lost
    t = store.read_table(tmp_path, "requests")
    assert sorted(t.column("request_id").to_pylist()) == ["a", "b"]
    meta = finalize.finalize(tmp_path, meta={"run_id": "r"})
    acct = meta.workers["h1:10"]
    assert acct["lost"] and acct["missing"] == 1 and acct["records"] == 2
    assert any("h1:10" in n.what and "1 of its requests missing" in n.why
               for n in meta.incomplete)
    assert not meta.interrupted  # the run itself completed


def test_a_worker_declared_lost_that_comes_back_is_taken_whole(tmp_path):
    box = T.Outbox("h1:10")
    inbox = T.Inbox(tmp_path, master_host="master")
    box.put("requests", _cols("h1:10", ["a"]))
    box.put("meta", _meta(1, 1, False))
    box.ack([inbox.receive(m, now=0.0) for m in box.take(now=0.0)])
    inbox.declare_lost(inbox.workers["h1:10"], "no message for 6.0 s")
    box.put("requests", _cols("h1:10", ["b", "c"]))
    box.put("meta", _meta(3, 3, True))
    box.ack([inbox.receive(m, now=7.0) for m in box.take(now=7.0)])
    inbox.close(now=8.0)
    st = inbox.workers["h1:10"]
    assert st.lost is None and st.closed and st.records == 3
    t = store.read_table(tmp_path, "requests")
    assert sorted(t.column("request_id").to_pylist()) == ["a", "b", "c"]


@settings(max_examples=30, deadline=None)
@given(offset=st.integers(-10**12, 10**12), out_ns=st.integers(0, 10**7),
       back_ns=st.integers(0, 10**7))
def test_clock_offset_is_within_half_the_round_trip(offset, out_ns, back_ns):
    """A worker whose clock reads ``offset`` behind the master's: the estimate is off by at
    most half the round trip (asymmetry), exact when both ways take as long."""
    est = T.ClockEstimate()
    t0 = 1_700_000_000 * 10**9
    est.add(t0, t0 + out_ns - offset, t0 + out_ns + back_ns)
    assert abs(est.offset_add_ns - offset) <= (out_ns + back_ns) // 2 + 1
    if out_ns == back_ns:
        assert abs(est.offset_add_ns - offset) <= 1


def test_load_results_puts_each_worker_on_the_masters_clock():
    t = pa.Table.from_batches([_batch("a:1", ["x"]), _batch("b:2", ["y"])])
    out = store.align_worker_clocks(t, {"b:2": -5, "c:3": 7})
    assert out.column("t_sent").to_pylist() == [2, -3]
    assert out.column("t_scheduled").to_pylist() == [1, -4]


def test_merged_worker_arrivals_are_poisson_at_the_total_rate():
    """Each worker runs its own Poisson process at rate / N (its seed: seed * 1000 + index,
    as the load context gives it); the merge is Poisson at the total rate: gaps of CV 1."""
    rate, n, span_s = 400.0, 4, 30.0
    times = []
    for i in range(n):
        d = OpenLoopDispatcher(lambda *a: None, iter(()), [StagePlan(0, span_s, rate)],
                               pacing="poisson", seed=7 * 1000 + i, share=1.0 / n)
        times += [t for t, _ in d._rate_times(rate * d.share, 0, int(span_s * 1e9))]
    gaps = np.diff(np.sort(np.array(times))) / 1e9
    assert abs(len(times) / span_s - rate) < 4 * np.sqrt(rate / span_s)  # 4 sigma
    cv = gaps.std() / gaps.mean()
    assert 0.95 < cv < 1.05, cv
    # and not one process at the total rate copied N times (identical seeds would be)
    assert len(set(times)) == len(times)


# --------------------------------------------------------------------------- real Locust


@pytest.fixture(scope="module")
def endpoint():
    proc, url = H.start_builtin()
    yield url
    proc.terminate()
    proc.wait(10)


SKEW_NS = -7 * 10**9  # the second worker's clock runs 7 s behind


def _skewed_worker(port: int) -> list[str]:
    """A worker whose ``time.time_ns`` (every epoch time kvbench records) reads SKEW_NS off."""
    code = (f"import sys, time, runpy; _t = time.time_ns; time.time_ns = lambda: _t() + "
            f"({SKEW_NS}); sys.argv = {H.worker_cmd('127.0.0.1', port)[2:]!r}; "
            "sys.argv[0] = 'locust'; runpy.run_module('locust', run_name='__main__')")
    return [sys.executable, "-c", code]


def _run(tmp_path, url, *, rate, duration, kill_after_s=None, skew=False):
    master_dir, w_dirs = tmp_path / "master", [tmp_path / "w1", tmp_path / "w2"]
    for d in [master_dir] + w_dirs:
        d.mkdir()
    cfg = H.write_config(master_dir / "bench.toml", url, rate=rate, duration=duration)
    port = free_port()
    before = H.served(url)
    m = H.popen(H.master_cmd(cfg, master_dir / "results", port, 2, "--kvbench-workload", "chat",
                             "--kvbench-profile", "open"), cwd=master_dir,
                log=tmp_path / "master.log")
    cmds = [H.worker_cmd("127.0.0.1", port), _skewed_worker(port) if skew else
            H.worker_cmd("127.0.0.1", port)]
    ws = [H.popen(c, cwd=d, log=tmp_path / f"{d.name}.log", env={"KVBENCH_SPOOL": str(d / "spool")})
          for c, d in zip(cmds, w_dirs)]
    try:
        if kill_after_s is not None:
            # once the master holds some of its records (a busy host may take seconds to
            # build the workload), then mid-stream
            mine = (master_dir / "results" / "dist" /
                    f"proc-{socket.gethostname()}-{ws[1].pid}.json")
            for _ in range(600):
                if mine.exists() and json.loads(mine.read_text())["counts"]["records_written"]:
                    break
                time.sleep(0.1)
            time.sleep(kill_after_s)
            ws[1].send_signal(signal.SIGKILL)
        rc = m.wait(120)
        for w in ws:
            w.wait(60)
    finally:
        for p in [m] + ws:
            if p.poll() is None:
                p.kill()
    time.sleep(0.3)  # the endpoint counts a request once its stream is done
    run_dir = master_dir / "results" / "dist"
    log = (tmp_path / "master.log").read_text()
    assert rc == 0 and (run_dir / "run.json").exists(), log[-3000:]
    return run_dir, w_dirs, H.served(url) - before, ws


def test_master_and_two_workers_own_dirs_every_served_request_one_row(endpoint, tmp_path):
    run_dir, w_dirs, served, _ = _run(tmp_path, endpoint, rate=20, duration=3, skew=True)
    res = store.load_results(run_dir)
    t = res.requests
    ids = t.column("request_id").to_pylist()
    assert len(ids) == len(set(ids)) == served > 30  # every request the endpoint saw, once
    assert set(t.column("status").to_pylist()) == {"ok"}
    meta = res.meta
    assert len(meta.workers) == 2 and all(a["closed"] and not a["lost"]
                                          for a in meta.workers.values())
    assert sum(a["records"] for a in meta.workers.values()) == len(ids)
    # the master's directory alone holds the run; each worker's spool went once acknowledged
    assert not [p for d in w_dirs for p in shard_files(d / "spool", recursive=True)]
    assert not any(store.read_proc_meta(d / "spool") for d in w_dirs)
    # clocks: the skewed worker's offset was measured and its times put on the master's clock
    by_worker = {w: a for w, a in meta.workers.items()}
    offsets = meta.worker_clock_offsets_ns
    skewed = [w for w, o in offsets.items() if abs(o) > 10**9]
    assert len(skewed) == 1, by_worker
    assert abs(offsets[skewed[0]] + SKEW_NS) < by_worker[skewed[0]]["clock_rtt_ns"] / 2 + 10**6
    sent = np.array(t.column("t_sent").to_pylist())
    assert meta.started_ns <= sent.min() and sent.max() <= meta.ended_ns
    from kvbench.reports.measures.data import _read_run  # the report's reader aligns them too

    rep = np.array(_read_run(run_dir).requests.column("t_sent").to_pylist())
    assert meta.started_ns <= rep.min() and rep.max() <= meta.ended_ns
    raw = store.read_table(run_dir, "requests", columns=["worker", "t_sent"]).to_pydict()
    assert min(s for w, s in zip(raw["worker"], raw["t_sent"]) if w == skewed[0]) < \
        meta.started_ns  # as written: 7 s early


def test_worker_killed_mid_run_is_named_with_at_most_its_last_second_missing(endpoint,
                                                                             tmp_path):
    rate, duration = 20, 8
    run_dir, _, served, ws = _run(tmp_path, endpoint, rate=rate, duration=duration,
                                  kill_after_s=1.5)
    res = store.load_results(run_dir)
    meta = res.meta
    lost = {w: a for w, a in meta.workers.items() if a["lost"]}
    assert len(lost) == 1, meta.workers
    (name, acct), = lost.items()
    assert name.endswith(f":{ws[1].pid}")
    per_worker_s = rate / 2
    assert acct["missing"] <= per_worker_s * 1.0 + 3  # at most its last second
    assert any(name in n.what and "missing" in n.why for n in meta.incomplete)
    status = res.requests.column("status").to_pylist()
    ok = status.count("ok")
    assert 0 <= served - ok <= acct["missing"] + per_worker_s * 0.5 + 3
    survivor = next(a for a in meta.workers.values() if not a["lost"])
    assert survivor["closed"] and survivor["records"] > per_worker_s * duration * 0.5
    assert json.loads((run_dir / "run.json").read_text())["workers"][name]["lost"] is True


@settings(max_examples=60, deadline=None)
@given(sessions=st.lists(st.one_of(st.none(), st.integers(0, 12)), max_size=80),
       count=st.integers(1, 5))
def test_open_loop_and_trace_shares_keep_each_session_whole(sessions, count):
    """Split over ``count`` workers, a request stream is every request once, each session on
    one worker in its order, sessions dealt evenly."""
    from dataclasses import dataclass

    from kvbench.loadgen.plan.pacing import shard_sessions

    @dataclass(frozen=True)
    class Req:
        request_id: str
        session_id: str | None

    stream = [Req(f"r{i}", None if s is None else f"s{s}") for i, s in enumerate(sessions)]
    shares = [list(shard_sessions(iter(stream), i, count)) for i in range(count)]
    assert sorted(r.request_id for sh in shares for r in sh) == sorted(
        r.request_id for r in stream)
    where = {}
    for i, sh in enumerate(shares):
        assert sh == [r for r in stream if r in sh]  # the stream's order
        for r in sh:
            if r.session_id is not None:
                assert where.setdefault(r.session_id, i) == i  # whole on one worker
    units = [len({r.session_id or r.request_id for r in sh}) for sh in shares]
    assert max(units) - min(units) <= 1


def test_agent_sessions_stay_on_one_worker_in_the_open_loop():
    """The agent workload's requests, cycled as the open-loop dispatcher takes them."""
    import itertools

    from kvbench.config import load_config
    from kvbench.loadgen.plan.pacing import cycle_requests
    from kvbench.workloads.registry import make_workload

    cfg = load_config(H.ROOT / "bench.toml")
    wl = make_workload("agent", cfg)
    total = sum(1 for _ in wl.requests())
    seen = {}
    got = 0
    for i in range(3):
        for req in itertools.islice(cycle_requests(wl.requests, i, 3), total):
            assert seen.setdefault(req.session_id, i) == i
            got += 1
    assert got >= total and len(seen) >= 3


def test_a_worker_lost_before_its_first_sidecar_is_named(tmp_path):
    """Connected to Locust, killed while it built its workload: no sidecar, still named (and
    finalize has a closed sidecar for it, so nothing waits for one)."""
    inbox = T.Inbox(tmp_path)
    inbox.worker("host_abc", node="host_abc").last_seen = 0.0  # the master's placeholder
    other = inbox.worker("h2:7", node="node-7")
    box = T.Outbox("h2:7")
    box.put("meta", _meta(0, 0, True))
    inbox.receive(box.take()[0], node="node-7")
    assert other.closed
    inbox.close(now=10.0)
    metas = store.read_proc_meta(tmp_path)
    assert len(metas) == 2 and all(m.closed for m in metas)
    meta = finalize.finalize(tmp_path, meta={"run_id": "r"}, expected_procs=2)
    assert meta.workers["host_abc"]["lost"] and meta.workers["host_abc"]["missing"] == 0
    assert not meta.workers["h2:7"]["lost"]
    # a placeholder is dropped once its worker speaks under its own name
    inbox2 = T.Inbox(tmp_path / "b")
    inbox2.worker("node-9", node="node-9")
    b2 = T.Outbox("h3:9")
    b2.put("meta", _meta(1, 0, False))
    inbox2.receive(b2.take()[0], node="node-9")
    assert list(inbox2.workers) == ["h3:9"]
