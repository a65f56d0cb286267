"""The gate at its edges: it never passes on nothing, and the change it prints and the
interval it judges come from the same requests."""

import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pyarrow as pa
import pytest

from kvbench.config import GateConfig, GateRule
from kvbench.core.errors import DataError
from kvbench.core.schema import REQUESTS
from kvbench.core.store import load_results
from kvbench.reports.analysis import gate
from kvbench.reports.statistics import metrics as M
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

RULES = GateConfig(rules=[GateRule(metric="ttft_p50", max_increase_pct=10),
                          GateRule(metric="error_rate", max_value=0.005)],
                   bootstrap_resamples=400)


def _cfg(seed: int) -> dict:
    return {"suite": {"name": "synthetic", "seed": seed}, "slo": {},
            "gate": RULES.model_dump(by_alias=True)}


def _run(root, name, seed=1, n=200, rows=None, classes=("chat", "rag")):
    shape = RunShape(endpoints=[EndpointShape("colocated")], requests_per_stage=n, seed=seed,
                     classes=classes)
    table, stages = synth_table(shape, run_id=name)
    if rows is not None:
        table = table.slice(0, rows)
    return write_run(root / name, table, run_meta(shape, stages, run_id=name,
                                                   config=_cfg(seed)))


def _gate_cli(tmp_path, baseline, current, *extra):
    junit, md = tmp_path / "junit.xml", tmp_path / "summary.md"
    p = subprocess.run([sys.executable, "-m", "kvbench", "gate", "--baseline", str(baseline),
                        "--current", str(current), "--junit", str(junit), "--markdown", str(md),
                        "--no-history", *extra], capture_output=True, text=True, timeout=120)
    return p, junit, md


@pytest.mark.parametrize("empty", ["current", "baseline"])
def test_a_run_without_records_is_not_a_pass(tmp_path, empty):
    runs = {"current": _run(tmp_path, "cur", rows=0 if empty == "current" else None),
            "baseline": _run(tmp_path, "base", seed=2,
                             rows=0 if empty == "baseline" else None)}
    assert load_results(runs[empty]).requests.num_rows == 0
    p, junit, md = _gate_cli(tmp_path, runs["baseline"], runs["current"], "--strict")
    assert p.returncode == 3, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no records" in lines[0] and str(runs[empty]) in lines[0]
    assert "PASS" not in p.stdout and "Traceback" not in p.stderr
    root = ET.parse(junit).getroot()
    assert (root.get("tests"), root.get("errors"), root.get("failures")) == ("1", "1", "0")
    assert "no records" in root.find("testcase/error").get("message")
    assert "ERROR" in md.read_text()


def test_a_rule_whose_class_one_run_lacks_is_not_judged(tmp_path):
    base = _run(tmp_path, "base", classes=("rag",))
    cur = _run(tmp_path, "cur", seed=2, classes=("chat", "rag"))
    rules = GateConfig(rules=[GateRule(metric="ttft_p50", request_class="chat",
                                       max_increase_pct=10)], bootstrap_resamples=200)
    with pytest.raises(DataError, match="baseline run has no records of endpoint 'colocated' "
                                        "and class 'chat'"):
        gate.evaluate(load_results(base), load_results(cur), rules, slo={})
    # the same class absent from the current run, for an absolute rule
    rules = GateConfig(rules=[GateRule(metric="error_rate", request_class="agent",
                                       max_value=0.01)])
    with pytest.raises(DataError, match="current run has no records"):
        gate.evaluate(load_results(base), load_results(cur), rules, slo={})


def test_no_check_evaluated_is_not_a_pass():
    with pytest.raises(DataError, match="not a pass"):
        gate.overall([])


def _with_extra_requests(table: pa.Table, n_extra: int, factor: float) -> pa.Table:
    """The table plus ``n_extra`` requests of new sessions, ``factor`` times slower: requests
    the baseline never sent, so they have no pair."""
    extra = table.slice(0, n_extra)
    cols = {name: extra.column(name) for name in REQUESTS.names}
    cols["session_id"] = pa.array([f"extra-{i}" for i in range(n_extra)])
    # new requests have ids of their own (one id twice on a worker is a damaged run)
    cols["request_id"] = pa.array([f"extra-{i}#0" for i in range(n_extra)])
    for name in ("ttft_ns", "e2e_ns"):
        v = extra.column(name).to_numpy(zero_copy_only=False).astype(float)
        cols[name] = pa.array((v * factor).astype(np.int64))
    return pa.concat_tables([table, pa.table(cols, schema=REQUESTS)])


def test_paired_change_and_interval_come_from_the_same_requests(tmp_path):
    # Same seeded schedule: the paired bootstrap applies. The current run also holds 300 slow
    # requests the baseline never sent. Over all requests the median moves by a third or more;
    # over the 300 pairs it does not move at all. Shown change and interval must agree.
    shape = RunShape(endpoints=[EndpointShape("colocated")], requests_per_stage=300, seed=5)
    table, stages = synth_table(shape, run_id="b")
    cfg = _cfg(5)
    b = write_run(tmp_path / "b", table, run_meta(shape, stages, run_id="b", config=cfg))
    c = write_run(tmp_path / "c", _with_extra_requests(table, 300, 6.0),
                  run_meta(shape, stages, run_id="c", config=cfg))
    rb, rc = load_results(b), load_results(c)
    rules = GateConfig(rules=[GateRule(metric="e2e_p50", max_increase_pct=10),
                              GateRule(metric="ttft_mean", max_increase_pct=10)],
                       bootstrap_resamples=400)
    for r in gate.evaluate(rb, rc, rules, slo={}):
        assert "paired bootstrap over 300 requests" in r.note, r.describe()
        fb, fc = (M.request_frame(x.requests, stages=x.meta.stages) for x in (rb, rc))
        paired = fc["session_id"].astype(str).str.startswith("extra-").to_numpy()
        # the values shown are the statistic over the paired requests ...
        assert r.baseline == pytest.approx(M.statistic(fb, r.metric))
        assert r.current == pytest.approx(M.statistic(fc[~paired], r.metric))
        assert M.statistic(fc, r.metric) > 1.3 * r.current  # (all requests would differ)
        # ... so the change shown lies inside its own interval
        assert r.low <= r.current / r.baseline <= r.high, r.describe()
        assert r.verdict == "pass", r.describe()


def test_invalid_recorded_gate_rules_are_one_line_naming_the_field(tmp_path):
    import json

    base, cur = _run(tmp_path, "base", seed=2), _run(tmp_path, "cur")
    meta = json.loads((cur / "run.json").read_text())
    meta["config"]["gate"]["rules"][0]["metric"] = ""
    (cur / "run.json").write_text(json.dumps(meta))
    p, junit, _ = _gate_cli(tmp_path, base, cur)
    assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "rules[0].metric" in lines[0] and "run.json" in lines[0], lines
    assert ET.parse(junit).getroot().get("errors") == "1"
