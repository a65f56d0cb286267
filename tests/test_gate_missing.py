"""A rule with no data to judge never lets the gate exit 0, unless the user asked for that
(``--allow-missing`` or the rule's ``allow_missing``), and then every output says so."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pyarrow as pa
import pytest

from kvbench.config import GateConfig, GateRule
from kvbench.core.errors import DataError
from kvbench.core.store import load_results
from kvbench.reports.analysis import gate
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run


def _rules(**extra):
    return GateConfig(rules=[GateRule(metric="ttft_p50", max_increase_pct=10, **extra),
                             GateRule(metric="error_rate", max_value=0.5)],
                      bootstrap_resamples=200)


def _run(root, name, seed=1, drop=(), rules=None, classes=("chat", "rag")):
    shape = RunShape(endpoints=[EndpointShape("colocated")], requests_per_stage=150, seed=seed,
                     classes=classes)
    table, stages = synth_table(shape, run_id=name)
    for col in drop:  # a column dropped from the file: read back as nulls
        table = table.drop_columns([col])
    cfg = {"suite": {"name": "synthetic", "seed": seed}, "slo": {},
           "gate": (rules or _rules()).model_dump(by_alias=True)}
    return write_run(root / name, table, run_meta(shape, stages, run_id=name, config=cfg))


def _cli(tmp_path, base, cur, *extra):
    junit, md, js = tmp_path / "j.xml", tmp_path / "s.md", tmp_path / "v.json"
    p = subprocess.run([sys.executable, "-m", "kvbench", "gate", "--baseline", str(base),
                        "--current", str(cur), "--junit", str(junit), "--markdown", str(md),
                        "--json", str(js), "--no-history", *extra],
                       capture_output=True, text=True, timeout=180)
    return p, junit, md, js


DROPS = {"ttft and e2e columns dropped": ("ttft_ns", "e2e_ns", "chunk_offsets_ns",
                                          "chunk_tokens"),
         "ttft all null, no chunks": ("ttft_ns", "chunk_offsets_ns", "chunk_tokens")}


@pytest.mark.parametrize("case", list(DROPS))
def test_a_rule_without_data_is_exit_3_not_a_pass(tmp_path, case):
    base = _run(tmp_path, "base", seed=2)
    cur = _run(tmp_path, "cur", drop=DROPS[case])
    p, junit, md, _ = _cli(tmp_path, base, cur)
    assert p.returncode == 3, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "gate rule 0 (ttft_p50) has no data" in lines[0] and str(cur) in lines[0], lines[0]
    assert "--allow-missing" in lines[0]
    assert ET.parse(junit).getroot().get("errors") == "1"
    assert "ERROR" in md.read_text()
    # the baseline side without data is refused alike
    p, *_ = _cli(tmp_path, cur, base)
    assert p.returncode == 3 and "has no data" in p.stderr and str(cur) in p.stderr, p.stderr


@pytest.mark.parametrize("how", ["flag", "rule"])
def test_allowed_missing_data_is_said_in_every_output(tmp_path, how):
    rules = _rules(allow_missing=True) if how == "rule" else None
    base = _run(tmp_path, "base", seed=2, rules=rules)
    cur = _run(tmp_path, "cur", drop=DROPS["ttft all null, no chunks"], rules=rules)
    p, junit, md, js = _cli(tmp_path, base, cur, *(["--allow-missing"] if how == "flag" else []))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "NO DATA" in p.stdout and "1 of 2 checks had no data" in p.stdout, p.stdout
    root = ET.parse(junit).getroot()
    assert root.get("skipped") == "1" and root.get("errors") == "0"
    assert "no data" in root.find("testcase/skipped").get("message")
    assert "had no data" in root.find("properties/property").get("value")
    text = md.read_text()
    assert "NO DATA (allowed)" in text and "1 of 2 checks had no data" in text
    doc = json.loads(js.read_text())
    assert doc["missing"].startswith("1 of 2 checks had no data")
    assert [r["verdict"] for r in doc["rules"]] == ["missing", "pass"]


def test_a_class_one_run_lacks_can_be_allowed(tmp_path):
    base = _run(tmp_path, "base", classes=("rag",))
    cur = _run(tmp_path, "cur", seed=2)
    rules = GateConfig(rules=[GateRule(metric="ttft_p50", request_class="chat",
                                       max_increase_pct=10),
                              GateRule(metric="ttft_p50", request_class="rag",
                                       max_increase_pct=1000)], bootstrap_resamples=200)
    with pytest.raises(DataError, match="baseline run has no records"):
        gate.evaluate(load_results(base), load_results(cur), rules, slo={})
    out = gate.evaluate(load_results(base), load_results(cur), rules, slo={},
                        allow_missing=True)
    assert [r.verdict for r in out] == ["missing", "pass"]
    assert gate.overall(out) == "pass"
    assert "baseline run has no records" in out[0].note and "allow" in out[0].note
    assert gate.exit_code(gate.overall(out), strict=True) == 0


def test_a_straddling_interval_stays_inconclusive(tmp_path):
    # A/A: the same schedule, another seed; a tight limit the interval straddles
    base, cur = _run(tmp_path, "base", seed=2), _run(tmp_path, "cur", seed=3)
    rules = GateConfig(rules=[GateRule(metric="ttft_p50", max_increase_pct=0.0001)],
                       bootstrap_resamples=200)
    out = gate.evaluate(load_results(base), load_results(cur), rules, slo={})
    assert [r.verdict for r in out] == ["inconclusive"], out[0].describe()
    assert gate.exit_code("inconclusive") == 0 and gate.exit_code("inconclusive", True) == 2


def test_allow_missing_is_a_strict_boolean():
    with pytest.raises(Exception):
        GateRule(metric="ttft_p50", max_increase_pct=10, allow_missing="yes")


def test_the_first_nightly_seeds_last_pass_by_accepting_a_run(tmp_path):
    root = tmp_path / "results"
    first, second = _run(root, "night-1", seed=2), _run(root, "night-2", seed=3)

    def kv(*args):
        return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True,
                              text=True, timeout=180)

    # nothing to compare with yet: the sentence says how to seed it
    p = kv("gate", "--baseline", "last-pass", "--current", str(second), "--results-dir",
           str(root), "--no-history")
    assert p.returncode == 3 and "kvbench history --accept" in p.stderr, p.stderr
    p = kv("history", "--results-dir", str(root), "--accept", "night-1")
    assert p.returncode == 0 and "accepted as a baseline" in p.stdout, p.stdout + p.stderr
    p = kv("history", "--results-dir", str(root))
    assert "accepted" in p.stdout, p.stdout
    p = kv("gate", "--baseline", "last-pass", "--current", str(second), "--results-dir",
           str(root))
    assert p.returncode in (0, 1), p.stdout + p.stderr
    assert f"baseline {first.resolve()}" in p.stdout or f"baseline {first}" in p.stdout, p.stdout
    # a run with impossible records is not accepted
    bad = _run(root, "night-bad", seed=4)
    t = load_results(bad).requests
    import pyarrow.parquet as pq

    pq.write_table(pa.concat_tables([t, t]), bad / "requests.parquet")
    p = kv("history", "--results-dir", str(root), "--accept", str(bad))
    assert p.returncode == 3 and "repeated on the same worker" in p.stderr, p.stderr
