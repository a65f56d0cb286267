"""A gate on runs too large to load whole (gate.load_bounded): judged on a seeded uniform
sample, rates scaled to the whole run, intervals rescaled to its size, said in the note; a
run under the bound is judged exactly as before."""

from pathlib import Path

import numpy as np
import pytest

from kvbench.config import GateConfig, GateRule
from kvbench.core.store import load_results
from kvbench.reports.analysis import gate
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

RULES = GateConfig(rules=[
    GateRule(metric="ttft_p50", max_increase_pct=10),
    GateRule(metric="throughput_rps", max_decrease_pct=10),
    GateRule(metric="error_rate", max_value=0.05),
], bootstrap_resamples=400)


def _run(tmp_path: Path, name: str, seed: int, n: int = 3000, slow: float = 1.0) -> Path:
    shape = RunShape(endpoints=[EndpointShape("colocated", slowdown=slow, error_rate=0.01)],
                     requests_per_stage=n, seed=seed)
    table, stages = synth_table(shape, run_id=name)
    cfg = {"suite": {"name": "synthetic", "seed": seed}, "slo": {},
           "gate": RULES.model_dump(by_alias=True)}
    return write_run(tmp_path / name, table, run_meta(shape, stages, run_id=name, config=cfg))


def test_a_run_under_the_bound_is_judged_as_before(tmp_path):
    b, c = _run(tmp_path, "b", 1, n=300), _run(tmp_path, "c", 2, n=300)
    old = gate.evaluate(load_results(b), load_results(c), RULES, slo={})
    lb, lc = gate.load_bounded(b), gate.load_bounded(c)
    assert lb.sampled is None and lc.sampled is None
    assert gate.to_records(gate.evaluate(lb, lc, RULES, slo={})) == gate.to_records(old)


def test_a_large_run_is_judged_on_a_sample_with_the_whole_runs_figures(tmp_path):
    b, c = _run(tmp_path, "b", 1), _run(tmp_path, "c", 2)
    whole = gate.evaluate(load_results(b), load_results(c), RULES, slo={})
    sb, sc = gate.load_bounded(b, max_requests=1500), gate.load_bounded(c, max_requests=1500)
    n = load_results(c).requests.num_rows
    assert sc.sampled.n == n and 1000 < sc.sampled.m < 2000
    assert sc.requests.num_rows == sc.sampled.m
    got = gate.evaluate(sb, sc, RULES, slo={})
    for w, s in zip(whole, got):
        assert s.metric == w.metric and s.verdict in ("pass", "inconclusive")
        assert "seeded samples" in s.note and f"of {n:,}" in s.note
        # the estimate is the whole run's within sampling error; a rate is not m/n of it
        assert s.current == pytest.approx(w.current, rel=0.1, abs=0.01)
        if s.kind == "relative":
            assert s.baseline == pytest.approx(w.baseline, rel=0.1)
            # the interval is the whole run's width (rescaled), not the sample's, within noise
            ws, ss = w.high - w.low, s.high - s.low
            assert 0.5 * ws < ss < 2.0 * ws, (s.metric, ws, ss)


def test_a_slowdown_still_fails_on_samples(tmp_path):
    b, c = _run(tmp_path, "b", 1), _run(tmp_path, "c", 2, slow=1.3)
    got = gate.evaluate(gate.load_bounded(b, max_requests=1500),
                        gate.load_bounded(c, max_requests=1500), RULES, slo={})
    assert {r.metric: r.verdict for r in got}["ttft_p50"] == "fail"


def test_the_sample_is_seeded(tmp_path):
    c = _run(tmp_path, "c", 2)
    a, b = gate.load_bounded(c, max_requests=1000), gate.load_bounded(c, max_requests=1000)
    assert a.requests.column("request_id").to_pylist() == \
        b.requests.column("request_id").to_pylist()
    ids = np.asarray(a.requests.column("request_id").to_pylist())
    assert len(set(ids)) == len(ids)


def test_a_hive_partitioned_large_run_is_sampled_with_its_keys(tmp_path):
    """The requests dataset (keys only in the folder names) is sampled as the single file."""
    import pyarrow.parquet as pq

    c = _run(tmp_path, "c", 2)
    table = load_results(c).requests
    import shutil

    (c / "requests.parquet").unlink(missing_ok=True)  # whichever layout wrote it
    shutil.rmtree(c / "requests", ignore_errors=True)
    d = c / "requests" / "endpoint=colocated" / "workload=w%20x"
    d.mkdir(parents=True)
    pq.write_table(table.drop_columns(["endpoint", "workload"]), d / "part-0.parquet")
    got = gate.load_bounded(c, max_requests=1000)
    assert got.sampled is not None and got.sampled.n == table.num_rows
    assert set(got.requests.column("endpoint").to_pylist()) == {"colocated"}
    assert set(got.requests.column("workload").to_pylist()) == {"w x"}
