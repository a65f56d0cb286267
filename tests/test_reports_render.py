"""`kvbench report`: a self-contained HTML page opened in real headless Chromium, and Markdown."""

from __future__ import annotations

from pathlib import Path

import pytest

from browser import browser_or_skip, offline_page
from kvbench.cli import main
from synthetic import (T0_NS, EndpointShape, RunShape, engine_table, gpu_table,
                       run_meta, synth_table, write_run)

ROOT = Path(__file__).resolve().parents[1]
EVIL_MODEL = 'llama<script>window.__pwned = 1</script>'
EVIL_ENDPOINT = 'vendor</script><script>window.__pwned2 = 1</script>'
FIGURES = ("pareto", "cdf_ttft", "cdf_itl", "cdf_e2e", "latency_vs_load", "goodput_vs_load",
           "ttft_vs_prompt", "hit_ratio_time", "gpu_timelines", "errors_time")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("results") / "run-1"
    shape = RunShape(endpoints=[
        EndpointShape("colocated", model=EVIL_MODEL, gpu_hour_cost=2.0),
        EndpointShape("disaggregated", "disaggregated", ttft_base_ms=150, gpus=2,
                      gpu_hour_cost=2.0, error_rate=0.03),
        EndpointShape(EVIL_ENDPOINT, "offloaded", hit_fraction=0.1)],
        stage_rates_rps=(2.0, 6.0), requests_per_stage=150)
    table, stages = synth_table(shape, run_id="run-1")
    gpu = gpu_table(stages, [("colocated", "colocated"), ("disaggregated", "prefill"),
                             ("disaggregated", "decode")])
    eng = engine_table([(T0_NS + i * 10**9, "colocated", m, {}, v * i) for i in range(30)
                        for m, v in (("vllm:prefix_cache_queries_total", 500.0),
                                     ("vllm:prefix_cache_hits_total", 200.0))])
    meta = run_meta(shape, stages, run_id="run-1",
                    workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.6, "requests": 900}},
                    incomplete=[{"what": "gpu telemetry on host b", "why": "no NVML"}])
    write_run(d, table, meta, gpu=gpu, engine=eng)
    return d




def test_html_report_in_headless_chromium(run_dir, tmp_path):
    sync_api = browser_or_skip()
    out = tmp_path / "report.html"
    assert main(["report", str(run_dir), "-o", str(out)]) == 0
    html = out.read_text()
    assert html.count("Plotly.newPlot") == 1  # plotly.js inlined once, nothing fetched
    assert "<script src" not in html and "<link" not in html
    assert EVIL_MODEL not in html and EVIL_ENDPOINT not in html  # escaped everywhere
    errors, requests = [], []
    with offline_page(sync_api, out, errors, requests) as page:
        page.wait_for_function(
            f"document.querySelectorAll('div.plot .main-svg').length >= {len(FIGURES)}",
            timeout=20_000)
        rendered = page.evaluate(
            "Array.from(document.querySelectorAll('div.plot.js-plotly-plot'))"
            ".map(d => d.id)")
        assert rendered == [f"plot-{k}" for k in FIGURES]
        traces = page.evaluate("Array.from(document.querySelectorAll('div.plot'))"
                               ".map(d => d.data.length)")
        assert all(n >= 1 for n in traces)
        assert page.evaluate("window.__pwned === undefined && window.__pwned2 === undefined")
        assert EVIL_MODEL in page.inner_text("td.model >> nth=0")
        assert EVIL_ENDPOINT in page.inner_text("#summary thead")
        legend = page.evaluate("document.getElementById('plot-cdf_ttft').data"
                               ".map(t => t.name)")
        assert EVIL_ENDPOINT in legend
        assert page.locator(".finding").count() >= 2  # transfer tax, lost prefix hits
        assert page.locator("td.best").count() > 10
        art = ROOT / "test-artifacts"
        art.mkdir(exist_ok=True)
        page.screenshot(path=str(art / "report.png"), full_page=True)
    assert errors == []
    assert [u for u in requests if not u.startswith("file:")] == []
    assert (ROOT / "test-artifacts" / "report.png").stat().st_size > 50_000


def test_markdown_summary(run_dir, capsys):
    assert main(["report", str(run_dir), "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("## kvbench report")
    assert "| TTFT p99 (ms) |" in md and "★" in md
    assert "vendor\\<" in md and EVIL_ENDPOINT not in md
    assert "transfer_tax" in md and "gpu telemetry on host b" in md
    assert "Cost ranking" in md


def test_default_output_and_slo_config(run_dir, tmp_path, capsys):
    cfg = tmp_path / "bench.toml"
    cfg.write_text((ROOT / "bench.toml").read_text().replace("ttft_ms = 500", "ttft_ms = 1"))
    assert main(["report", str(run_dir), "--slo-config", str(cfg), "--format", "md",
                 "-o", str(tmp_path / "r.md")]) == 0
    strict = (tmp_path / "r.md").read_text()
    assert main(["report", str(run_dir), "--format", "md"]) == 0
    lenient = capsys.readouterr().out
    goodput = [line for line in strict.splitlines() if line.startswith("| goodput")][0]
    assert goodput != [line for line in lenient.splitlines() if line.startswith("| goodput")][0]


def test_bake_off_of_two_runs_labels_repeated_names(tmp_path, capsys):
    dirs = []
    # 5x slower latencies miss SLOs: a goodput gap beyond the runs' schedule noise
    for i, slow in enumerate((1.0, 5.0)):
        shape = RunShape(endpoints=[EndpointShape("vendor", slowdown=slow)], seed=i)
        table, stages = synth_table(shape, run_id=f"night-{i}")
        dirs.append(write_run(tmp_path / f"night-{i}", table,
                              run_meta(shape, stages, run_id=f"night-{i}")))
    assert main(["report", *map(str, dirs), "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert "vendor@night-0" in md and "vendor@night-1" in md
    assert "1. vendor@night-0" in md


def test_user_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not a results directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 3
    assert "no run.json" in capsys.readouterr().err


def test_capacity_ranking_compares_endpoints_on_the_same_workload_only():
    """Ranked within each workload; a rank says whether the search showed the one above it
    better (its pass above this one's failure, per GPU) or their brackets overlap."""
    from kvbench.reports.rendering.context import _ranked

    def row(ep, wl, cap, fail, gpus, passed=None):
        return {"endpoint": ep, "workload": wl, "capacity": cap, "fail": fail,
                "passed": cap if passed is None else passed,
                "per_gpu": None if cap is None else cap / gpus}

    rows = [row("a", "mix", 4.0, 5.1, 2), row("b", "mix", 8.0, 9.0, 1),
            row("a", "longdoc", 8.67, 9.9, 2), row("b", "longdoc", 2.6, 3.0, 1),
            row("c", "longdoc", None, None, 1), row("d", "mix", 1.7, None, 1)]
    got = [(r["workload"], r["endpoint"], r["rank"], r["apart"])
           for r in _ranked(rows, "per_gpu")]
    assert got == [("mix", "b", 1, None), ("mix", "a", 2, "yes"),
                   ("mix", "d", 3, "no: d's bracket overlaps a's"),  # d never failed
                   ("longdoc", "a", 1, None), ("longdoc", "b", 2, "yes")]
    # a pass per GPU of 4.33 below the other's failure at 5.1: not shown apart
    close = [row("a", "mix", 3.9, 5.1, 1), row("b", "mix", 8.67, 9.9, 2)]
    assert [r["apart"] for r in _ranked(close, "per_gpu")] == [
        None, "no: a's bracket overlaps b's"]
    # ranked on the capacity (the crossing inside the bracket), shown apart on what passed:
    # a's capacity of 5.5 lies above b's failure at 5.1, the rate a passed (5.0) does not
    near = [row("a", "mix", 5.5, 6.0, 1, passed=5.0), row("b", "mix", 4.8, 5.1, 1)]
    assert [(r["endpoint"], r["apart"]) for r in _ranked(near, "per_gpu")] == [
        ("a", None), ("b", "no: b's bracket overlaps a's")]


def test_gpu_legend_names_what_differs(run_dir):
    """One role per endpoint: the endpoint's name alone (not "colocated colocated"); an
    endpoint with several roles: each role beside its name."""
    from kvbench.reports.measures.data import load
    from kvbench.reports.rendering.context import build_context

    figs = {f["key"]: f for f in build_context(load([run_dir]))["figures"]}
    names = [t["name"] for t in figs["gpu_timelines"]["data"] if t.get("showlegend") is not False]
    assert sorted(names) == ["colocated", "disaggregated: decode", "disaggregated: prefill"]
