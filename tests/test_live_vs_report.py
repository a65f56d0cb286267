"""The live view's figures equal the report's for the same records: a run's records written as
a load process writes them (``.rows`` shards), read by the live view (``LiveStats.follow``,
through the store's row tail) and by the report (``store.read_table`` -> ``request_frame`` ->
``reports.metrics``).

Exact where both are exact: counts, SLO attainment, error rate and hit ratio, and the TTFT,
TPOT and lateness percentiles (the same values, numpy's linear quantile; only the last bits of
the interpolation's arithmetic may differ). ITL by design not to the bit: the live view counts
gaps in whole microseconds (rounded to the nearest) and the report keeps float32 ms, so their
quantiles differ by at most half a microsecond plus float32's rounding of the report's value.
Rates differ in their time base only (the live view's wall time since its start, the report's
achieved interval of each stage): their counts are equal."""

import numpy as np
import pytest

from kvbench.core import store
from kvbench.core.rows import REQUEST_COLUMNS, RowShardWriter
from kvbench.loadgen.liveview import live
from kvbench.reports.statistics import metrics as M
import synthetic

SLO = {"chat": {"ttft_ms": 150.0, "tpot_ms": 25.0}, "rag": {"e2e_ms": 3000.0},
       "agent": {"tpot_ms": 21.0}}
QS = ("p50", "p90", "p99")
ITL_BOUND_MS = 0.5e-3  # half a microsecond: the live view's rounding of each gap


def _records() -> tuple[dict, list]:
    shape = synthetic.RunShape(
        endpoints=[synthetic.EndpointShape("ep", error_rate=0.05, cancel_rate=0.05),
                   synthetic.EndpointShape("other", hit_fraction=0.2)],
        requests_per_stage=300, classes=("chat", "rag", "agent", "longctx"), seed=3)
    table, stages = synthetic.synth_table(shape)
    cols = table.to_pydict()
    # what real records also hold: one-token answers, no server usage (the client's counts
    # stand in), no cached_tokens
    for i in range(0, len(cols["status"]), 17):
        if cols["status"][i] == "ok":
            first = cols["chunk_offsets_ns"][i][:1]
            cols["chunk_offsets_ns"][i] = first
            cols["completion_tokens"][i] = 1
            cols["e2e_ns"][i] = first[0] if first else cols["e2e_ns"][i]
    for i in range(5, len(cols["status"]), 23):
        cols["prompt_tokens"][i] = None
        cols["completion_tokens"][i] = None
    for i in range(7, len(cols["status"]), 19):
        cols["cached_tokens"][i] = None
    return cols, stages


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cols, stages = _records()
    w = RowShardWriter(run_dir, "requests")
    n = len(cols["status"])
    for s in range(0, n, 97):  # as the sink flushes them
        w.write([cols[c][s:s + 97] if c in cols else [None] * len(cols["status"][s:s + 97])
                 for c in REQUEST_COLUMNS])
    w.close()
    stats = live.LiveStats(SLO)
    stats.follow(run_dir)
    stats.drain()
    frame = M.request_frame(store.read_table(run_dir, "requests"), stages=stages, slo=SLO)
    return stats.summary()["rows"], frame, n


def test_every_record_reached_both(run):
    rows, frame, n = run
    assert sum(r["since"]["done"] for r in rows) == len(frame) == n


def test_live_figures_equal_the_reports(run):
    rows, frame, _ = run
    assert {(r["endpoint"], r["request_class"]) for r in rows} == set(
        frame.groupby(["endpoint", "request_class"], observed=True).groups)
    for r in rows:
        key = (r["endpoint"], r["request_class"])
        sub = frame[(frame["endpoint"] == key[0]) & (frame["request_class"] == key[1])]
        f = r["since"]
        o = M.outcomes(sub)
        assert (f["done"], f["ok"], f["errors"], f["cancelled"]) == (
            o["requests"], o["ok"], o["errors"], o["cancelled"]), key
        for m in ("ttft", "tpot", "lateness"):
            want = [M.statistic(sub, f"{m}_{q}") for q in QS]
            got = [np.nan if v is None else v for v in f[m]]
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12, nan_ok=True), (key, m)
        want = [M.statistic(sub, f"itl_{q}") for q in QS]
        for g, w in zip(f["itl"], want):
            assert abs(g - w) <= ITL_BOUND_MS + abs(w) * 2.0 ** -24, (key, g, w)
        assert f["errors"] / (f["done"] - f["cancelled"]) == pytest.approx(
            M.statistic(sub, "error_rate"), rel=1e-15)
        hit = M.statistic(sub, "hit_ratio")
        assert f["hit_ratio"] == pytest.approx(hit, rel=1e-15), key
        # counts behind the rates: finished requests (throughput), within SLO (goodput)
        span = M.achieved_s(sub)
        assert f["done"] - f["cancelled"] == pytest.approx(
            M.statistic(sub, "throughput_rps") * span, rel=1e-9)
        if key[1] in SLO:
            assert f["slo_attainment"] == pytest.approx(M.statistic(sub, "slo_attainment"),
                                                        rel=1e-15), key
            assert f["slo_met"] == pytest.approx(M.statistic(sub, "goodput_rps") * span,
                                                 rel=1e-9), key
        else:
            assert f["slo_attainment"] is None and np.isnan(M.statistic(sub, "slo_attainment"))


def test_the_tail_reads_only_what_was_appended(tmp_path):
    """Following a growing shard twice derives each record once."""
    cols, _ = _records()
    w = RowShardWriter(tmp_path, "requests")
    stats = live.LiveStats(SLO)
    for s in (0, 50):
        w.write([cols[c][s:s + 50] if c in cols else [None] * 50 for c in REQUEST_COLUMNS])
        stats.follow(tmp_path)
        stats.drain()
    w.close()
    assert sum(r["since"]["done"] for r in stats.summary()["rows"]) == 100
