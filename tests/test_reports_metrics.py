"""The metric registry, the request frame and the bootstrap engine against hand-computed cases
and hypothesis properties."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.core.schema import REQUESTS
from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.measures import frame as F
from kvbench.reports.statistics import metrics as M
from kvbench.reports.statistics import resampling as R
from synthetic import EndpointShape, RunShape, engine_table, synth_table

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
    assert F.wall_s(hand) == pytest.approx(4.0)
    # achieved interval: first send (row 0 at 2 ms) to the last completion (the error's, sent
    # at 2.004 s with no response; row 1 ended at 1.24 s)
    a = 2.004 - 0.002
    assert F.achieved_s(hand) == pytest.approx(a)
    assert M.statistic(hand, "throughput_rps") == pytest.approx(3 / a)
    assert M.statistic(hand, "goodput_rps") == pytest.approx(1 / a)  # only the chat one met SLO
    assert M.statistic(hand, "error_rate") == pytest.approx(1 / 3)
    assert M.statistic(hand, "slo_attainment") == pytest.approx(1 / 3)
    assert M.statistic(hand, "output_tps") == pytest.approx(9 / a)
    assert M.statistic(hand, "input_tps") == pytest.approx(200 / a)
    # no stage record of pacing: offered over the scheduled span (0 .. 2 s)
    assert M.statistic(hand, "offered_rps") == pytest.approx(3 / 2)
    assert M.statistic(hand, "hit_ratio") == pytest.approx(50 / 200)
    eb = M.error_breakdown(hand)
    assert dict(zip(eb["status"], eb["requests"])) == {"ok": 2, "http_error": 1}


def test_group_bys_and_buckets(hand):
    s = M.summarise(hand, by=["request_class"], metrics=["ttft_p50", "error_rate"])
    assert list(s["request_class"]) == ["chat", "rag"]
    assert list(s["ttft_p50"]) == [100.0, 200.0]
    assert list(hand["prompt_bucket"].astype(str)) == ["0-255"] * 3
    b = F.prompt_buckets(np.array([0, 255, 256, 511, 512, 70000, np.nan]))
    assert list(b.astype(str))[:6] == ["0-255", "0-255", "256-511", "256-511", "512-1023",
                                       ">=65536"]
    assert b.codes[6] == -1


def test_unknown_metric_is_a_user_error(hand):
    from kvbench.core.errors import UserError

    with pytest.raises(UserError, match="unknown metric 'ttft_p42'"):
        M.statistic(hand, "ttft_p42")


def test_without_stage_times_wall_comes_from_data():
    f = M.request_frame(table(HAND))
    # first scheduled at 0 s, last end at 2 s + 4 ms + 0 (error row has no e2e) -> 2.004 s
    assert F.wall_s(f) == pytest.approx(2.004)


def test_engine_counter_deltas_handle_resets():
    s = 10**9
    queries, hits = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
    eng = engine_table([
        (0 * s, "ep", queries, {}, 100.0), (1 * s, "ep", queries, {}, 300.0),
        (2 * s, "ep", queries, {}, 50.0),  # restart: counts from 0 again
        (0 * s, "ep", hits, {}, 10.0), (1 * s, "ep", hits, {}, 110.0),
        (2 * s, "ep", hits, {}, 25.0),
        (0 * s, "x", queries, {"engine": "1"}, 0.0),
        (1 * s, "x", queries, {"engine": "1"}, 0.0),
    ])
    assert E.counter_increase(eng, queries) == {"ep": 250.0, "x": 0.0}
    assert E.hit_ratio(eng) == {"ep": pytest.approx(125 / 250)}


def test_quantile_bootstrap_matches_index_resampling():
    rng = np.random.default_rng(1)
    v = rng.lognormal(3, 1, 500)
    for q in (0.5, 0.99):
        fast = R.quantile_bootstrap(v, q, resamples=4000, seed=3)
        idx = rng.integers(0, len(v), (4000, len(v)))
        slow = np.quantile(np.quantile(v[idx], q, axis=1), [0.025, 0.975])
        width = slow[1] - slow[0]
        assert fast.estimate == pytest.approx(np.quantile(v, q))
        assert abs(fast.low - slow[0]) < 0.15 * width
        assert abs(fast.high - slow[1]) < 0.15 * width
    assert R.quantile_bootstrap(v, 0.5, seed=9) == R.quantile_bootstrap(v, 0.5, seed=9)


def test_bootstrap_of_every_metric_brackets_estimate():
    tab, stages = synth_table(RunShape(endpoints=[EndpointShape("a", error_rate=0.1)],
                                       requests_per_stage=300))
    f = M.request_frame(tab, stages=stages, slo={"chat": {"ttft_ms": 80}})
    for name in M.METRICS:
        assert M.METRIC_INFO[name].definition  # every metric names its printed definition
        ci = M.bootstrap(f, name, resamples=200, seed=1)
        assert ci.low <= ci.estimate <= ci.high or math.isclose(ci.low, ci.high), name
        assert ci.estimate == pytest.approx(M.statistic(f, name), nan_ok=True)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**9), min_size=0, max_size=8), min_size=1,
                max_size=20))
def test_chunk_gaps_property(chunk_lists):
    offsets = [sorted(x) for x in chunk_lists]
    got = F.chunk_gaps(pa.array(offsets, pa.list_(pa.int64()))).to_pylist()
    want = [[(b - a) / 1e6 for a, b in zip(x, x[1:])] for x in offsets]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-6, abs=1e-3)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.1, 1e5), min_size=1, max_size=60), st.sampled_from(
    list(M.QUANTILES.values())))
def test_quantile_bootstrap_properties(values, q):
    ci = R.quantile_bootstrap(np.array(values), q, resamples=200, seed=0)
    assert min(values) <= ci.low <= ci.high <= max(values)
    assert ci.estimate == pytest.approx(np.quantile(values, q))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.floats(0.0, 1.0), st.integers(0, 2**16))
def test_rates_properties(n, err, seed):
    tab, stages = synth_table(RunShape(endpoints=[EndpointShape("a", error_rate=err)],
                                       requests_per_stage=n, max_chunks=5, seed=seed))
    f = M.request_frame(tab, stages=stages, slo={"chat": {"ttft_ms": 100}})
    good, thr = M.statistic(f, "goodput_rps"), M.statistic(f, "throughput_rps")
    # goodput is "no SLO" (NaN) exactly when no request is of the one class with an SLO
    assert math.isnan(good) == (not (f["request_class"] == "chat").any())
    good = 0.0 if math.isnan(good) else good
    assert 0 <= good <= thr
    assert 0 <= M.statistic(f, "error_rate") <= 1
    assert good <= thr * (1 - M.statistic(f, "error_rate")) + 1e-9
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
    f = M.request_frame(tab, stages=stages, slo={"chat": {"ttft_ms": 100}})
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
    g = F.GapStore.from_offsets(pa.array(offsets, pa.list_(pa.int64())), keep=keep)
    want = [[(b - a) / 1e6 for a, b in zip(x, x[1:])] if k else [] for x, k in
            zip(offsets, keep)]
    for got, w in zip(g.lists(), want):
        assert got == pytest.approx(w, rel=1e-6, abs=1e-3)
    pick = np.array(data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=10)), np.int64)
    pooled = [v for i in pick for v in want[i]]
    assert g.gather(pick).tolist() == pytest.approx(pooled, rel=1e-6, abs=1e-3)
    both = F.GapStore.concat([g, g])
    assert both.gather(np.array([len(rows) + i for i in pick], np.int64)).tolist() == \
        pytest.approx(pooled, rel=1e-6, abs=1e-3)


# --------------------------------------------------------------------------------------------
# ITL: cluster bootstrap over requests


def itl_frame(lens: np.ndarray, gaps_ms: np.ndarray):
    """A minimal frame for the ITL metrics: one row per request, gaps in a GapStore."""
    import pandas as pd

    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    f = pd.DataFrame({"itl_row": np.arange(len(lens), dtype=np.int64)})
    f.attrs["itl"] = F.GapStore(np.asarray(gaps_ms, np.float32), offsets)
    return f


def correlated_itl(n: int, gaps_per_request: int, sd_level: float, sd_within: float,
                   seed: int):
    """Each request's gaps are its own level (lognormal, sd ``sd_level`` of the log) times
    lognormal noise; the population's pooled log-gap is N(0, hypot(sd_level, sd_within))
    because the number of gaps does not depend on the level."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(gaps_per_request // 2, 3 * gaps_per_request // 2 + 1, n)
    level = rng.normal(0.0, sd_level, n)
    gaps = np.exp(np.repeat(level, lens) + rng.normal(0.0, sd_within, int(lens.sum())))
    return itl_frame(lens, gaps)


def true_pooled_quantile(q: float, sd_level: float, sd_within: float) -> float:
    from statistics import NormalDist

    return math.exp(math.hypot(sd_level, sd_within) * NormalDist().inv_cdf(q))


@pytest.mark.parametrize("q,name", [(0.5, "itl_p50"), (0.99, "itl_p99")])
def test_itl_interval_covers_under_within_request_correlation(q, name):
    truth = true_pooled_quantile(q, 1.0, 0.2)
    cluster_hits = naive_hits = 0
    ratios = []
    for rep in range(40):
        f = correlated_itl(1000, 20, 1.0, 0.2, seed=rep)
        ci = M.bootstrap(f, name, resamples=1000, seed=rep)
        naive = R.quantile_bootstrap(F.itl_values(f), q, resamples=1000, seed=rep)
        assert ci.estimate == pytest.approx(naive.estimate)
        cluster_hits += ci.low <= truth <= ci.high
        naive_hits += naive.low <= truth <= naive.high
        ratios.append((ci.high - ci.low) / (naive.high - naive.low))
    # 20 strongly correlated gaps a request: the pooled-gap interval is ~4x too narrow.
    assert cluster_hits / 40 >= 0.85, cluster_hits
    assert naive_hits / 40 <= 0.6, naive_hits
    assert np.median(ratios) > 2.5, np.median(ratios)


def test_itl_interval_on_independent_gaps_matches_the_pooled_one():
    truth = true_pooled_quantile(0.9, 0.0, 1.0)
    ratios, hits = [], 0
    for rep in range(12):
        f = correlated_itl(800, 20, 0.0, 1.0, seed=1000 + rep)
        ci = M.bootstrap(f, "itl_p90", resamples=1000, seed=rep)
        naive = R.quantile_bootstrap(F.itl_values(f), 0.9, resamples=1000, seed=rep)
        ratios.append((ci.high - ci.low) / (naive.high - naive.low))
        hits += ci.low <= truth <= ci.high
    assert 0.8 < np.median(ratios) < 1.25, ratios
    assert hits >= 10


@pytest.mark.parametrize("name", ["itl_p90", "itl_mean"])
def test_itl_replicates_match_explicit_request_resampling(name):
    """Same distribution as drawing requests with replacement and pooling their gaps."""
    f = correlated_itl(150, 12, 0.8, 0.3, seed=7)
    store, n = f.attrs["itl"], len(f)
    rng = np.random.default_rng(8)
    q = M.METRIC_INFO[name].q
    slow = []
    for _ in range(3000):
        pooled = store.gather(np.sort(rng.integers(0, n, n)))
        slow.append(np.quantile(pooled, q) if q is not None else pooled.mean(dtype=np.float64))
    lo, hi = np.quantile(slow, [0.025, 0.975])
    fast = M.bootstrap(f, name, resamples=3000, seed=9)
    assert abs(fast.low - lo) < 0.12 * (hi - lo)
    assert abs(fast.high - hi) < 0.12 * (hi - lo)


def test_itl_subsampled_requests_keep_the_interval_width():
    """Above max_requests: m-out-of-n with sqrt(m/n) rescaling, close to the full bootstrap."""
    subsampled = M.PooledGaps("itl_p50", "ITL p50", "ITL", 0.5, max_requests=800)
    ratios = []
    for rep in range(10):
        f = correlated_itl(4000, 10, 1.0, 0.3, seed=2000 + rep)
        full = R.interval(*M.METRIC_INFO["itl_p50"].replicates(f, 1000,
                                                               np.random.default_rng(rep)))
        est, reps = subsampled.replicates(f, 1000, np.random.default_rng(rep))
        sub = R.interval(est, reps)
        assert est == full.estimate == pytest.approx(M.statistic(f, "itl_p50"))
        assert sub.low <= est <= sub.high
        ratios.append((sub.high - sub.low) / (full.high - full.low))
    assert 0.75 < np.median(ratios) < 1.33, ratios


def test_itl_bootstrap_skips_requests_without_gaps_and_handles_none():
    f = itl_frame(np.array([0, 3, 0, 2]), np.array([1.0, 2.0, 3.0, 10.0, 20.0]))
    est, reps = M.bootstrap_replicates(f, "itl_p50", 500, seed=1)
    assert est == pytest.approx(3.0)
    # two requests with gaps, (1, 2, 3) and (10, 20): a replicate draws both (median 3), or
    # one of them twice (1, 1, 2, 2, 3, 3 -> 2; 10, 10, 20, 20 -> 15); gap-less rows never
    # enter the draw
    assert set(np.unique(reps).tolist()) == {2.0, 3.0, 15.0}
    empty = itl_frame(np.array([0, 0]), np.zeros(0))
    est, reps = M.bootstrap_replicates(empty, "itl_p99", 50, seed=1)
    assert math.isnan(est) and np.isnan(reps).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), max_size=6), min_size=1, max_size=10),
       st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.99, 1.0]), st.sampled_from([1, 3, None]),
       st.integers(0, 2**16))
def test_weighted_pool_quantiles_are_the_quantiles_of_the_repeated_pool(per_request, q, half,
                                                                        seed):
    lens = np.array([len(x) for x in per_request])
    if lens.sum() == 0:
        return
    vals = np.array([g for x in per_request for g in x], np.float32)
    req = np.repeat(np.arange(len(lens)), lens)
    w = np.random.default_rng(seed).integers(0, 4, (6, len(lens))).astype(np.float64)
    sg = R._SortedGaps(vals, req, len(lens))
    got = R.weighted_pool_quantiles(sg, lens.astype(np.float64), w, q, half)
    for b in range(len(w)):
        pool = np.repeat(vals, w[b][req].astype(np.int64))
        if len(pool) == 0:
            assert math.isnan(got[b])
        else:
            assert got[b] == pytest.approx(np.quantile(pool.astype(np.float64), q), abs=1e-9)
