"""The capacity search end to end: kvbench run with a search profile against a built-in
endpoint small enough that its capacity follows from the model (2 sequences at a time, answers
of a fixed length: it serves at most 2 / service time requests per second), at half the
emulator's time scale so the probes are short. Asserts on the records' own (server-paced)
times and on run.json, never on how long the test took."""

import json

import numpy as np
import pytest

from kvbench.core.store import load_results
from kvbench.reports.analysis import capacity as C
from kvbench.reports.measures.data import load
from kvbench.reports.statistics.metrics import request_frame
from kvbench.reports.rendering.render import build_context, render_html
from kvbench_cli import run_config, tiny_chat_config

SEQS = 2
BUDGET_S = 30.0

CONFIG = tiny_chat_config("search", SEQS, f"""
[profiles.search]
pacing = "search"
search = {{ start_rps = 3.0, growth = 4.0, probe_s = 4, min_requests = 12, max_probe_s = 5, min_class_requests = 5, refine = 1, precision = 0.25, budget_s = {BUDGET_S}, settle_s = 3 }}
drain_s = 2

[profiles.ladder]
pacing = "poisson"
stages = [{{ rate_rps = 2.0, duration_s = 1 }}]
""", 250)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    return run_config(tmp_path_factory.mktemp("search"), CONFIG, "s1")


def test_every_probe_is_a_stage_with_its_search_role(searched):
    run_dir, out = searched
    meta = json.loads((run_dir / "run.json").read_text())
    probes = [s for s in meta["stages"] if s.get("search")]
    assert probes and len(probes) == len(meta["stages"])
    assert probes[0]["search"]["role"] == "ramp" and probes[0]["rate_rps"] == 3.0
    assert {p["search"]["role"].split(" ")[0] for p in probes} <= {"ramp", "refine", "bisect", "confirm"}
    res = load_results(run_dir)
    assert set(res.requests.column("stage").to_pylist()) <= {p["index"] for p in probes}
    assert "CAPACITY at SLO: tiny x chat" in out


def test_search_finds_the_capacity_the_model_predicts(searched):
    run_dir, _ = searched
    res = load_results(run_dir)
    slo = res.meta.config["slo"]
    f = request_frame(res.requests, stages=res.meta.stages, slo=slo)
    (cap,) = C.summarise(res.meta.stages, f, slo)
    assert cap.capacity_rps is not None and cap.fail_rps is not None, cap
    assert cap.capacity_rps < cap.fail_rps
    # the service time the endpoint logged at the lowest probe (no queue there)
    first = f[(f["stage"] == res.meta.stages[0].index) & f["ok"]]
    service_s = float(np.median(first["e2e_ms"] - first["server_queue_ms"])) / 1e3
    ceiling = SEQS / service_s  # no endpoint of 2 slots serves more than this
    assert 0.3 * ceiling <= cap.capacity_rps <= 1.1 * ceiling, (cap, ceiling)
    assert cap.breaks["class"] == "chat" and cap.breaks["missed"] == "TTFT"


def test_saturated_probe_is_cut_early_and_the_budget_holds(searched):
    run_dir, _ = searched
    meta = json.loads((run_dir / "run.json").read_text())
    probes = [s for s in meta["stages"] if s.get("search")]
    cut = [s for s in probes if s.get("partial") and s["search"]["verdict"] == "fail"]
    assert cut, [s["search"] for s in probes]
    for s in cut:  # stopped before its planned end, saying why
        assert s["duration_s"] < s["planned_duration_s"]
        assert "cut after" in s["search"]["why"]
    assert sum(s.get("planned_duration_s", s["duration_s"]) for s in probes) <= BUDGET_S


def test_report_has_the_capacity_section(searched):
    run_dir, _ = searched
    ctx = build_context(load([run_dir]), figures=False)
    (row,) = ctx["capacity"]["rows"]
    assert row["endpoint"] == "tiny" and row["capacity"] is not None
    assert ctx["capacity"]["probes"]
    html = render_html(ctx)
    assert 'id="capacity"' in html and "Capacity at SLO" in html and "breaks first" in html
