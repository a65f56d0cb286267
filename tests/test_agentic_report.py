"""The report's agentic section and the latency from the intended send time.

A synthetic run whose sessions are the conversations (and sub-agents) of a small agentic trace
written here: the section's per-session hit ratios, theoretical ratios and fan-out figures are
recomputed in the test from the records and the trace by hand; a gate rule on
``ttft_intended_p99`` fails when lateness is injected while ``ttft_p99`` does not move."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvbench.config import GateConfig, GateRule
from kvbench.core.schema import REQUESTS
from kvbench.core.store import load_results
from kvbench.reports.analysis import gate
from kvbench.reports.measures import definitions as D
from kvbench.reports.measures.data import load
from kvbench.reports.rendering.context import build_context
from kvbench.reports.rendering.render import render
from kvbench.reports.statistics import metrics as M
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

EPOCH = 1_780_000_000 * 10**9
CONVERSATIONS = 15  # each: a main session of 4 requests and one sub-agent of 4


def _conversation(j: int) -> dict:
    a = [j * 100 + i for i in range(1, 6)]
    b = [j * 100 + 50 + i for i in range(1, 4)]

    def req(t, ids):
        return {"t": t, "type": "s", "in": 4 * len(ids), "out": 2, "hash_ids": ids}

    return {"id": f"c{j}", "block_size": 4, "tool_tokens": 0, "system_tokens": 0, "requests": [
        req(0, a[:2]), req(1, a[:3]),
        {"t": 2, "type": "subagent", "tool_tokens": 0, "system_tokens": 0, "duration_ms": 3000,
         "requests": [req(2, [a[0], b[0]]), req(3, [a[0], *b[:2]]), req(4, [a[0], *b]),
                      req(5, [j * 100 + 99])]},
        req(6, a[:4]), req(7, a[:5])]}


# by hand: main 0/2 + 2/3 + 3/4 + 4/5; the sub-agent inherits a[0..2] at its spawn:
# 1/2 + 2/3 + 3/4 + 0/1
THEORY_MAIN, THEORY_SUB = 9 / 14, 6 / 10


def _agentic_run(tmp_path: Path, lateness_ms: float = 1e-4) -> tuple[Path, pa.Table]:
    trace = tmp_path / "trace"
    trace.mkdir()
    for j in range(CONVERSATIONS):
        (trace / f"c{j}.json").write_text(json.dumps(_conversation(j)))
    shape = RunShape(endpoints=[EndpointShape("ep")], requests_per_stage=CONVERSATIONS * 8,
                     sessions_turns=4, workload="agent", classes=("agent",),
                     lateness_ms=lateness_ms, seed=7)
    table, stages = synth_table(shape)
    n = table.num_rows
    k = np.arange(n) // 4  # the synthetic session index: even a main session, odd its sub-agent
    j = k // 2
    sub = k % 2 == 1
    sid = np.where(sub, np.char.add(np.char.add("agent-c", j.astype(str)), "-s0"),
                   np.char.add("agent-c", j.astype(str))).astype(object)
    parent = np.where(sub, np.char.add("agent-c", j.astype(str)), "").astype(object)
    cols = {c: table.column(c) for c in table.column_names}
    cols["session_id"] = pa.array(sid, pa.string())
    cols["parent_session_id"] = pa.array(parent, pa.string())
    cols["subagent_index"] = pa.array(np.where(sub, 0, -1).astype(np.int32))
    table = pa.table(cols, schema=REQUESTS)
    cfg = {"suite": {"name": "synthetic"}, "slo": {"agent": {"ttft_ms": 1500}},
           "workloads": {"agent": {"kind": "trace", "format": "agentic", "path": str(trace)}}}
    run = write_run(tmp_path / "run", table, run_meta(shape, stages, config=cfg))
    return run, table


def _by_session(table: pa.Table) -> dict[str, tuple[float, float]]:
    """{session: (cached, prompt)} over successful requests reporting both, plain Python."""
    out: dict[str, list[float]] = {}
    for r in table.select(["session_id", "status", "cached_tokens", "prompt_tokens"]).to_pylist():
        if r["status"] == "ok" and None not in (r["cached_tokens"], r["prompt_tokens"]):
            c = out.setdefault(r["session_id"], [0.0, 0.0])
            c[0] += r["cached_tokens"]
            c[1] += r["prompt_tokens"]
    return {s: (c, p) for s, (c, p) in out.items()}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def test_agentic_section_shows_per_session_ratios_theory_and_fan_out(tmp_path):
    run, table = _agentic_run(tmp_path)
    sessions = _by_session(table)
    ratios = np.array([c / p for c, p in sessions.values() if p > 0])
    want = {q: float(np.quantile(ratios, q)) for q in (0.1, 0.5, 0.9)}
    theory = (CONVERSATIONS * 9 + CONVERSATIONS * 6) / (CONVERSATIONS * 14 + CONVERSATIONS * 10)

    ctx = build_context(load([run]), figures=False)
    sec = ctx["agentic"]
    assert sec is not None and sec["sessions"] == 2 * CONVERSATIONS
    assert sec["multi_turn"] == 2 * CONVERSATIONS and sec["has_theory"]
    (row,) = sec["endpoints"]
    for q, key in ((0.1, "p10"), (0.5, "p50"), (0.9, "p90")):
        assert row[key] == pytest.approx(want[q], rel=1e-12)
    assert row["theoretical"] == pytest.approx(theory, rel=1e-12)
    assert row["theoretical_p50"] == pytest.approx(
        float(np.quantile([THEORY_MAIN] * CONVERSATIONS + [THEORY_SUB] * CONVERSATIONS, 0.5)))
    worst = min(sessions, key=lambda s: sessions[s][0] / sessions[s][1])
    assert sec["worst"][0]["session_id"] == worst
    want_theory_worst = THEORY_SUB if worst.endswith("-s0") else THEORY_MAIN
    assert sec["worst"][0]["theoretical_text"] == _pct(want_theory_worst)

    # the fan-out: TTFT of the sub-agents' requests against their parents'
    t = table.to_pydict()
    ttft = {True: [], False: []}
    for s, st_, ns in zip(t["session_id"], t["status"], t["ttft_ns"]):
        if st_ == "ok" and ns is not None:
            ttft[s.endswith("-s0")].append(ns / 1e6)
    (fo,) = sec["fan_out"]
    assert fo["sub_requests"] == fo["parent_requests"] == 4 * CONVERSATIONS
    assert fo["sub_p50"] == pytest.approx(float(np.quantile(ttft[True], 0.5)), rel=1e-12)
    assert fo["parent_p99"] == pytest.approx(float(np.quantile(ttft[False], 0.99)), rel=1e-12)

    # sent on time: the report says the intended and actual send coincide
    (note,) = ctx["intended_note"]["endpoints"]
    assert note["on_time"]

    md = render([run], "md", history=0)
    part = md[md.index("### Agentic sessions"):]
    assert f"| ep | {2 * CONVERSATIONS} | {2 * CONVERSATIONS} | {_pct(want[0.1])} | " \
           f"{_pct(want[0.5])} | {_pct(want[0.9])} |" in part
    assert _pct(theory) in part and "Fan-out" in part
    assert "Sent on time (client lateness p99 at most 1 ms): ep. There the intended and the " \
           "actual send coincide" in md
    html = render([run], "html", history=0)
    assert 'id="agentic"' in html and _pct(want[0.5]) in html
    assert "TTFT from intended p99" in part  # TTFT against context length shows it per bucket


def test_a_run_without_multi_request_sessions_has_no_section(tmp_path):
    shape = RunShape(requests_per_stage=60)
    table, stages = synth_table(shape)
    run = write_run(tmp_path / "r", table, run_meta(shape, stages))
    ctx = build_context(load([run]), figures=False)
    assert ctx["agentic"] is None
    assert "### Agentic sessions" not in render([run], "md", history=0)


def test_intended_latency_is_lateness_plus_ttft_and_e2e():
    rec = dict.fromkeys(D.INPUTS) | {"status": "ok", "request_class": "chat",
                                     "t_scheduled": EPOCH, "t_sent": EPOCH + 2_500_000_000,
                                     "ttft_ns": 100_000_001, "e2e_ns": 900_000_000}
    late = dict(rec, status="http_error")
    cols = {c: [r[c] for r in (rec, late)] for c in D.INPUTS}
    got = D.evaluate(["ttft_intended_ms", "e2e_intended_ms"], cols, n=2)
    assert got["ttft_intended_ms"].data[0] == 2600.000001
    assert got["e2e_intended_ms"].data[0] == 3400.0
    assert not got["ttft_intended_ms"].valid[1]  # latencies count successful requests only
    tbl = pa.table({c: pa.array(cols[c], REQUESTS.field(c).type) for c in D.INPUTS})
    arrow = D.evaluate_arrow(tbl, ["ttft_intended_ms"])["ttft_intended_ms"].to_pylist()
    assert arrow == [2600.000001, None]


def _gate_run(tmp_path: Path, name: str, lateness_ms: float) -> Path:
    shape = RunShape(endpoints=[EndpointShape("colocated")], requests_per_stage=400, seed=11,
                     lateness_ms=lateness_ms)
    table, stages = synth_table(shape, run_id=name)
    return write_run(tmp_path / name, table, run_meta(shape, stages, run_id=name))


def test_gate_on_ttft_intended_p99_fails_when_lateness_is_injected(tmp_path):
    base = load_results(_gate_run(tmp_path, "base", 0.5))
    late = load_results(_gate_run(tmp_path, "late", 2000.0))  # same seed: same TTFTs
    rules = GateConfig(rules=[GateRule(metric="ttft_intended_p99", max_increase_pct=10),
                              GateRule(metric="ttft_p99", max_increase_pct=10),
                              GateRule(metric="e2e_intended_p99", max_value=60_000)],
                       bootstrap_resamples=300)
    by = {r.metric: r.verdict for r in gate.evaluate(base, late, rules, slo={})}
    assert by["ttft_intended_p99"] == "fail"
    assert by["ttft_p99"] != "fail"  # the endpoint answered as fast: only the sends were late
    assert by["e2e_intended_p99"] == "pass"
    same = {r.metric: r.verdict for r in gate.evaluate(base, base, rules, slo={})}
    assert same["ttft_intended_p99"] != "fail"
    # the metric is the same over the frame the gate reads: lateness + TTFT
    f = load([tmp_path / "late"]).frame
    want = f["lateness_ms"].to_numpy() + f["ttft_ms"].to_numpy()
    got = f["ttft_intended_ms"].to_numpy()
    ok = ~np.isnan(want)
    assert np.allclose(got[ok], want[ok], rtol=1e-12) and math.isnan(
        M.statistic(f.iloc[0:0], "ttft_intended_p99"))
    assert pc.min(pa.array(got[ok])).as_py() > 0
