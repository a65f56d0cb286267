"""The report of a run too large to hold (reports.rendering.scale): its Summary computed out of
core equals the in-memory report's figure for figure on a small run (counts and exact
percentiles to the last digit, rates and means to float rounding, every printed cell the
same), and over the threshold nothing of the whole run is held but aggregates and a seeded
sample, which the report says."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from kvbench.reports.measures.data import load
from kvbench.reports.rendering import render as R
from kvbench.reports.rendering import scale
from kvbench.reports.rendering.context import build_context
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

pytest.importorskip("duckdb")

EXACT = ("requests", "cancelled at the stop (not errors)")  # and every percentile


def _run(tmp_path, offsets=None, **kw):
    shape = RunShape(endpoints=[EndpointShape("a", error_rate=0.1, cancel_rate=0.05,
                                              gpus=2, gpu_hour_cost=3.0),
                                EndpointShape("b", "disaggregated", hit_fraction=0.8)],
                     requests_per_stage=300, stage_rates_rps=(5.0, 10.0), max_chunks=30,
                     sessions_turns=2, **kw)
    table, stages = synth_table(shape)
    meta = run_meta(shape, stages)
    if offsets:  # every other request sent by a second worker, whose clock is off
        worker = np.where(np.arange(table.num_rows) % 2, "host:2", "host:1")
        table = table.set_column(table.schema.get_field_index("worker"), "worker",
                                 pa.array(worker, pa.string()))
        meta["worker_clock_offsets_ns"] = offsets
    return write_run(tmp_path / "run", table, meta), table.num_rows


def _summary(ctx) -> dict:
    t = [s for s in ctx["summaries"] if s["key"] == "stages"][0]
    return {r["label"]: r for r in t["rows"]}


@pytest.mark.parametrize("offsets", [None, {"host:2": 1_500_000_000}])
def test_the_out_of_core_summary_equals_the_in_memory_one(tmp_path, offsets):
    """``offsets``: a distributed run's worker clock offset, which moves its sends (and so
    its stages' windows) onto the master's clock on both paths."""
    run, n = _run(tmp_path, offsets)
    want = build_context(load([run]), figures=False)
    got, runs = R._scaled_context([run], None, None, False)
    assert got["scale"]["n"] == got["scale"]["m"] == n  # the sample is the whole run here
    assert got["n_requests"] == want["n_requests"] == n
    assert got["outcomes"] == want["outcomes"]
    assert got["cancelled"] == want["cancelled"] and want["cancelled"]
    w, g = _summary(want), _summary(got)
    assert list(w) == list(g)  # the same rows, in the same order
    for label, row in w.items():
        for cw, cg in zip(row["cells"], g[label]["cells"]):
            assert cg.text == cw.text, (label, cw.text, cg.text)  # every printed digit
            a, b = float(cw.value), float(cg.value)
            if math.isnan(a):
                assert math.isnan(b), label
            elif label in EXACT or " p" in label:  # counts and exact percentiles
                assert a == b, (label, a, b)
            else:  # a rate or mean: a sum in another order
                assert b == pytest.approx(a, rel=1e-12), label
            assert cg.ci == ""  # no bootstrap interval out of core
    # the per-stage table, out of core: every printed cell the same
    assert got["by_stage"]["keys"] == want["by_stage"]["keys"]
    assert len(got["by_stage"]["rows"]) == len(want["by_stage"]["rows"]) == 4
    for rw, rg in zip(want["by_stage"]["rows"], got["by_stage"]["rows"]):
        assert rg["keys"] == rw["keys"] and rg["requests"] == rw["requests"]
        assert [c.text for c in rg["cells"]] == [c.text for c in rw["cells"]], rw["keys"]
    # the sections built over the sample are the in-memory ones when it holds every request
    assert got["by_class"] == want["by_class"]
    assert got["errors"] == want["errors"]
    assert [r.run_id for r in runs] == [r["run_id"] for r in want["runs"]]


def test_over_the_threshold_a_sample_and_exact_counts(tmp_path, monkeypatch):
    run, n = _run(tmp_path)
    monkeypatch.setattr(scale, "SAMPLE", 400)  # the sample's size
    loaded = []
    import kvbench.reports.measures.data as data

    real = data.load

    def spy(paths, slo=None):
        loaded.extend(paths)
        return real(paths, slo=slo)

    monkeypatch.setattr(data, "load", spy)
    md = R.render([run], "md", max_requests=1000, history=0)
    assert loaded and all(p != run for p in loaded)  # never the whole run in memory
    assert f"{n:,} requests;" in md
    assert "seeded" in md and "uniform sample of" in md
    ctx, _ = R._scaled_context([run], None, None, True)
    notes = {f["key"]: f["note"] for f in ctx["figures"]}
    assert "sample of" in notes["pareto"] and "sample of" not in notes["latency_vs_load"]
    assert 200 < ctx["scale"]["m"] < 600 and ctx["scale"]["n"] == n
    assert _summary(ctx)["requests"]["cells"][0].value + _summary(ctx)["requests"][
        "cells"][1].value == n


def test_below_the_threshold_the_report_is_as_before(tmp_path):
    run, n = _run(tmp_path)
    md = R.render([run], "md", history=0)
    assert "uniform sample" not in md
    assert not scale.wanted([run])
    assert scale.wanted([run], n - 1)
