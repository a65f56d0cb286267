"""A soak's load process keeps flat memory (issue 34, "Long runs"): what it holds per request is
bounded however many requests go by. ``bench/soak_memory.py`` measures the RSS of a real
``locust -f loadgen/chat.py``; these tests hold the structures that grew per request to a
bound: the open-loop dispatcher's start lateness, and the live view's since-start values."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvbench.core.contract import StagePlan
from kvbench.loadgen.liveview import live, live_quantiles as LQ
from kvbench.loadgen.plan import pacing
from kvbench.loadgen.plan.pacing import OpenLoopDispatcher


class _Req:
    request_id = session_id = "r"


def test_the_dispatcher_keeps_a_bounded_record_of_lateness():
    """Before: one int per arrival for the whole run (``lag_ns`` grew with every request)."""
    import gevent

    sent = [0]

    def send(req, t_sched, stage):
        sent[0] += 1

    n = 3 * pacing.LAG_KEPT
    d = OpenLoopDispatcher(send, iter(lambda: _Req(), None),
                           [StagePlan(0, 3600.0, 1e6, requests=n)], pacing="constant",
                           max_in_flight=10**9)
    gevent.spawn(d.run).join()
    d.wait_idle(30)
    assert d.started == n and sent[0] == n
    assert 0 < len(d.lag_ns) <= pacing.LAG_KEPT
    assert max(d.lag_ns) >= 0


def _held_bytes(ks: LQ.KeyStats) -> int:
    """What a key's since-start structures hold, in bytes."""
    total = 0
    for s in [*ks.since.values(), ks.itl_archive.big, ks.itl_window.big]:
        total += s.sorted.nbytes + sum(p.nbytes for p in s.pending)
        total += s.bins.counts.nbytes if s.bins is not None else 0
    return total


def test_the_live_views_since_start_values_stay_bounded():
    """Before: every TTFT, TPOT and lateness value since the start was kept (8 bytes each, and
    each merge copied them all): a day at 200 req/s held 400 MB. Now past ``EXACT_MAX`` values
    they are binned, and the quantiles stay within ``LogBins.REL_ERROR`` of numpy's."""
    rng = np.random.default_rng(7)
    ks = LQ.KeyStats()
    per_batch, batches = 20_000, (3 * LQ.EXACT_MAX) // 20_000
    every = {m: [] for m in LQ.PER_REQUEST}
    held = []
    t = 0
    for i in range(batches):
        arrays = {"ttft": rng.lognormal(np.log(80.0), 0.6, per_batch),
                  "tpot": rng.lognormal(np.log(15.0), 0.3, per_batch),
                  "lateness": rng.exponential(0.5, per_batch),
                  "itl_us": rng.integers(5_000, 2_000_000, 50).astype(np.int64)}
        for m in LQ.PER_REQUEST:
            every[m].append(arrays[m])
        counts = {"done": per_batch, "ok": per_batch}
        t += 10**9
        ks.add(t, arrays, counts)
        ks.trim(t, 30.0)
        if i % 10 == 0:
            ks.summary(30.0, t, t / 1e9)  # a watched run merges as it goes
            held.append(_held_bytes(ks))
    n_requests = per_batch * batches
    bound = 3 * LQ.EXACT_MAX * 8 + 4 * LQ.LogBins.N * 8 + 2**20
    assert max(held) <= bound
    assert held[-1] < 8 * n_requests  # below one float a request: nothing per request is kept
    t += int(LQ.SINCE_EVERY_S * 1e9) + 1  # the since-start figures are recomputed now
    since = ks.summary(30.0, t, t / 1e9)["since"]
    assert since["quantiles_exact"] is False
    for m in LQ.PER_REQUEST:
        want = [np.quantile(np.concatenate(every[m]), q) for q in LQ.QS]
        assert since[m] == pytest.approx(want, rel=LQ.LogBins.REL_ERROR * 1.01, abs=1e-6)


def test_a_short_runs_figures_stay_exact():
    s = LQ.SinceStart()
    v = np.random.default_rng(1).lognormal(3.0, 1.0, 10_000)
    s.add(v)
    assert s.exact
    assert s.quantiles() == pytest.approx([np.quantile(v, q) for q in LQ.QS], rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
                         min_size=1, max_size=60), min_size=1, max_size=8),
       st.integers(1, 50))
def test_binned_quantiles_are_within_the_stated_error(batches, exact_max):
    s = LQ.SinceStart(exact_max=exact_max)
    for b in batches:
        s.add(np.asarray(b, float))
    allv = np.concatenate([np.asarray(b, float) for b in batches])
    want = [np.quantile(allv, q) for q in LQ.QS]
    assert s.exact == (len(allv) <= exact_max)
    assert s.quantiles() == pytest.approx(want, rel=LQ.LogBins.REL_ERROR * 1.01)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(LQ.MicroHist.BINS, 50_000_000), min_size=1, max_size=200),
       st.lists(st.integers(0, 20_000), max_size=100))
def test_itl_above_the_histograms_range_binned_past_the_bound(big, small):
    """ITL gaps above 0.52 s (kept apart as floats) are binned too once there are many."""
    h = LQ.MicroHist()
    h.big = LQ.SinceStart(exact_max=20)
    us = np.asarray(big + small, np.int64)
    h.add(LQ.MicroHist.split(us))
    want = [np.quantile(us.astype(float), q) / 1e3 for q in LQ.QS]
    assert live.micro_quantiles([h, LQ.MicroHist()]) == pytest.approx(
        want, rel=LQ.LogBins.REL_ERROR * 1.01, abs=1e-3)


# --------------------------------------------------------------------------- shards rotate


def _row(i: int) -> tuple:
    from kvbench.loadgen.timing.sink import COLUMNS

    vals = dict.fromkeys(COLUMNS)
    vals.update(run_id="r", endpoint="e", topology="colocated", workload="w",
                request_class="chat", request_id=f"q{i}", session_id="s", worker="w",
                status="ok", chunk_offsets_ns=[1, 2, 3], chunk_tokens=[1, 1, 1], stage=0,
                turn=0, t_scheduled=1000 + i, t_sent=1000 + i, prompt_tokens=8, max_tokens=4)
    return tuple(vals[c] for c in COLUMNS)


def _start(i: int) -> tuple:
    return ("r", "e", "colocated", "w", "chat", 0, f"q{i}", "s", 0, "w", 8, 0, 4, 1000 + i,
            1000 + i)


def test_the_sinks_shards_rotate_into_bounded_parts_that_read_as_one(tmp_path):
    """Before: one requests shard per process for the whole run (a day's soak: tens of GB in
    one file, none of it uploadable until the process closed). Now past ``rotate_bytes`` the
    shard and its starts go on in a next part; every part reads, compaction pairs them, and a
    request in flight across a rotation is one ``ok`` record, not a cancelled one."""
    from kvbench.core import compact, rows, store
    from kvbench.core.rows import shard_files
    from kvbench.loadgen.timing.sink import RecordSink

    sink = RecordSink(tmp_path, use_threadpool=False, rotate_bytes=4096)
    n = 0
    for _ in range(30):  # 30 flushes of 20 requests, one of each flush still in flight
        for _ in range(20):
            sink.begin(_start(n))
            n += 1
        for i in range(n - 20, n - 1):
            sink.append(_row(i))
        sink.flush()
        sink.append(_row(n - 1))  # its start went with the last flush: recorded after it
    sink.close()
    parts = shard_files(tmp_path, "requests")
    starts = shard_files(tmp_path, "starts")
    assert len(parts) > 3 and len(starts) == len(parts)
    assert all(p.stat().st_size < 4096 + 8192 for p in parts)  # at most one batch past
    assert [p for p in parts if not rows.sealed(p)] == [sink._shard.path]  # the last one
    t = store.read_shards(tmp_path, "requests")
    assert t.num_rows == n and len(set(t.column("request_id").to_pylist())) == n
    assert compact.compact(tmp_path, "requests") == n
    done = store.read_table(tmp_path, "requests", ["request_id", "status"])
    assert done.num_rows == n and set(done.column("status").to_pylist()) == {"ok"}
    assert not shard_files(tmp_path, "requests") and not shard_files(tmp_path, "starts")


def test_an_uploader_takes_a_sealed_part_while_its_process_goes_on(tmp_path):
    from kvbench.core import objstore
    from kvbench.core.rows import RowShardWriter

    w = RowShardWriter(tmp_path, "requests")
    w.write([[v] for v in _row(0)])
    first = w.rotate()
    w.write([[v] for v in _row(1)])
    up = objstore.Uploader(tmp_path, objstore.Location("b"), "r")
    ready = {p.name: up.ready(p.name, p, p.stat(), closed=set())
             for p in tmp_path.glob("requests-*.rows")}
    assert ready == {first.name: True, w.path.name: False}
    w.close()
