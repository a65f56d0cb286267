"""Per-GPU throughput, cost per million output tokens and the latency-throughput Pareto
frontier (reports/pareto.py), and the Pareto plot in headless Chromium."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from browser import browser_or_skip, offline_page
from kvbench.cli import main
from kvbench.core.contract import EndpointEntry
from kvbench.reports.analysis import pareto as P
from kvbench.reports.measures.data import load
from kvbench.reports.rendering.render import build_context
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

ROOT = Path(__file__).resolve().parents[1]


def _frame(rows: list[tuple]) -> pd.DataFrame:
    """(endpoint, stage, ok, completion_tokens, tpot_ms, achieved_s of the stage) rows."""
    f = pd.DataFrame(rows, columns=["endpoint", "stage", "ok", "completion_tokens", "tpot_ms",
                                    "stage_achieved_s"])
    f["workload"] = "mix"
    f["stage_key"] = [hash((e, s)) % 10**6 for e, s in zip(f["endpoint"], f["stage"])]
    return f


def test_cost_and_per_gpu_by_hand():
    f = _frame([
        # stage 0 of "pd": 100 + 200 + 300 output tokens of successful requests over 10 s;
        # the failed request's 50 tokens do not count
        ("pd", 0, True, 100.0, 20.0, 10.0), ("pd", 0, True, 200.0, 25.0, 10.0),
        ("pd", 0, True, 300.0, 50.0, 10.0), ("pd", 0, False, 50.0, np.nan, 10.0),
        # stage 1: 1,200 tokens over 5 s
        ("pd", 1, True, 1200.0, 100.0, 5.0),
    ])
    eps = {"pd": EndpointEntry(name="pd", gpus=2, gpu_hour_cost=3.0, kind="builtin")}
    pts = P.stage_points(f, eps)
    s0, s1 = pts.iloc[0], pts.iloc[1]
    assert s0["output_tps"] == pytest.approx(60.0)  # 600 tokens / 10 s
    assert s0["tps_per_gpu"] == pytest.approx(30.0)
    # 2 GPUs x $3/h = $6/h = 1/600 $/s; 1e6 tokens at 60 tok/s take 16,666.7 s: $27.78
    assert s0["cost_per_m"] == pytest.approx(2 * 3.0 / 3600 / 60 * 1e6)
    assert s0["cost_per_m"] == pytest.approx(27.7777778)
    assert s0["per_user_tps"] == pytest.approx(40.0)  # median of 50, 40, 20 tok/s
    assert s0["example_price"]
    assert s1["output_tps"] == pytest.approx(240.0) and s1["cost_per_m"] == pytest.approx(
        6.9444444)
    # the endpoint: 1,800 tokens over 15 s of achieved intervals = 120 tok/s on 2 GPUs
    whole = P.endpoint_figures(f, eps["pd"])
    assert whole["tps_per_gpu"] == pytest.approx(60.0)
    assert whole["cost_per_m"] == pytest.approx(6.0 / 3600 / 120 * 1e6)
    # no price, no cost; no GPU count recorded: counted as 1 and said so
    bare = P.endpoint_figures(f, EndpointEntry(name="pd", kind="openai"))
    assert math.isnan(bare["cost_per_m"]) and bare["tps_per_gpu"] == pytest.approx(120.0)
    assert not bare["gpus_known"] and not bare["example_price"]


def test_report_figures_on_synthetic_records(tmp_path):
    """The report's per-GPU and cost figures against a count made from the raw records."""
    shape = RunShape(endpoints=[
        EndpointShape("colocated", gpus=2, gpu_hour_cost=4.0),
        EndpointShape("disaggregated", "disaggregated", ttft_base_ms=150, gpus=2,
                      gpu_hour_cost=4.0, error_rate=0.05),
        EndpointShape("vendor", gpus=8, gpu_hour_cost=2.5, kind="openai", itl_ms=30.0)],
        stage_rates_rps=(2.0, 5.0), requests_per_stage=80)
    table, stages = synth_table(shape, run_id="r")
    d = write_run(tmp_path / "r", table, run_meta(shape, stages, run_id="r"))
    ctx = build_context(load([d]), figures=False)
    raw = table
    rows = {(r["endpoint"], r["stage"]): r for r in ctx["per_gpu"]["rows"]}
    for ep in shape.endpoints:
        for si in range(2):
            t = raw.filter(pc.and_(pc.equal(raw["endpoint"], ep.name),
                                   pc.equal(raw["stage"], si)))
            ok = np.asarray(t["status"].to_pylist(), dtype=object) == "ok"
            tok = np.asarray(t["completion_tokens"].to_pylist(), dtype=float)[ok].sum()
            sent = np.asarray(t["t_sent"].to_pylist(), dtype=float)
            end = sent + np.asarray(t["e2e_ns"].to_pylist(), dtype=float)
            span = (np.nanmax(end) - sent.min()) / 1e9  # first send to last completion
            tps = tok / span
            r = rows[(ep.name, si + 1)]  # the table numbers stages as people read them
            assert float(r["output_tps"].replace(",", "")) == pytest.approx(tps, rel=5e-3)
            assert float(r["tps_per_gpu"].replace(",", "")) == pytest.approx(
                tps / ep.gpus, rel=5e-3)
            cost = ep.gpus * ep.gpu_hour_cost / 3600 / tps * 1e6
            assert float(r["cost_per_m"]) == pytest.approx(cost, rel=5e-3)
            assert r["example_price"] == (ep.kind == "builtin")
    summary = {row["label"]: row for row in ctx["summary"]}
    assert "cost per million output tokens (example prices)" in summary
    assert "output tokens/s per GPU" in summary
    assert ctx["per_gpu"]["example_price"] and ctx["per_gpu"]["unknown_gpus"] == []
    for ep in shape.endpoints:  # one knee per endpoint; the frontier holds the best per GPU
        marks = [r["pareto"] for r in ctx["per_gpu"]["rows"] if r["endpoint"] == ep.name]
        assert sum("knee" in m for m in marks) == 1
    best = max(ctx["per_gpu"]["rows"], key=lambda r: float(r["tps_per_gpu"].replace(",", "")))
    assert best["pareto"].startswith("frontier")
    assert {"GPUs", "per GPU", "$ / M output tokens", "per-user tokens/s", "knee",
            "Pareto frontier"} <= set(ctx["definitions"])


def _dominates(a, b) -> bool:
    return a[0] >= b[0] and a[1] >= b[1] and (a[0] > b[0] or a[1] > b[1])


coord = st.one_of(st.floats(0, 1e4, allow_nan=False), st.sampled_from([0.0, 1.0, 2.0]),
                  st.just(math.nan))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(coord, coord), max_size=30))
def test_frontier_is_the_non_dominated_set(points):
    x = [p[0] for p in points]
    y = [p[1] for p in points]
    front = P.frontier(x, y)
    finite = [i for i, p in enumerate(points) if not (math.isnan(p[0]) or math.isnan(p[1]))]
    want = [i for i in finite
            if not any(_dominates(points[j], points[i]) for j in finite)]
    assert sorted(front.tolist()) == sorted(want)
    assert list(np.asarray(x)[front]) == sorted(np.asarray(x)[front])  # by increasing x
    if finite:
        # the best point of each axis is on it
        best_x = max(points[i][0] for i in finite)
        best_y = max(points[i][1] for i in finite)
        assert any(points[i][0] == best_x for i in front)
        assert any(points[i][1] == best_y for i in front)
        k = P.knee(x, y)
        assert k in set(front.tolist())
        top = max(points[i][1] for i in front)
        assert points[k][1] >= P.KNEE_FRACTION * top
        assert not any(points[i][0] > points[k][0] and points[i][1] >= P.KNEE_FRACTION * top
                       for i in front)
    else:
        assert P.knee(x, y) is None


def test_knee_on_a_saturating_curve():
    # more load: throughput per GPU up, per-user speed down, then throughput flat
    x = [100, 400, 700, 900, 950, 960]
    y = [60, 58, 52, 45, 30, 20]
    assert P.frontier(x, y).tolist() == [0, 1, 2, 3, 4, 5]
    assert P.knee(x, y) == 2  # 52 >= 0.8 x 60 = 48 > 45
    # an overloaded stage that lost throughput too is dominated, never the knee
    assert P.frontier(x + [500], y + [25]).tolist() == [0, 1, 2, 3, 4, 5]




def test_pareto_plot_in_headless_chromium(tmp_path):
    sync_api = browser_or_skip()
    shape = RunShape(endpoints=[
        EndpointShape("colocated", gpus=2, gpu_hour_cost=4.0),
        EndpointShape("disaggregated", "disaggregated", ttft_base_ms=150, gpus=2,
                      gpu_hour_cost=4.0, itl_ms=15.0)],
        stage_rates_rps=(1.0, 3.0, 6.0), requests_per_stage=40)
    table, stages = synth_table(shape, run_id="p")
    d = write_run(tmp_path / "p", table, run_meta(shape, stages, run_id="p"))
    out = tmp_path / "report.html"
    assert main(["report", str(d), "-o", str(out)]) == 0
    html = out.read_text()
    assert "<script src" not in html and "example price" in html
    errors, requests = [], []
    with offline_page(sync_api, out, errors, requests) as page:
        page.wait_for_function("document.querySelector('#plot-pareto .main-svg') !== null",
                               timeout=20_000)
        names = page.evaluate("document.getElementById('plot-pareto').data"
                              ".map(t => t.name)")
        assert names == ["colocated", "colocated knee", "disaggregated",
                         "disaggregated knee", "Pareto frontier (all endpoints)"]
        n_points = page.evaluate("document.getElementById('plot-pareto').data[0].x.length")
        assert n_points == 3  # one point per stage
        assert page.locator("#per-gpu-table tbody tr").count() == 6
        assert page.locator("#plot-pareto .scatterlayer .trace").count() == 5
        art = ROOT / "test-artifacts"
        art.mkdir(exist_ok=True)
        page.locator("#plot-pareto").screenshot(path=str(art / "pareto.png"))
    assert errors == []
    assert [u for u in requests if not u.startswith("file:")] == []
    assert (ROOT / "test-artifacts" / "pareto.png").stat().st_size > 10_000
