import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.core import store
from kvbench.loadgen.plan.pacing import OpenLoopDispatcher, StagePlan, gaps_s, shard
from kvbench.core.store import read_proc_meta
from kvbench.loadgen.timing.sink import COLUMNS, RecordSink
from kvbench.runs.finalize import merge_proc_meta

ROOT = Path(__file__).resolve().parent.parent


def test_poisson_gaps_are_exponential_not_rescaled():
    g = np.array(list(itertools.islice(gaps_s("poisson", 50.0, np.random.default_rng(1)), 20000)))
    assert abs(g.mean() - 0.02) < 0.001
    assert abs(g.std() / g.mean() - 1.0) < 0.03  # CV of an exponential is 1
    # the sum is whatever it is: no rescaling to a fixed duration
    g2 = list(itertools.islice(gaps_s("poisson", 50.0, np.random.default_rng(2)), 100))
    assert abs(sum(g2) - 2.0) > 1e-9


@settings(max_examples=20, deadline=None)
@given(st.floats(0.3, 4.0), st.floats(1.0, 500.0))
def test_gamma_gaps_have_the_asked_mean_and_cv(cv, rate):
    g = np.array(list(itertools.islice(gaps_s("gamma", rate, np.random.default_rng(3), cv),
                                       40000)))
    assert abs(g.mean() * rate - 1) < 0.06 * max(1, cv)
    assert abs(g.std() / g.mean() - cv) < 0.12 * cv


def test_shard_splits_without_overlap():
    parts = [list(shard(range(10), i, 3)) for i in range(3)]
    assert sorted(sum(parts, [])) == list(range(10))


class _Req:
    arrival_offset_s = None


def test_dispatcher_rate_stages_and_drops_at_cap():
    import gevent

    started = []

    def send(req, t_sched, stage):
        started.append((t_sched, stage))
        gevent.sleep(0.2)  # slow responses: the cap of 5 in flight is hit at 100 req/s

    d = OpenLoopDispatcher(send, iter(lambda: _Req(), None),
                           [StagePlan(0, 0.5, 20.0), StagePlan(1, 0.5, 100.0)],
                           pacing="constant", max_in_flight=5)
    gevent.spawn(d.run).join()
    d.wait_idle(2)
    by_stage = [sum(1 for _, s in started if s == k) for k in (0, 1)]
    assert 8 <= by_stage[0] <= 10  # 20 req/s for 0.5 s, constant gaps
    assert d.dropped_at_cap > 20  # 50 arrivals, at most about 5 + 5 started
    assert d.started + d.dropped_at_cap >= 55
    assert max(d.lag_ns) < 50e6


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(0.1, 500), duration_s=st.floats(0.05, 60), seed=st.integers(0, 2**16))
def test_a_counted_stage_sends_exactly_rate_times_duration(rate, duration_s, seed):
    """A capacity-search probe's arrivals (``exact_count``): round(rate x duration) of them,
    in order, inside the stage; a plain Poisson stage's count wanders (its count is random)."""
    d = OpenLoopDispatcher(lambda *a: None, iter(lambda: _Req(), None), [], pacing="poisson",
                           seed=seed)
    t0, t1 = 10**12, 10**12 + int(duration_s * 1e9)
    times = [t for t, _ in d._counted_times(rate, t0, t1)]
    assert len(times) == int(round(rate * (t1 - t0) / 1e9))
    assert times == sorted(times)
    assert all(t0 <= t <= t1 for t in times)


def row(i):
    vals = {c: None for c in COLUMNS}
    vals.update(run_id="r", request_id=f"q{i}", status="ok", chunk_offsets_ns=[1, 2],
                chunk_tokens=[1, 1], stage=0, turn=0, t_sent=i)
    return tuple(vals[c] for c in COLUMNS)


def test_sink_roundtrip_and_sidecar(tmp_path):
    sink = RecordSink(tmp_path, use_threadpool=False)
    for i in range(5):
        sink.begin()
        sink.append(row(i))
    sink.flush()
    for i in range(5, 8):
        sink.begin()
        sink.append(row(i))
    sink.close()
    t = store.read_shards(tmp_path, "requests")
    assert t.num_rows == 8 and t.column("chunk_offsets_ns")[0].as_py() == [1, 2]
    meta = merge_proc_meta(read_proc_meta(tmp_path))
    assert meta.count("requests_started") == meta.count("records_written") == 8


KILL = textwrap.dedent("""
    import sys, time, gevent
    from kvbench.loadgen.timing.sink import RecordSink, COLUMNS
    sink = RecordSink(sys.argv[1], flush_interval_s=0.2)
    sink.start()
    i = 0
    while True:
        vals = dict.fromkeys(COLUMNS)
        vals.update(request_id=str(i), worker="w", status="ok", t_sent=time.time_ns())
        sink.begin(("r", "e", "colocated", "w", "chat", 0, str(i), "s", 0, "w", 1, 0, 1,
                    vals["t_sent"], vals["t_sent"]))
        sink.append(tuple(vals[c] for c in COLUMNS))
        i += 1
        gevent.sleep(0.001)
""")


def test_killed_writer_loses_at_most_the_last_flush_interval(tmp_path):
    """Counts, not the wall clock (a loaded host stalls any process for seconds): every row
    appended before the last flush the writer's sidecar reports is on disk, as an unbroken
    prefix, and every start flushed with it too."""
    p = subprocess.Popen([sys.executable, "-c", KILL, str(tmp_path)], cwd=ROOT)
    try:
        end = time.monotonic() + 120
        while sum(m.count("records_written") for m in read_proc_meta(tmp_path)) < 300:
            assert time.monotonic() < end and p.poll() is None
            time.sleep(0.05)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    (meta,) = read_proc_meta(tmp_path)
    assert meta.closed is False  # the kill left the live sidecar of the last flush
    t = store.read_shards(tmp_path, "requests")
    kept = t.num_rows
    # all appended by the last flush's swap (its started count) survived, in order
    assert kept >= meta.count("requests_started") >= 300
    assert t.column("request_id").to_pylist() == [str(i) for i in range(kept)]
    assert store.read_starts(tmp_path).num_rows >= meta.count("requests_started")
    assert isinstance(t, pa.Table)
