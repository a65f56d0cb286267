"""Requests cancelled at the stop are not errors: counted apart, left out of error rate, SLO
attainment's denominator, throughput and latency, shown as "N cancelled at the stop", and
named as the reason the records and the engine's counters disagree. Errors get a breakdown by
status in both report formats and a diagnosis with the dominant error."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.config import GateConfig, GateRule
from kvbench.core.store import load_results
from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.analysis import gate
from kvbench.reports.statistics import metrics as M
from kvbench.reports.measures.data import load
from kvbench.reports.analysis.diagnose import diagnose
from kvbench.reports.rendering.render import build_context, render_html, render_md
from synthetic import T0_NS, EndpointShape, RunShape, engine_table, run_meta, synth_table, write_run

SLO = {"chat": {"ttft_ms": 500, "tpot_ms": 50}, "rag": {"ttft_ms": 1000, "tpot_ms": 50}}


def _table(cancel_rate=0.1, error_rate=0.0, n=400, seed=4):
    shape = RunShape(endpoints=[EndpointShape("emu", cancel_rate=cancel_rate,
                                              error_rate=error_rate)],
                     requests_per_stage=n, seed=seed, classes=("chat", "rag"))
    return shape, *synth_table(shape)


def test_cancelled_requests_count_in_no_rate_and_no_latency():
    _, table, stages = _table(cancel_rate=0.1, error_rate=0.05)
    status = table.column("status").to_pylist()
    n_cut, n_err = status.count("cancelled"), status.count("http_error")
    assert n_cut > 20 and n_err > 5
    f = M.request_frame(table, stages=stages, slo=SLO)
    kept = table.filter(pc.not_equal(table.column("status"), "cancelled"))
    g = M.request_frame(kept, stages=stages, slo=SLO)  # the same run without them
    n = table.num_rows
    assert M.outcomes(f) == {"requests": n, "ok": n - n_cut - n_err, "errors": n_err,
                             "cancelled": n_cut}
    assert M.statistic(f, "error_rate") == pytest.approx(n_err / (n - n_cut))
    assert M.statistic(f, "slo_attainment") == pytest.approx(
        f["slo_met"].sum() / (n - n_cut))
    assert M.statistic(f, "throughput_rps") == pytest.approx((n - n_cut) / M.achieved_s(f))
    # offered counts every scheduled request, cancelled ones too
    assert M.statistic(f, "offered_rps") == pytest.approx(n / M.offered_s(f))
    for name in M.METRIC_INFO:  # every metric: as if the cancelled requests were not there
        if name.startswith("lateness_") or name == "offered_rps":
            continue  # the generator's own delay: every request sent, cancelled ones too
        a, b = M.statistic(f, name), M.statistic(g, name)
        if M.METRIC_INFO[name].unit in ("req/s", "tok/s"):
            # the same counts; the achieved interval starts at the stage's first send, which
            # may be a request later cancelled
            a, b = a * M.achieved_s(f), b * M.achieved_s(g)
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b), name
    assert M.statistic(f, "lateness_mean") == pytest.approx(
        np.mean((table.column("t_sent").to_numpy() - table.column("t_scheduled").to_numpy())
                / 1e6))
    for name in ("error_rate", "slo_attainment", "ttft_p50"):
        ca, cb = M.bootstrap(f, name, 200), M.bootstrap(g, name, 200)
        assert ca.low == pytest.approx(cb.low) and ca.high == pytest.approx(cb.high), name


def test_only_cancelled_requests_have_no_error_rate():
    _, table, stages = _table(cancel_rate=1.0, n=20)
    f = M.request_frame(table, stages=stages)
    assert math.isnan(M.statistic(f, "error_rate"))
    assert math.isnan(M.bootstrap(f, "error_rate", 50).low)


def test_the_default_gate_passes_a_flawless_run_with_cancellations(tmp_path):
    # issue 11: 8 of 312 requests cancelled at the stop failed error_rate <= 0.005
    shape, table, stages = _table(cancel_rate=0.04, n=312)
    assert table.column("status").to_pylist().count("cancelled") >= 5
    run = write_run(tmp_path / "r", table, run_meta(shape, stages, run_id="r"))
    res = load_results(run)
    rules = GateConfig(rules=[GateRule(metric="error_rate", max_value=0.005)])
    [r] = gate.evaluate(res, res, rules, slo={})
    assert r.current == 0.0 and r.verdict == "pass", r.describe()


def _run_with_engine(tmp_path, cancel_rate=0.1, error_rate=0.0):
    shape, table, stages = _table(cancel_rate=cancel_rate, error_rate=error_rate)
    status = np.asarray(table.column("status").to_pylist(), object)
    prompt = table.column("prompt_tokens_client").to_numpy()
    cut = status == "cancelled"
    # the server counted every prompt token it was sent, the cancelled requests' included
    total = float(prompt.sum())
    samples = [(T0_NS, "emu", "vllm:prompt_tokens_total", {}, 0.0),
               (T0_NS + 10**9, "emu", "vllm:prompt_tokens_total", {}, total)]
    run = write_run(tmp_path / "run", table, run_meta(shape, stages), engine=engine_table(samples))
    return run, int(cut.sum()), float(prompt[~cut].sum()), total


def test_engine_comparison_names_the_cancelled_requests(tmp_path):
    run, n_cut, finished_prompt, total = _run_with_engine(tmp_path)
    d = load([run])
    [row] = E.comparison(d.engine, d.frame)
    assert (row["endpoint"], row["quantity"]) == ("emu", "prompt tokens")
    assert row["records"] == finished_prompt and row["engine"] == total
    assert row["cancelled"] == n_cut
    assert row["note"] == (f"{n_cut} requests cancelled at the stop: the server counted their "
                           "tokens, the client could not")
    ctx = build_context(d)
    for text in (render_md(ctx), render_html(ctx)):
        assert f"{n_cut} cancelled at the stop" in text
        assert "the server counted their tokens, the client could not" in text
    # without cancellations the records agree with the counters and no note is given
    run, _, _, _ = _run_with_engine(tmp_path / "none", cancel_rate=0.0)
    d = load([run])
    [row] = E.comparison(d.engine, d.frame)
    assert row["records"] == row["engine"] and row["note"] == ""
    assert "cancelled at the stop" not in render_md(build_context(d)).split("## ")[1].split(
        "### ")[0].replace("cancelled at the stop: a request", "")


def test_markdown_has_the_error_breakdown_and_the_html_its_share(tmp_path):
    shape, table, stages = _table(cancel_rate=0.05, error_rate=0.08)
    # a second kind of error, rarer: the breakdown lists both statuses
    status = np.asarray(table.column("status").to_pylist(), object)
    err = np.asarray(table.column("error").to_pylist(), object)
    ok_rows = np.flatnonzero(status == "ok")[:6]
    status[ok_rows], err[ok_rows] = "timeout", "no byte for 600 s"
    table = table.set_column(table.schema.get_field_index("status"), "status",
                             pa.array(status, pa.string()))
    table = table.set_column(table.schema.get_field_index("error"), "error",
                             pa.array(err, pa.string()))
    run = write_run(tmp_path / "r", table, run_meta(shape, stages))
    ctx = build_context(load([run]))
    md, html = render_md(ctx), render_html(ctx)
    n503 = int((status == "http_error").sum())
    finished = int((status != "cancelled").sum())
    assert "### Errors by status" in md
    row = next(x for x in md.splitlines() if x.startswith("| emu | http\\_error |"))
    assert f"| {n503} | {100 * n503 / finished:.1f}% | 503 Service Unavailable | {n503} |" in row
    assert any(x.startswith("| emu | timeout | 6 |") for x in md.splitlines())
    assert not any("| cancelled |" in x for x in md.splitlines())  # not an error
    assert "Errors by status" in html and "503 Service Unavailable" in html


def test_diagnosis_names_the_dominant_error(tmp_path):
    shape, table, stages = _table(cancel_rate=0.05, error_rate=0.1)
    run = write_run(tmp_path / "r", table, run_meta(shape, stages))
    d = load([run])
    [x] = [x for x in diagnose(d) if x.rule == "errors"]
    status = table.column("status").to_pylist()
    n_err, n_cut = status.count("http_error"), status.count("cancelled")
    assert x.numbers["errors"] == n_err
    assert x.numbers["error_rate"] == pytest.approx(n_err / (len(status) - n_cut))
    assert (x.numbers["status"], x.numbers["error"]) == ("http_error", "503 Service Unavailable")
    assert x.numbers["error_count"] == x.numbers["status_count"] == n_err
    assert "http_error 503" in x.title and x.severity == "critical"
    assert "429 / 503" in x.cause
    assert "errors" in render_md(build_context(d))
    # cancellations alone are not errors: no finding
    shape, table, stages = _table(cancel_rate=0.3)
    d = load([write_run(tmp_path / "c", table, run_meta(shape, stages))])
    assert not [x for x in diagnose(d) if x.rule == "errors"]
