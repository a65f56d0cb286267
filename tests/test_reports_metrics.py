"""reports.metrics against hand-computed cases and hypothesis properties."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.schema import REQUESTS
from reports import metrics as M
from reports.synthetic import EndpointShape, RunShape, engine_table, synth_table

MS = 1_000_000


def table(rows: list[dict]) -> pa.Table:
    """Requests table from a few hand-written rows (missing columns are null)."""
    cols = {}
    for name, typ in zip(REQUESTS.names, REQUESTS.types):
        cols[name] = pa.array([r.get(name) for r in rows], typ)
    return pa.table(cols, schema=REQUESTS)


def row(i, **kw):
    base = dict(run_id="r", endpoint="ep", topology="colocated", workload="w",
                request_class="chat", stage=0, request_id=f"q{i}", session_id=f"s{i}", turn=0,
                worker="h:1", prompt_tokens=100, prompt_tokens_client=100,
                shared_prefix_tokens=0, max_tokens=10, completion_tokens=5, cached_tokens=None,
                t_scheduled=10**18 + i * 10**9, t_sent=10**18 + i * 10**9, status="ok")
    base.update(kw)
    return base


HAND = [
    # TTFT 100 ms; chunks at 100, 110, 130, 160 ms (1+1+2+1 tokens) -> gaps 10, 20, 30
    row(0, ttft_ns=100 * MS, chunk_offsets_ns=[100 * MS, 110 * MS, 130 * MS, 160 * MS],
        chunk_tokens=[1, 1, 2, 1], e2e_ns=160 * MS, completion_tokens=5, cached_tokens=50,
        t_sent=10**18 + 2 * MS),
    # TTFT 200 ms; one chunk of 3 tokens at 200 ms, then one at 240 -> gap 40; E2E 240
    row(1, ttft_ns=200 * MS, chunk_offsets_ns=[200 * MS, 240 * MS], chunk_tokens=[3, 1],
        e2e_ns=240 * MS, completion_tokens=4, cached_tokens=0, request_class="rag"),
    # an error: no latency, counts in error rate and lateness, misses goodput
    row(2, status="http_error", http_status=503, error="busy", completion_tokens=0,
        t_sent=10**18 + 2 * 10**9 + 4 * MS),
]
STAGES = [{"endpoint": "ep", "workload": "w", "index": 0, "t_start_ns": 10**18,
           "t_end_ns": 10**18 + 4 * 10**9}]


@pytest.fixture
def hand():
    return M.request_frame(table(HAND), stages=STAGES, slo={"chat": {"ttft_ms": 150},
                                                            "rag": {"ttft_ms": 150}})


def test_hand_computed_latencies(hand):
    assert M.statistic(hand, "ttft_p50") == pytest.approx(150.0)  # linear between 100 and 200
    assert M.statistic(hand, "ttft_mean") == pytest.approx(150.0)
    assert M.statistic(hand, "e2e_p99") == pytest.approx(160 + 0.99 * 80)
    # TPOT: (160-100)/(5-1) = 15 and (240-200)/(4-1) = 13.33
    assert M.statistic(hand, "tpot_mean") == pytest.approx((15 + 40 / 3) / 2)
    # ITL pooled: 10, 20, 30, 40 (the 2-token chunk is one gap)
    assert M.statistic(hand, "itl_mean") == pytest.approx(25.0)
    assert M.statistic(hand, "itl_p50") == pytest.approx(25.0)
    assert M.statistic(hand, "itl_p999") == pytest.approx(30 + (3 * 0.999 - 2) * 10)
    # lateness: 2 ms, 0, 4 ms (every sent request, errors included)
    assert M.statistic(hand, "lateness_mean") == pytest.approx(2.0)
    assert M.statistic(hand, "lateness_p99.9") == pytest.approx(M.statistic(hand,
                                                                            "lateness_p999"))


def test_hand_computed_rates(hand):
    assert M.wall_s(hand) == pytest.approx(4.0)
    assert M.statistic(hand, "throughput_rps") == pytest.approx(3 / 4)
    assert M.statistic(hand, "goodput_rps") == pytest.approx(1 / 4)  # only the chat one met SLO
    assert M.statistic(hand, "error_rate") == pytest.approx(1 / 3)
    assert M.statistic(hand, "slo_attainment") == pytest.approx(1 / 3)
    assert M.statistic(hand, "output_tps") == pytest.approx(9 / 4)
    assert M.statistic(hand, "input_tps") == pytest.approx(200 / 4)
    assert M.statistic(hand, "hit_ratio") == pytest.approx(50 / 200)
    eb = M.error_breakdown(hand)
    assert dict(zip(eb["status"], eb["requests"])) == {"ok": 2, "http_error": 1}


def test_group_bys_and_buckets(hand):
    s = M.summarise(hand, by=["request_class"], metrics=["ttft_p50", "error_rate"])
    assert list(s["request_class"]) == ["chat", "rag"]
    assert list(s["ttft_p50"]) == [100.0, 200.0]
    assert list(hand["prompt_bucket"].astype(str)) == ["0-255"] * 3
    b = M.prompt_buckets(np.array([0, 255, 256, 511, 512, 70000, np.nan]))
    assert list(b.astype(str))[:6] == ["0-255", "0-255", "256-511", "256-511", "512-1023",
                                       ">=65536"]
    assert b.codes[6] == -1


def test_unknown_metric_is_a_user_error(hand):
    from kvbench.errors import UserError

    with pytest.raises(UserError, match="unknown metric 'ttft_p42'"):
        M.statistic(hand, "ttft_p42")


def test_without_stage_times_wall_comes_from_data():
    f = M.request_frame(table(HAND))
    # first scheduled at 0 s, last end at 2 s + 4 ms + 0 (error row has no e2e) -> 2.004 s
    assert M.wall_s(f) == pytest.approx(2.004)


def test_engine_counter_deltas_handle_resets():
    s = 10**9
    eng = engine_table([
        (0 * s, "ep", M.PREFIX_QUERIES, {}, 100.0), (1 * s, "ep", M.PREFIX_QUERIES, {}, 300.0),
        (2 * s, "ep", M.PREFIX_QUERIES, {}, 50.0),  # restart: counts from 0 again
        (0 * s, "ep", M.PREFIX_HITS, {}, 10.0), (1 * s, "ep", M.PREFIX_HITS, {}, 110.0),
        (2 * s, "ep", M.PREFIX_HITS, {}, 25.0),
        (0 * s, "x", M.PREFIX_QUERIES, {"engine": "1"}, 0.0),
        (1 * s, "x", M.PREFIX_QUERIES, {"engine": "1"}, 0.0),
    ])
    assert M.engine_counter_increase(eng, M.PREFIX_QUERIES) == {"ep": 250.0, "x": 0.0}
    assert M.engine_hit_ratio(eng) == {"ep": pytest.approx(125 / 250)}


def test_quantile_bootstrap_matches_index_resampling():
    rng = np.random.default_rng(1)
    v = rng.lognormal(3, 1, 500)
    for q in (0.5, 0.99):
        fast = M.quantile_bootstrap(v, q, resamples=4000, seed=3)
        idx = rng.integers(0, len(v), (4000, len(v)))
        slow = np.quantile(np.quantile(v[idx], q, axis=1), [0.025, 0.975])
        width = slow[1] - slow[0]
        assert fast.estimate == pytest.approx(np.quantile(v, q))
        assert abs(fast.low - slow[0]) < 0.15 * width
        assert abs(fast.high - slow[1]) < 0.15 * width
    assert M.quantile_bootstrap(v, 0.5, seed=9) == M.quantile_bootstrap(v, 0.5, seed=9)


def test_bootstrap_of_every_metric_brackets_estimate():
    tab, stages = synth_table(RunShape(endpoints=[EndpointShape("a", error_rate=0.1)],
                                       requests_per_stage=300))
    f = M.request_frame(tab, stages=stages, slo={"chat": {"ttft_ms": 80}})
    for name in M.METRICS:
        ci = M.bootstrap(f, name, resamples=200, seed=1)
        assert ci.low <= ci.estimate <= ci.high or math.isclose(ci.low, ci.high), name
        assert ci.estimate == pytest.approx(M.statistic(f, name), nan_ok=True)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**9), min_size=0, max_size=8), min_size=1,
                max_size=20))
def test_chunk_gaps_property(chunk_lists):
    offsets = [sorted(x) for x in chunk_lists]
    got = M.chunk_gaps(pa.array(offsets, pa.list_(pa.int64()))).to_pylist()
    want = [[(b - a) / 1e6 for a, b in zip(x, x[1:])] for x in offsets]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-6, abs=1e-3)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.1, 1e5), min_size=1, max_size=60), st.sampled_from(
    list(M.QUANTILES.values())))
def test_quantile_bootstrap_properties(values, q):
    ci = M.quantile_bootstrap(np.array(values), q, resamples=200, seed=0)
    assert min(values) <= ci.low <= ci.high <= max(values)
    assert ci.estimate == pytest.approx(np.quantile(values, q))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.floats(0.0, 1.0), st.integers(0, 2**16))
def test_rates_properties(n, err, seed):
    tab, stages = synth_table(RunShape(endpoints=[EndpointShape("a", error_rate=err)],
                                       requests_per_stage=n, max_chunks=5, seed=seed))
    f = M.request_frame(tab, stages=stages, slo={"chat": {"ttft_ms": 100}})
    good, thr = M.statistic(f, "goodput_rps"), M.statistic(f, "throughput_rps")
    assert 0 <= good <= thr
    assert 0 <= M.statistic(f, "error_rate") <= 1
    assert M.statistic(f, "goodput_rps") <= thr * (1 - M.statistic(f, "error_rate")) + 1e-9
    h = M.statistic(f, "hit_ratio")
    assert math.isnan(h) or 0 <= h <= 1
    # percentiles are monotone in q
    qs = [M.statistic(f, f"ttft_{k}") for k in M.QUANTILES]
    if not any(math.isnan(x) for x in qs):
        assert qs == sorted(qs)


def test_evaluate_agrees_with_statistic_and_bootstrap():
    tab, stages = synth_table(RunShape(endpoints=[EndpointShape("a", error_rate=0.05)],
                                       requests_per_stage=200))
    f = M.request_frame(tab, stages=stages, slo={"rag": {"ttft_ms": 90}})
    names = list(M.METRICS)
    got = M.evaluate(f, names)
    cis = M.evaluate(f, names, ci=True, resamples=300, seed=4)
    for n in names:
        assert got[n] == pytest.approx(M.statistic(f, n), nan_ok=True), n
        assert tuple(cis[n]) == pytest.approx(tuple(M.bootstrap(f, n, resamples=300, seed=4)),
                                              nan_ok=True), n


def test_bootstrap_replicates_are_seeded_and_sized():
    tab, stages = synth_table(RunShape(endpoints=[EndpointShape("a", error_rate=0.1)],
                                       requests_per_stage=150))
    f = M.request_frame(tab, stages=stages)
    for name in ("ttft_p99", "itl_p50", "e2e_mean", "goodput_rps", "output_tps", "hit_ratio"):
        est, reps = M.bootstrap_replicates(f, name, 300, seed=5)
        est2, reps2 = M.bootstrap_replicates(f, name, 300, seed=5)
        assert len(reps) == 300 and est == est2 and np.array_equal(reps, reps2), name
        assert est == pytest.approx(M.statistic(f, name)), name
        assert np.nanstd(reps) > 0, name


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 10**9), max_size=6), st.booleans()),
                min_size=1, max_size=15), st.data())
def test_gap_store_keep_and_gather(rows, data):
    offsets = [sorted(x) for x, _ in rows]
    keep = np.array([k for _, k in rows])
    g = M.GapStore.from_offsets(pa.array(offsets, pa.list_(pa.int64())), keep=keep)
    want = [[(b - a) / 1e6 for a, b in zip(x, x[1:])] if k else [] for x, k in
            zip(offsets, keep)]
    for got, w in zip(g.lists(), want):
        assert got == pytest.approx(w, rel=1e-6, abs=1e-3)
    pick = np.array(data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=10)), np.int64)
    pooled = [v for i in pick for v in want[i]]
    assert g.gather(pick).tolist() == pytest.approx(pooled, rel=1e-6, abs=1e-3)
    both = M.GapStore.concat([g, g])
    assert both.gather(np.array([len(rows) + i for i in pick], np.int64)).tolist() == \
        pytest.approx(pooled, rel=1e-6, abs=1e-3)
