"""Offered rate, achieved throughput, first tokens/s and the overload verdict on hand-built
stages (``reports.overload``), and the Poisson tail it rests on."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.core.schema import REQUESTS
from kvbench.reports.statistics import metrics as M
from kvbench.reports.analysis import overload as O

MS = 1_000_000
T0 = 10**18


def _table(rows: list[dict]) -> pa.Table:
    return pa.table({n: pa.array([r.get(n) for r in rows], t)
                     for n, t in zip(REQUESTS.names, REQUESTS.types)}, schema=REQUESTS)


def _stage(n: int, window_s: float, ttft_s, e2e_s, cls="chat") -> tuple[pa.Table, list]:
    """``n`` requests scheduled evenly over ``window_s``; request i gets TTFT ``ttft_s(i)``
    and E2E ``e2e_s(i)`` (seconds)."""
    rows = []
    for i in range(n):
        t = T0 + int(i * window_s / n * 1e9)
        ttft, e2e = int(ttft_s(i) * 1e9), int(e2e_s(i) * 1e9)
        rows.append(dict(run_id="r", endpoint="ep", topology="colocated", workload="w",
                         request_class=cls, stage=0, request_id=f"q{i}", session_id=f"s{i}",
                         turn=0, worker="h:1", prompt_tokens=1000, completion_tokens=20,
                         t_scheduled=t, t_sent=t, connect_ns=0, ttft_ns=ttft,
                         chunk_offsets_ns=[ttft, e2e], chunk_tokens=[1, 19], e2e_ns=e2e,
                         status="ok"))
    stages = [{"endpoint": "ep", "workload": "w", "index": 0, "pacing": "poisson",
               "rate_rps": n / window_s, "duration_s": window_s, "t_start_ns": T0,
               "t_end_ns": T0 + int(window_s * 1e9)}]
    return _table(rows), stages


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 300), st.floats(0.01, 400))
def test_poisson_cdf_is_the_sum_of_the_pmf(k, mu):
    exact = sum(math.exp(j * math.log(mu) - mu - math.lgamma(j + 1)) for j in range(k + 1))
    assert O.poisson_cdf(k, mu) == pytest.approx(min(exact, 1.0), rel=1e-9, abs=1e-300)


@settings(max_examples=30, deadline=None)
@given(st.integers(20_000, 200_000), st.floats(-4, 4))
def test_the_approximate_tail_agrees_with_the_exact_sum(k, z):
    mu = k + z * math.sqrt(k)  # within a few standard deviations, where a verdict turns
    assert O.poisson_cdf_approx(k, mu) == pytest.approx(O.poisson_cdf(k, mu), abs=1e-3)


def test_verdict_needs_a_clear_shortfall_beyond_noise():
    # 100 s at 10 req/s offered: 950 done is noise, 500 is a shortfall
    assert O.verdict(950, 1000, 100.0, 10.0)[0] is False
    assert O.verdict(500, 1000, 100.0, 10.0)[0] is True
    # 5 of 12 in 1 s at 12 req/s offered: a big ratio, but few requests: p = P(X <= 5 | 9.6)
    below, p = O.verdict(5, 12, 1.0, 12.0)
    assert p == pytest.approx(O.poisson_cdf(5, 0.8 * 12.0)) and below is False
    assert O.verdict(3, 5, 1.0, 5.0) == (None, O.verdict(3, 5, 1.0, 5.0)[1])  # too few
    assert O.verdict(30, 40, 10.0, math.nan)[0] is None  # a closed loop offers no rate


def test_a_queue_before_the_prefill_is_overload():
    # 200 requests over 10 s (20 req/s); the server starts one every 0.2 s (5 req/s): request
    # i waits 0.15 i s for its prefill, and the last finishes 30 s after the schedule
    table, stages = _stage(200, 10.0, lambda i: 0.15 * i + 0.05, lambda i: 0.15 * i + 0.5)
    f = M.request_frame(table, stages=stages, slo={"chat": {"ttft_ms": 1000}})
    (r,) = O.rates(f).to_dict("records")
    assert r["offered_rps"] == pytest.approx(20.0)
    assert r["started_rps"] == pytest.approx(200 / (9.95 + 29.85 + 0.05), rel=1e-3)
    assert r["throughput_rps"] == pytest.approx(200 / (9.95 + 29.85 + 0.5), rel=1e-3)
    assert r["overloaded"] is True and r["goodput_short"] is True
    assert r["drain_s"] == pytest.approx(r["achieved_s"] - 10.0)
    assert M.statistic(f, "throughput_rps") == pytest.approx(r["throughput_rps"])
    assert M.statistic(f, "started_rps") == pytest.approx(r["started_rps"])
    assert M.statistic(f, "offered_rps") == pytest.approx(20.0)


def test_long_answers_that_drain_after_the_schedule_are_not_overload():
    # the same 20 req/s, served at once (TTFT 50 ms), but the last answer takes 15 s
    table, stages = _stage(200, 10.0, lambda i: 0.05, lambda i: 15.0 if i == 199 else 0.5)
    f = M.request_frame(table, stages=stages)
    (r,) = O.rates(f).to_dict("records")
    assert r["throughput_rps"] < 0.8 * r["offered_rps"]  # achieved alone looks short ...
    assert r["started_rps"] == pytest.approx(r["offered_rps"], rel=0.02)  # ... first tokens not
    assert r["overloaded"] is False
    assert r["goodput_short"] is None and math.isnan(r["goodput_rps"])  # no SLO at all


def test_no_slo_class_is_left_out_of_goodput_and_attainment():
    a, stages = _stage(40, 4.0, lambda i: 0.05, lambda i: 0.5, cls="chat")
    b, _ = _stage(40, 4.0, lambda i: 0.05, lambda i: 0.5, cls="trace")
    b = b.set_column(REQUESTS.get_field_index("request_id"), pa.field("request_id", pa.string()),
                     pa.array([f"t{i}" for i in range(40)]))
    f = M.request_frame(pa.concat_tables([a, b]), stages=stages, slo={"chat": {"ttft_ms": 100}})
    assert f["has_slo"].sum() == 40
    assert M.statistic(f, "slo_attainment") == 1.0  # the 40 chat requests only, not 80
    assert M.statistic(f, "goodput_rps") == pytest.approx(40 / M.achieved_s(f))
    assert M.statistic(f, "throughput_rps") == pytest.approx(80 / M.achieved_s(f))
    trace = f[f["request_class"] == "trace"]
    assert np.isnan(M.statistic(trace, "goodput_rps"))
    assert np.isnan(M.statistic(trace, "slo_attainment"))
    est, reps = M.bootstrap_replicates(trace, "goodput_rps", 50)
    assert np.isnan(est) and np.isnan(reps).all()


def _report(table: pa.Table, stages: list) -> "ReportData":
    from kvbench.reports.measures.data import ReportData

    empty = pa.table({"endpoint": pa.array([], pa.string())})
    return ReportData(frame=M.request_frame(table, stages=stages), runs=[], paths=[],
                      gpu=empty, engine=empty, slo={})


def _late(table: pa.Table, late_ms) -> pa.Table:
    """Send request i ``late_ms(i)`` after its schedule (the load process's own delay)."""
    sched = table.column("t_scheduled").to_numpy()
    sent = sched + np.array([int(late_ms(i) * MS) for i in range(len(sched))])
    i = REQUESTS.get_field_index("t_sent")
    return table.set_column(i, REQUESTS.field(i), pa.array(sent, pa.int64()))


@pytest.mark.parametrize("late,overloaded,blamed", [
    # late only once the overloaded endpoint's backlog holds many streams: its finding says so
    (lambda i: 120.0 if i >= 120 else 0.0, True, False),
    # late all along (every 3rd send, whatever is in flight): the load process itself
    (lambda i: 120.0 if i % 3 == 0 else 0.0, True, True),
    # the same backlog-shaped lateness on an endpoint that keeps up: the load process
    (lambda i: 120.0 if i >= 120 else 0.0, False, True),
])
def test_the_client_is_not_blamed_for_the_servers_backlog(late, overloaded, blamed):
    from kvbench.reports.analysis import diagnose as D

    if overloaded:
        table, stages = _stage(200, 10.0, lambda i: 0.15 * i + 0.05, lambda i: 0.15 * i + 0.5)
    else:
        table, stages = _stage(200, 10.0, lambda i: 0.05, lambda i: 0.5 + 0.01 * i)
    d = _report(_late(table, late), stages)
    over = D.overloaded(d)
    assert bool(over) == overloaded
    assert bool(D.loadgen_saturated(d)) == blamed
    if overloaded and not blamed:
        (x,) = over
        assert "not the load process" in " ".join(k for k, _ in x.evidence)
