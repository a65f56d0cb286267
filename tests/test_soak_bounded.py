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
