"""The live summary (kvbench.loadgen.liveview.live) against the reports' own metric definitions, its exact
structures against numpy, the shard tail on a shard being written, and kvbench run's progress
line (kvbench.runs.progress)."""

import io
import json
import time

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from kvbench.core.schema import ENGINE
from kvbench.core.store import ShardTail, ShardWriter
from kvbench.loadgen.liveview import live, live_quantiles
from kvbench.reports.statistics import metrics as M
from kvbench.runs import progress
from kvbench.core.contract import StagePlan as JobStage
from kvbench.runs.job import Job, JobEndpoint
import synthetic

finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=300))
def test_sorted_quantiles_are_numpys_linear(values):
    a = np.asarray(values)
    want = [np.quantile(a, q) for q in live.QS]
    assert live.quantiles(np.sort(a)) == pytest.approx(want, rel=1e-12, abs=1e-9)
    assert live.quantiles_of(a.copy()) == pytest.approx(want, rel=1e-12, abs=1e-9)


@given(st.lists(st.lists(finite, max_size=40), min_size=1, max_size=8))
def test_since_start_merges_batches_exactly(batches):
    s = live.SinceStart()
    for b in batches:
        s.add(np.asarray(b, float))
        s.quantiles()  # merged in between, as a watched run does
    allv = np.asarray([v for b in batches for v in b], float)
    want = [np.quantile(allv, q) for q in live.QS] if len(allv) else [None] * 3
    assert s.quantiles() == (pytest.approx(want) if len(allv) else want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(min_value=0, max_value=2000, allow_nan=False), max_size=50),
                min_size=1, max_size=6), st.integers(0, 5))
def test_microsecond_histogram_is_exact_with_a_window_leaving(batches, keep):
    """Window + archive (what left it) = since start; both exact over us-rounded values,
    values above the histogram's range (0.52 s) included."""
    win, arch = live.MicroHist(), live.MicroHist()
    parts = [live.MicroHist.split(np.rint(np.asarray(b, float) * 1e3).astype(np.int64))
             for b in batches]
    for p in parts:
        win.add(p)
    gone = parts[:max(0, len(parts) - keep)]
    for p in gone:
        win.add(p, -1, into=arch)
    win.big = live.SinceStart()  # rebuilt from what stays, as KeyStats.trim does
    for p in parts[len(gone):]:
        win.big.add(p[1])
    us = [np.rint(np.asarray(b, float) * 1e3) for b in batches]
    for hists, vals in (([win, arch], us), ([win], us[len(gone):])):
        v = np.concatenate(vals) if vals else np.empty(0)
        got = live.micro_quantiles(hists)
        if len(v) == 0:
            assert got == [None] * 3
        else:
            assert got == pytest.approx([np.quantile(v, q) / 1e3 for q in live.QS], abs=1e-9)


SLO = {"chat": {"ttft_ms": 150.0, "tpot_ms": 25.0}, "rag": {"e2e_ms": 3000.0}}


def test_live_summary_matches_the_reports_definitions():
    """Per class, since start: TTFT/TPOT/lateness percentiles exactly, ITL to the microsecond,
    SLO attainment and error counts as the reports compute them from the same records."""
    shape = synthetic.RunShape(
        endpoints=[synthetic.EndpointShape("ep", error_rate=0.05, cancel_rate=0.05)],
        requests_per_stage=400, classes=("chat", "rag", "agent"))
    table, stages = synthetic.synth_table(shape)
    stats = live.LiveStats(SLO)
    for b in table.to_batches(max_chunksize=97):  # as the sink's flushes hand them over
        stats.tap(b)
    stats.drain()
    rows = {r["request_class"]: r for r in stats.summary()["rows"]}
    frame = M.request_frame(table, stages=stages, slo=SLO)
    assert set(rows) == {"chat", "rag", "agent"}
    for cls, r in rows.items():
        sub = frame[frame["request_class"] == cls]
        f = r["since"]
        o = M.outcomes(sub)
        assert (f["done"], f["ok"], f["errors"], f["cancelled"]) == (
            o["requests"], o["ok"], o["errors"], o["cancelled"])
        for m in ("ttft", "tpot", "lateness"):
            want = [M.statistic(sub, f"{m}_{q}") for q in ("p50", "p90", "p99")]
            assert f[m] == pytest.approx(want, rel=1e-9), (cls, m)
        itl = [M.statistic(sub, f"itl_{q}") for q in ("p50", "p90", "p99")]
        assert f["itl"] == pytest.approx(itl, abs=1e-3), cls  # us-rounded values
        if cls in SLO:
            assert f["slo_attainment"] == pytest.approx(M.statistic(sub, "slo_attainment"))
        else:
            assert f["slo_attainment"] is None


def test_window_forgets_what_left_it():
    ks = live.KeyStats()
    now = time.time_ns()
    old = {"ttft": np.array([1000.0]), "tpot": np.array([50.0]), "itl_us": np.array([900_000]),
           "lateness": np.array([5.0])}
    new = {"ttft": np.array([10.0, 20.0]), "tpot": np.array([5.0]),
           "itl_us": np.array([1000, 2000, 3000]), "lateness": np.array([0.5])}
    c = dict(live_quantiles._zeros(), done=1, ok=1)
    ks.add(now - int(60e9), old, c)
    ks.add(now, new, dict(c, done=2, ok=2))
    s = ks.summary(30.0, now, 90.0)
    assert s["window"]["done"] == 2 and s["since"]["done"] == 3
    assert s["window"]["ttft"][2] == pytest.approx(np.quantile([10, 20], 0.99))
    assert s["window"]["itl"][2] == pytest.approx(np.quantile([1, 2, 3], 0.99))
    assert s["since"]["itl"][2] == pytest.approx(np.quantile([1, 2, 3, 900], 0.99))
    assert s["since"]["ttft"][2] == pytest.approx(np.quantile([10, 20, 1000], 0.99))


def test_worker_message_round_trip_keeps_values_exactly():
    table, _ = synthetic.synth_table(synthetic.RunShape(requests_per_stage=50))
    derived = live.derive(table.to_batches()[0], SLO)
    back = live._unwire(live._wire(derived))
    assert back.keys() == derived.keys()
    for k in derived:
        assert back[k][1] == derived[k][1]
        for m, a in derived[k][0].items():
            np.testing.assert_array_equal(back[k][0][m], a)


def test_shard_tail_reads_what_is_appended_and_waits_for_a_partial_batch(tmp_path):
    """The store's tail, as the live view's telemetry reads the collectors' Arrow shards."""
    w = ShardWriter(tmp_path, "engine")
    tail = ShardTail(tmp_path, "engine")

    def rows(t):
        return pa.RecordBatch.from_pylist(
            [{"t_ns": t, "endpoint": "e", "metric": "vllm:num_requests_waiting", "labels": [],
              "value": float(t)}], schema=ENGINE)

    w.write(rows(1))
    assert [b.num_rows for b in tail.new()] == [1]
    w.write(rows(2))
    w.write(rows(3))
    size = w.path.stat().st_size
    w.write(rows(4))
    full = w.path.read_bytes()
    w.path.write_bytes(full[:size + 20])  # a batch half written
    assert [b.column("t_ns")[0].as_py() for b in tail.new()] == [2, 3]
    w.path.write_bytes(full)
    assert [b.column("t_ns")[0].as_py() for b in tail.new()] == [4]
    assert tail.new() == []
    assert tail.read().column("t_ns").to_pylist() == [1, 2, 3, 4]


def test_telemetry_from_collector_shards(tmp_path):
    w = ShardWriter(tmp_path, "engine")
    for t, waiting, kv, hits, queries in ((0, 1, 0.2, 0, 0), (10**9, 3, 0.5, 30, 100)):
        w.write(pa.RecordBatch.from_pylist([
            {"t_ns": t, "endpoint": "ep", "metric": m, "labels": [], "value": float(v)}
            for m, v in (("vllm:num_requests_waiting", waiting), ("vllm:kv_cache_usage_perc", kv),
                         ("vllm:prefix_cache_hits_total", hits),
                         ("vllm:prefix_cache_queries_total", queries),
                         ("vllm:num_requests_running", 2))], schema=ENGINE))
    tele = live.TelemetryTail(tmp_path).summary(30.0)
    e = tele["engines"]["ep"]
    assert (e["waiting"], e["kv_usage"], e["running"]) == (3, 0.5, 2)
    assert e["hit_ratio"] == pytest.approx(0.3)
    none = live.TelemetryTail(tmp_path / "nothing").summary(30.0)
    assert "collectors not running" in none["note"]


class Tty(io.StringIO):
    def isatty(self):
        return True


def job(pacing="poisson"):
    return Job(endpoint=JobEndpoint("ep", "http://127.0.0.1:1"), workload="chat", pacing=pacing,
               stages=[JobStage(0, 10.0, rate_rps=5.0), JobStage(1, 10.0, rate_rps=10.0)])


def live_file(run_dir, name, stage, done, errors, ttft, t_start_ns):
    (run_dir / f"live-{name}.json").write_text(json.dumps({
        "state": {"open_stage": {"index": stage, "duration_s": 10.0, "t_start_ns": t_start_ns,
                                 "rate_rps": 10.0}},
        "stages": {str(stage): {"done": done, "errors": errors}}, "ttft_ms_recent": ttft}))


def test_progress_line_sums_processes_and_takes_the_exact_p50(tmp_path):
    now = time.time_ns()
    live_file(tmp_path, "a", 1, 7, 1, [10.0, 30.0], now - int(4e9))
    live_file(tmp_path, "b", 1, 5, 2, [20.0], now - int(4e9))
    (tmp_path / "live-broken.json").write_text("{")  # being replaced: skipped
    text = progress.line(job(), progress.read_live(tmp_path), now)
    assert text.startswith("  stage 2/2 (10.0 req/s) [########............] 4/10 s")
    assert "12 done" in text and "TTFT p50 20 ms" in text and "3 errors" in text
    assert progress.line(job(), [], now) is None


def test_progress_is_quiet_unless_a_terminal(tmp_path):
    live_file(tmp_path, "a", 0, 3, 0, [10.0], time.time_ns())
    quiet = io.StringIO()
    with progress.Progress(job(), tmp_path, stream=quiet, poll_s=0.01):
        time.sleep(0.2)
    assert quiet.getvalue() == ""
    live_file(tmp_path, "a", 0, 3, 0, [10.0], time.time_ns())
    tty = Tty()
    with progress.Progress(job(), tmp_path, stream=tty, poll_s=0.01) as p:
        for _ in range(500):
            if tty.getvalue():
                break
            time.sleep(0.01)
        live_file(tmp_path, "a", 1, 4, 0, [10.0], time.time_ns())
        for _ in range(500):
            if "stage 2/2" in tty.getvalue():
                break
            time.sleep(0.01)
    out = tty.getvalue()
    assert out.startswith("\r  stage 1/2") and "3 done" in out
    assert "\n\r  stage 2/2" in out and out.endswith("\n")  # stage 1's line stays
    assert p.enabled
    assert not list(tmp_path.glob("live-*.json"))  # swept once the job is over
