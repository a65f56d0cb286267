"""The gate end to end: `kvbench run` against the built-in endpoint, then `kvbench gate`.

Three short seeded runs of one colocated emulator (chat, 40 -> 16 tokens, Poisson 60 req/s for
3 s: about 180 requests each): A, A again, and A with ``options = { slowdown = 1.2 }``. The
rules are the ones that are meaningful at that size: medians of TPOT and E2E (the emulator's
step clock sets them to within ~1%), the TTFT median with +20% (its A/A interval is about
+-7% wide at 180 requests, since a request waits a random part of a step), goodput on the
shared seeded schedule, and no errors.
"""

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.config import GateConfig, GateRule
from kvbench.core.store import load_results
from kvbench.reports.analysis import gate
from synthetic import RunShape, run_meta, synth_table, write_run

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "gate-e2e"
seed = 7
results_dir = "{results}"
workloads = ["chat"]
profile = "open"

[[endpoints]]
name = "emu"
kind = "builtin"
topology = "colocated"
options = {{ slowdown = {slowdown} }}

[workloads.chat]
kind = "chat"
requests = 600
prompt_tokens = {{ dist = "constant", mean = 40 }}
output_tokens = {{ dist = "constant", mean = 16 }}

[profiles.open]
pacing = "poisson"
stages = [ {{ rate_rps = 60.0, duration_s = 3 }} ]

[slo.chat]
ttft_ms = 500
tpot_ms = 50

[gate]
confidence = 0.95
rules = [
  {{ metric = "ttft_p50", class = "*", max_increase_pct = 20 }},
  {{ metric = "tpot_p50", class = "*", max_increase_pct = 10 }},
  {{ metric = "e2e_p50", class = "*", max_increase_pct = 10 }},
  {{ metric = "goodput_rps", class = "*", max_decrease_pct = 5 }},
  {{ metric = "error_rate", class = "*", max_value = 0.005 }},
]

[collect]
nvml = false
"""

RULES = 5


def _kvbench(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvbench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Results store with runs 'a', 'b' (same setup) and 'slow' (slowdown 1.2)."""
    root = tmp_path_factory.mktemp("gate-e2e")
    results = root / "results"
    for run_id, slowdown in (("a", 1.0), ("b", 1.0), ("slow", 1.2)):
        cfg = root / f"{run_id}.toml"
        cfg.write_text(CONFIG.format(results=results, slowdown=slowdown))
        p = _kvbench("run", "--config", str(cfg), "--run-id", run_id)
        assert p.returncode == 0, p.stderr + p.stdout
    return results


def _gate(results: Path, baseline: str, current: str, *extra):
    out = results.parent / f"gate-{current}-vs-{Path(baseline).name}"
    out.mkdir(exist_ok=True)
    p = _kvbench("gate", "--baseline", baseline, "--current", str(results / current),
                 "--results-dir", str(results), "--junit", str(out / "junit.xml"),
                 "--markdown", str(out / "summary.md"), *extra)
    doc = json.loads((results / current / "gate.json").read_text())
    return p, doc, out


@pytest.fixture(scope="module")
def aa(store):
    """A/A: run 'b' gated against run 'a' by directory (records 'b' as a pass)."""
    return _gate(store, str(store / "a"), "b")


@pytest.fixture(scope="module")
def slow(aa, store):
    """The slowed-down run gated against last-pass (records 'slow' as a fail)."""
    return _gate(store, "last-pass", "slow")


def _by_metric(doc):
    return {r["metric"]: r for r in doc["rules"]}


def test_runs_are_the_same_seeded_setup(store):
    a, b, slow = (load_results(store / r) for r in ("a", "b", "slow"))
    assert a.meta.counts["records_written"] >= 120
    # Same seed, same arrival schedule: the same number of requests in the stage.
    assert a.requests.num_rows == b.requests.num_rows == slow.requests.num_rows
    assert slow.meta.config["endpoints"][0]["options"]["slowdown"] == 1.2
    for r in (a, b, slow):
        assert set(r.requests.column("status").to_pylist()) == {"ok"}
        assert pc.min(r.requests.column("completion_tokens")).as_py() == 16


def test_aa_passes(aa, store):
    p, doc, out = aa
    assert p.returncode == 0, p.stdout + p.stderr
    assert doc["verdict"] == "pass", p.stdout
    by = _by_metric(doc)
    assert set(by) == {"ttft_p50", "tpot_p50", "e2e_p50", "goodput_rps", "error_rate"}
    assert all(r["verdict"] == "pass" for r in doc["rules"]), p.stdout
    for m in ("tpot_p50", "e2e_p50"):
        assert by[m]["low"] <= 1.0 + 0.03 and by[m]["high"] >= 1.0 - 0.03, by[m]
        assert by[m]["high"] - by[m]["low"] < 0.05  # the step clock makes these precise
    assert "kvbench gate: PASS" in p.stdout
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("tests") == str(RULES) and suite.get("failures") == "0"
    cases = suite.findall("testcase")
    assert len(cases) == RULES and not any(c.find("failure") is not None for c in cases)
    assert {c.get("name").split("[")[0] for c in cases} == set(by)
    md = (out / "summary.md").read_text()
    assert md.startswith("### kvbench gate: **PASS**")
    assert md.count("| PASS |") == RULES


def test_twenty_percent_slowdown_fails_against_last_pass(slow, store):
    p, doc, out = slow
    assert p.returncode == 1, p.stdout + p.stderr
    assert doc["verdict"] == "fail"
    # last-pass: 'b', the only run gated as a pass ('a' was never gated).
    assert Path(doc["baseline"]).resolve() == (store / "b").resolve()
    by = _by_metric(doc)
    for m in ("tpot_p50", "e2e_p50"):
        r = by[m]
        assert r["verdict"] == "fail", r["text"]
        assert 1.15 < r["low"] <= r["high"] < 1.25, r["text"]
    assert by["error_rate"]["verdict"] == "pass"
    # TTFT is 20% slower too, but its +20% allowance leaves the verdict to chance.
    assert by["ttft_p50"]["current"] > 1.05 * by["ttft_p50"]["baseline"], by["ttft_p50"]["text"]
    suite = ET.parse(out / "junit.xml").getroot()
    failed = {c.get("name").split("[")[0] for c in suite.findall("testcase")
              if c.find("failure") is not None}
    assert {"tpot_p50", "e2e_p50"} <= failed
    assert suite.get("failures") == str(len(failed))
    md = (out / "summary.md").read_text()
    assert md.startswith("### kvbench gate: **FAIL**") and "| FAIL | tpot_p50 |" in md


def test_last_pass_skips_a_newer_failing_run(slow, store):
    p, doc, _ = _gate(store, "last-pass", "a")
    assert p.returncode == 0, p.stdout + p.stderr
    assert Path(doc["baseline"]).resolve() == (store / "b").resolve()
    h = _kvbench("history", "--results-dir", str(store), "--suite", "gate-e2e")
    assert h.returncode == 0, h.stderr
    verdicts = {ln.split()[2]: ln.split()[4] for ln in h.stdout.splitlines()[1:]}
    assert verdicts == {"a": "pass", "b": "pass", "slow": "fail"}, h.stdout


def test_strict_inconclusive_and_data_errors(aa, store, tmp_path):
    # A rule on a class the runs do not have cannot be judged: not a pass, not a verdict, but
    # a data error (exit 3) with one sentence, with or without --strict.
    cfg = tmp_path / "bench.toml"
    cfg.write_text(CONFIG.format(results=store, slowdown=1.0).replace(
        'metric = "ttft_p50", class = "*"', 'metric = "ttft_p50", class = "agent"'))
    for strict in (["--strict"], []):
        p = _kvbench("gate", "--baseline", str(store / "a"), "--current", str(store / "b"),
                     "--config", str(cfg), "--no-history", *strict)
        assert p.returncode == 3, p.stdout + p.stderr
        assert p.stderr.count("\n") == 1 and "class 'agent'" in p.stderr, p.stderr
    p = _kvbench("gate", "--baseline", "no-such-run", "--current", str(store / "b"),
                 "--no-history")
    assert p.returncode == 3 and "no-such-run" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------- rates and arrival schedules

def _synthetic(tmp_path, name, suite_seed, keep=1.0):
    shape = RunShape(requests_per_stage=400, seed=1)
    table, stages = synth_table(shape, run_id=name)
    if keep < 1.0:  # drop every k-th request: fewer completions over the same interval
        k = round(1 / (1 - keep))
        table = table.filter(pa.array(np.arange(table.num_rows) % k != k // 2))
    cfg = {"suite": {"name": "synthetic", "seed": suite_seed}, "slo": {},
           "workloads": {"mix": {"kind": "mix"}}}
    return load_results(write_run(tmp_path / name, table, run_meta(shape, stages, name,
                                                                      config=cfg)))


def test_rates_carry_count_noise_only_when_the_schedules_differ(tmp_path):
    rules = GateConfig(rules=[GateRule(metric="throughput_rps", max_decrease_pct=5)],
                       bootstrap_resamples=400)
    base = _synthetic(tmp_path, "base", suite_seed=1)
    fewer_same = _synthetic(tmp_path, "same", suite_seed=1, keep=0.9)
    fewer_other = _synthetic(tmp_path, "other", suite_seed=2, keep=0.9)
    assert gate.same_schedule(base.meta, fewer_same.meta, "colocated")
    assert not gate.same_schedule(base.meta, fewer_other.meta, "colocated")
    # Same seeded schedule: 10% fewer requests in the same window is a real 10% drop.
    (r,) = gate.evaluate(base, fewer_same, rules, slo={})
    assert r.verdict == "fail" and r.high < 0.95
    # Another schedule: 400 vs 360 Poisson arrivals is within count noise (sd ~7% of the ratio).
    (r,) = gate.evaluate(base, fewer_other, rules, slo={})
    assert r.verdict == "inconclusive" and r.low < 0.85 < 0.95 < r.high, r.describe()
    assert "Poisson" in r.note


def test_a_killed_baseline_named_by_run_id_is_recovered(aa, store):
    """A baseline whose finalizer was killed (shards compacted, no run.json) named by its run
    id, not its directory, is recovered like a directory is."""
    killed = store / "killed-a"
    shutil.copytree(store / "a", killed)
    (killed / "run.json").unlink()
    p = _kvbench("gate", "--baseline", "killed-a", "--current", str(store / "b"),
                 "--results-dir", str(store), "--no-history")
    assert "recovered" in p.stderr, p.stderr
    assert p.returncode in (0, 2), p.stdout + p.stderr  # compared, not a data error
    assert load_results(killed).meta.interrupted
