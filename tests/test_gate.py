"""The nightly gate: verdict logic on synthetic distributions, outputs, history, CLI errors."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kvbench.config import GateConfig, GateRule
from kvbench.core.store import load_results
from kvbench.reports.analysis import gate
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

RULES = GateConfig(rules=[
    GateRule(metric="ttft_p50", max_increase_pct=10),
    GateRule(metric="tpot_p50", max_increase_pct=10),
    GateRule(metric="error_rate", max_value=0.005),
], bootstrap_resamples=400)


def _run(tmp_path: Path, name: str, seed: int, slow: float = 1.0, n: int = 300,
         error_rate: float = 0.0, suite_cfg: dict | None = None) -> Path:
    ep = EndpointShape("colocated", slowdown=slow, error_rate=error_rate)
    shape = RunShape(endpoints=[ep], requests_per_stage=n, seed=seed)
    table, stages = synth_table(shape, run_id=name)
    cfg = suite_cfg or {"suite": {"name": "synthetic", "seed": seed}, "slo": {},
                        "gate": RULES.model_dump(by_alias=True)}
    meta = run_meta(shape, stages, run_id=name, config=cfg)
    return write_run(tmp_path / name, table, meta)


def _verdict(tmp_path, base_seed, cur_seed, slow=1.0, rules=RULES):
    b = load_results(_run(tmp_path, f"b{base_seed}", base_seed))
    c = load_results(_run(tmp_path, f"c{cur_seed}-{slow}", cur_seed, slow=slow))
    return gate.evaluate(b, c, rules, slo={})


def test_aa_passes_in_at_least_95_percent_of_seeded_repeats(tmp_path):
    verdicts = [gate.overall(_verdict(tmp_path, s, s + 1000)) for s in range(20)]
    assert verdicts.count("fail") == 0
    assert verdicts.count("pass") >= 19, verdicts


def test_twenty_percent_slowdown_fails(tmp_path):
    res = _verdict(tmp_path, 1, 2, slow=1.2)
    assert gate.overall(res) == "fail"
    failed = {r.metric for r in res if r.verdict == "fail"}
    assert {"ttft_p50", "tpot_p50"} <= failed


def test_change_smaller_than_noise_is_inconclusive_not_fail(tmp_path):
    # 9% slower against a 10% allowance: the interval straddles the limit.
    res = _verdict(tmp_path, 3, 4, slow=1.09)
    by = {r.metric: r.verdict for r in res}
    assert by["ttft_p50"] == "inconclusive" or by["tpot_p50"] == "inconclusive"
    assert "fail" not in by.values()


@settings(max_examples=30, deadline=None)
@given(lo=st.floats(0.5, 1.5), width=st.floats(0.0, 0.5), limit_pct=st.floats(0, 50))
def test_relative_verdict_follows_the_interval(lo, width, limit_pct):
    import numpy as np

    # Replicates whose ratio interval is [lo, lo + width] by construction.
    hi = lo + width
    limit = 1 + limit_pct / 100
    v = gate._interval(np.linspace(lo, hi, 1001), 0.95)
    assert v[0] >= lo - 1e-9 and v[1] <= hi + 1e-9
    verdict = "pass" if v[1] <= limit else "fail" if v[0] > limit else "inconclusive"
    if hi <= limit:
        assert verdict == "pass"
    if lo > limit:
        assert verdict == "fail"


def test_absolute_rule_on_errors(tmp_path):
    b = load_results(_run(tmp_path, "b", 5))
    c = load_results(_run(tmp_path, "c", 6, error_rate=0.2))
    res = gate.evaluate(b, c, RULES, slo={})
    assert {r.metric: r.verdict for r in res}["error_rate"] == "fail"


def test_junit_and_markdown(tmp_path):
    res = _verdict(tmp_path, 1, 2, slow=1.2)
    root = ET.fromstring(gate.junit_xml(res))
    assert int(root.get("tests")) == len(res) == len(root.findall("testcase"))
    assert int(root.get("failures")) >= 2
    md = gate.markdown(res, "base", "cur", 0.95)
    assert md.startswith("### kvbench gate: **FAIL**") and "ttft_p50" in md


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvbench", "gate", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_exit_codes_history_and_last_pass(tmp_path):
    store = tmp_path / "store"
    base = _run(store, "base", 11, n=1500)
    same = _run(store, "same", 12, n=1500)
    slow = _run(store, "slow", 13, slow=1.3, n=1500)
    junit = tmp_path / "gate.xml"
    p = _cli("--baseline", str(base), "--current", str(same), "--junit", str(junit),
             "--results-dir", str(store))
    assert p.returncode == 0, p.stdout + p.stderr
    assert ET.parse(junit).getroot().get("failures") == "0"
    p = _cli("--baseline", "last-pass", "--current", str(slow), "--results-dir", str(store))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "baseline " + str(same) in p.stdout  # the newest passing run
    assert json.loads((slow / "gate.json").read_text())["verdict"] == "fail"
    h = subprocess.run([sys.executable, "-m", "kvbench", "history", "--results-dir", str(store)],
                       capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "same" in h.stdout and "fail" in h.stdout


def test_cli_errors_are_one_sentence_exit_3(tmp_path):
    cur = _run(tmp_path, "cur", 1)
    p = _cli("--baseline", str(tmp_path / "missing"), "--current", str(cur))
    assert p.returncode == 3 and "Traceback" not in p.stderr and "missing" in p.stderr
    other = _run(tmp_path, "other", 2)
    meta = json.loads((other / "run.json").read_text())
    meta["schema_version"] = 99
    (other / "run.json").write_text(json.dumps(meta))
    p = _cli("--baseline", str(other), "--current", str(cur))
    assert p.returncode == 3 and "schema version 99" in p.stderr
    cfg = json.loads((cur / "run.json").read_text())
    cfg["config"]["gate"]["rules"] = [{"metric": "ttft_p42", "max_increase_pct": 5}]
    (cur / "run.json").write_text(json.dumps(cfg))
    p = _cli("--baseline", str(_run(tmp_path, "b2", 3)), "--current", str(cur))
    assert p.returncode == 3 and "ttft_p42" in p.stderr and "Traceback" not in p.stderr


def _scaled(table, factor, noise_sigma, seed):
    """The same requests with every latency scaled by ``factor`` and per-request noise."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    jitter = factor * rng.lognormal(0, noise_sigma, table.num_rows)
    cols = {}
    for name in ("ttft_ns", "e2e_ns"):
        v = table.column(name).to_numpy(zero_copy_only=False).astype(float)
        cols[name] = pa.array((v * jitter).astype("int64"))
    offs = table.column("chunk_offsets_ns").to_pylist()
    cols["chunk_offsets_ns"] = pa.array([[int(x * j) for x in o] if o else o
                                         for o, j in zip(offs, jitter)], pa.list_(pa.int64()))
    for name, arr in cols.items():
        table = table.set_column(table.schema.get_field_index(name), name, arr)
    return table


@pytest.mark.parametrize("factor, expected", [(1.0, "pass"), (1.2, "fail")])
def test_same_schedule_runs_are_compared_request_by_request(tmp_path, factor, expected):
    # A mixed-class run whose pooled TTFT spread is wide; replayed with 5% per-request noise.
    # Paired on the same requests, the interval is about 2.5x narrower than unpaired.
    shape = RunShape(endpoints=[EndpointShape("colocated")], requests_per_stage=300, seed=9)
    table, stages = synth_table(shape, run_id="b")
    cfg = {"suite": {"name": "synthetic", "seed": 9}, "slo": {},
           "gate": RULES.model_dump(by_alias=True)}
    b = write_run(tmp_path / "b", table, run_meta(shape, stages, run_id="b", config=cfg))
    c = write_run(tmp_path / "c", _scaled(table, factor, 0.05, 1),
                  run_meta(shape, stages, run_id="c", config=cfg))
    rules = GateConfig(rules=[GateRule(metric="ttft_p50", max_increase_pct=10),
                              GateRule(metric="e2e_p90", max_increase_pct=10)])
    res = gate.evaluate(load_results(b), load_results(c), rules, slo={})
    assert [r.verdict for r in res] == [expected, expected], [r.describe() for r in res]
    assert all("paired bootstrap" in r.note for r in res)
    assert all((r.high - r.low) / factor < 0.08 for r in res), [r.describe() for r in res]
