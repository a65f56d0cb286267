"""A sampled gate's figures are exact (issue 34): a run just over the sampling bound (lowered
by $KVBENCH_GATE_MAX_REQUESTS) is judged on a seeded sample for its intervals only; every
figure the gate prints and records is the statistic over all its requests, equal to the
in-memory evaluation (numpy's linear percentile) to the last bit."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbench.config import GateConfig, GateRule
from kvbench.core.store import load_results
from kvbench.reports.analysis import gate
from kvbench.reports.statistics import metrics as M
from kvbench.reports.statistics.columnar_groups import exact_figures
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

ROOT = Path(__file__).resolve().parents[1]
SLO = {"chat": {"ttft_ms": 400.0, "tpot_ms": 60.0}, "rag": {"ttft_ms": 900.0}}
RULES = [
    {"metric": "ttft_p99", "max_increase_pct": 10},
    {"metric": "tpot_p50", "request_class": "chat", "max_increase_pct": 10},
    {"metric": "itl_p99", "max_increase_pct": 10},
    {"metric": "itl_p50", "request_class": "rag", "max_increase_pct": 10},
    {"metric": "e2e_p90", "max_increase_pct": 10},
    {"metric": "lateness_p50", "max_increase_pct": 50},
    {"metric": "throughput_rps", "max_decrease_pct": 10},
    {"metric": "goodput_rps", "max_decrease_pct": 10},
    {"metric": "output_tps", "request_class": "agent", "max_decrease_pct": 10},
    {"metric": "slo_attainment", "max_decrease_pct": 10},
    {"metric": "hit_ratio", "max_decrease_pct": 10},
    {"metric": "error_rate", "max_value": 0.5},
]


def _run(tmp_path: Path, name: str, seed: int, n: int = 600) -> Path:
    shape = RunShape(endpoints=[EndpointShape("colocated", error_rate=0.02),
                                EndpointShape("offloaded", "offloaded", hit_fraction=0.7)],
                     stage_rates_rps=(5.0, 20.0), requests_per_stage=n, seed=seed)
    table, stages = synth_table(shape, run_id=name)
    cfg = {"suite": {"name": "exact", "seed": seed}, "slo": SLO,
           "gate": {"rules": RULES, "bootstrap_resamples": 200}}
    return write_run(tmp_path / name, table, run_meta(shape, stages, run_id=name, config=cfg))


def _in_memory(run: Path, metric: str, endpoint: str, cls: str) -> float:
    results = load_results(run)
    frame = M.request_frame(results.requests, stages=results.meta.stages, slo=SLO)
    rows = np.asarray(frame["endpoint"] == endpoint)
    if cls != "*":
        rows = rows & np.asarray(frame["request_class"] == cls)
    return M.statistic(frame[rows], metric)


def _rows(run: Path) -> int:
    return load_results(run).requests.num_rows


def test_exact_figures_equal_the_in_memory_ones_to_the_last_bit(tmp_path):
    run = _run(tmp_path, "r", 3)
    meta = load_results(run).meta
    wants = [(r["metric"], ep, r.get("request_class", "*")) for r in RULES
             for ep in ("colocated", "offloaded")]
    got = exact_figures([(run, meta.stages, meta.worker_clock_offsets_ns)], wants, slo=SLO,
                        batch_rows=97)  # many batches: the merge is what is tested
    for key in wants:
        want = _in_memory(run, *key)
        assert got[key] == want or (math.isnan(want) and math.isnan(got[key])), (key, got[key],
                                                                                 want)


def test_the_printed_figures_of_a_sampled_gate_are_exact(tmp_path):
    base, cur = _run(tmp_path, "base", 1), _run(tmp_path, "cur", 2)
    bound = _rows(cur) - 1  # the current run just above the bound
    assert _rows(base) > bound
    env = {**__import__("os").environ, gate.MAX_REQUESTS_ENV: str(bound)}
    p = subprocess.run([sys.executable, "-m", "kvbench", "gate", "--baseline", str(base),
                        "--current", str(cur), "--no-history"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stderr + p.stdout
    doc = json.loads((cur / "gate.json").read_text())
    lines = p.stdout.splitlines()
    checked = 0
    for rec in doc["rules"]:
        key = (rec["metric"], rec["endpoint"], rec["request_class"])
        note = rec["note"]
        assert "figures exact over all" in note and "seeded samples" in note, note
        assert f"of {_rows(cur):,}" in note
        want_c = _in_memory(cur, *key)
        assert rec["current"] == want_c, (key, rec["current"], want_c)
        line = next(x for x in lines if x.strip().split("  ", 1)[-1].startswith(
            f"{rec['metric']}[endpoint={rec['endpoint']},class={rec['request_class']}]"))
        if rec["kind"] == "relative":
            want_b = _in_memory(base, *key)
            assert rec["baseline"] == want_b, (key, rec["baseline"], want_b)
            assert f"{want_b:.4g} -> {want_c:.4g}" in line, line
        else:
            assert f"{rec['metric']} {want_c:.4g} " in line, line
        assert rec["low"] <= rec["high"]
        checked += 1
    assert checked == len(RULES) * 2


def test_the_bound_from_the_environment_is_checked(tmp_path, monkeypatch):
    from kvbench.core.errors import UserError

    monkeypatch.setenv(gate.MAX_REQUESTS_ENV, "lots")
    with pytest.raises(UserError, match="KVBENCH_GATE_MAX_REQUESTS"):
        gate.sample_bound()
    monkeypatch.setenv(gate.MAX_REQUESTS_ENV, "1234")
    assert gate.sample_bound() == 1234
    monkeypatch.delenv(gate.MAX_REQUESTS_ENV)
    assert gate.sample_bound() == gate.MAX_REQUESTS


def test_a_pooled_sampled_baseline_has_exact_pooled_figures(tmp_path):
    from kvbench.commands.gate import _pooled
    from kvbench.reports.measures.frame import concat

    a, b, c = (_run(tmp_path, x, s, n=300) for x, s in (("a", 1), ("b", 4), ("c", 2)))
    runs = [gate.load_bounded(p, max_requests=500) for p in (a, b)]
    pooled = _pooled(runs)
    cfg = GateConfig(rules=[GateRule(metric="ttft_p90", max_increase_pct=10),
                            GateRule(metric="throughput_rps", max_decrease_pct=10)],
                     bootstrap_resamples=100)
    got = gate.evaluate(pooled, gate.load_bounded(c, max_requests=500), cfg, slo=SLO)
    frames = [M.request_frame(load_results(p).requests, stages=load_results(p).meta.stages,
                              slo=SLO) for p in (a, b)]
    whole = concat(frames)
    for r in got:
        sub = whole[np.asarray(whole["endpoint"] == r.endpoint)]
        assert r.baseline == M.statistic(sub, r.metric), r
