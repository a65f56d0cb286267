"""The diagnosis of a capacity search speaks of problems only: its probes above the capacity it
claims (and its void ones) fail, queue and drain late by design, and raise no overloaded or
error finding; an endpoint that passes nothing, or fails requests at or below its capacity,
still gets one. And one numbering: "probe N" is run.json's stage index + 1 in the console,
in run.json's notes and in the report."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from kvbench.core.contract import SearchNote, StageEntry
from kvbench.core.schema import REQUESTS
from kvbench.reports.analysis import diagnose as D
from kvbench.reports.analysis import numbering
from kvbench.reports.analysis import overload as O
from kvbench.reports.measures.data import ReportData, load
from kvbench.reports.statistics import metrics as M
from kvbench.runs.search import console
from kvbench.runs.search.control import Probe

T0 = 10**18
FIXTURE = Path(__file__).parent / "data" / "runs" / "search"
SLO = {"chat": {"ttft_ms": 1000}}


def _probe(index: int, rate: float, window_s: float, queue: bool, t0: int,
           errors: int = 0) -> list[dict]:
    """A stage of ``rate`` over ``window_s``: kept up with (TTFT 50 ms), or a queue before
    the prefill (the server starts a request every 4/rate s, so request i waits ~0.75 i/rate
    s); its first ``errors`` requests fail with a 503."""
    n = int(rate * window_s)
    rows = []
    for i in range(n):
        t = t0 + int(i / rate * 1e9)
        ttft = (0.75 * i / rate + 0.05) if queue else 0.05
        e2e = ttft + 0.4
        bad = i < errors
        rows.append(dict(run_id="r", endpoint="ep", topology="colocated", workload="w",
                         request_class="chat", stage=index, request_id=f"q{index}-{i}",
                         session_id=f"s{index}-{i}", turn=0, worker="h:1", prompt_tokens=500,
                         completion_tokens=0 if bad else 20, t_scheduled=t, t_sent=t,
                         connect_ns=0, ttft_ns=None if bad else int(ttft * 1e9),
                         chunk_offsets_ns=[] if bad else [int(ttft * 1e9), int(e2e * 1e9)],
                         chunk_tokens=[] if bad else [1, 19], e2e_ns=int(e2e * 1e9),
                         status="http_error" if bad else "ok",
                         http_status=503 if bad else 200,
                         error="503 Service Unavailable" if bad else None))
    return rows


def _data(probes: list[tuple[float, str | None, bool, int]], search: bool = True,
          window_s: float = 10.0) -> ReportData:
    """A run of one endpoint: per probe (rate, verdict, queueing, errors), in order."""
    rows, stages, t0 = [], [], T0
    for i, (rate, verdict, queue, errors) in enumerate(probes):
        rows += _probe(i, rate, window_s, queue, t0, errors)
        note = SearchNote(role="ramp" if verdict else "ramp (void)", verdict=verdict,
                          why="test") if search else None
        stages.append(StageEntry(endpoint="ep", workload="w", index=i, pacing="poisson",
                                 rate_rps=rate, duration_s=window_s, t_start_ns=t0,
                                 t_end_ns=t0 + int(window_s * 1e9), search=note))
        t0 += int(60 * 1e9)
    table = pa.table({n: pa.array([r.get(n) for r in rows], t)
                      for n, t in zip(REQUESTS.names, REQUESTS.types)}, schema=REQUESTS)
    empty = pa.table({"endpoint": pa.array([], pa.string())})
    frame = M.request_frame(table, stages=[s.to_dict() for s in stages], slo=SLO)
    return ReportData(frame=frame, runs=[], paths=[], gpu=empty, engine=empty, slo=SLO,
                      stages=stages)


def test_a_searchs_probes_above_its_capacity_are_no_overload_finding():
    # passes at 5 and 10 req/s, fails queueing at 20: the search's limit, not a finding
    probes = [(5.0, "pass", False, 0), (20.0, "fail", True, 0), (10.0, "pass", False, 0)]
    d = _data(probes)
    rates = O.rates(d.frame)
    assert rates.loc[rates["stage"] == 1, "overloaded"].item() is True  # it is overloaded ...
    assert D.overloaded(d) == []  # ... by design: no finding
    assert not [f for f in D.diagnose(d) if f.rule in ("overloaded", "start_failed")]
    # the same stages run as a ladder (no search) are a finding, named as the console does
    (found,) = D.overloaded(_data(probes, search=False))
    assert "(w stage 2)" in found.title and found.numbers["stages"] == ["w stage 2"]


def test_an_endpoint_that_fails_at_the_start_rate_is_a_finding():
    # the search started at 20 req/s and stepped down to 10: both failed, queueing
    d = _data([(20.0, "fail", True, 0), (10.0, "fail", True, 0), (20.0, None, True, 0)])
    (start,) = D.start_failed(d)
    assert start.severity == "critical" and start.numbers == {
        "workload": "w", "lowest": 10.0, "start": 20.0, "probes": 2, "undecided": []}
    assert "not even the search's start, 20 req/s" in start.title
    assert ("probe 2 at 10 req/s", "FAIL: test") in start.evidence
    (over,) = D.overloaded(d)  # the lowest level tried is still evidence; above it, not
    assert over.numbers["stages"] == ["w probe 2"]
    found = D.diagnose(d)
    assert found[0].rule == "start_failed"  # what to act on comes first


def test_errors_count_at_or_below_the_capacity_not_above():
    # 503s only in the failing probe above the claimed 10 req/s: how the search found it
    above = _data([(5.0, "pass", False, 0), (20.0, "fail", False, 40), (10.0, "pass", False, 0)])
    assert D.errors(above) == []
    # the same 503s at the capacity: a finding
    at = _data([(5.0, "pass", False, 0), (20.0, "fail", False, 0), (10.0, "pass", False, 40)])
    (err,) = D.errors(at)
    assert err.numbers["errors"] == 40


def test_a_cut_stage_reports_no_negative_drain():
    # 100 requests over 10 s; the stage is cut at 5 s with the rest in flight
    rows = _probe(0, 10.0, 10.0, True, T0)
    for r in rows[50:]:
        r.update(status="cancelled", ttft_ns=None, chunk_offsets_ns=[], chunk_tokens=[],
                 e2e_ns=None, completion_tokens=None)
    for r in rows[:50]:  # the first half answered before the cut
        r.update(ttft_ns=int(0.05e9), e2e_ns=int(0.2e9), chunk_offsets_ns=[int(0.05e9),
                                                                          int(0.2e9)])
    table = pa.table({n: pa.array([r.get(n) for r in rows], t)
                      for n, t in zip(REQUESTS.names, REQUESTS.types)}, schema=REQUESTS)
    stages = [{"endpoint": "ep", "workload": "w", "index": 0, "pacing": "poisson",
               "rate_rps": 10.0, "duration_s": 5.0, "t_start_ns": T0,
               "t_end_ns": T0 + int(5e9), "partial": True, "planned_duration_s": 10.0}]
    (r,) = O.rates(M.request_frame(table, stages=stages)).to_dict("records")
    assert r["drain_s"] >= 0 and r["cancelled"] == 50


def _committed() -> ReportData:
    return load([FIXTURE])


def test_the_committed_search_raises_no_overloaded_finding():
    d = _committed()
    found = D.diagnose(d)
    assert not [f for f in found if f.rule in ("overloaded", "errors")]
    # colocated passed nothing in its 40 s (7 req/s failed, 4.118 undecided at the budget):
    # that is a finding, and the first one
    (start,) = [f for f in found if f.rule == "start_failed"]
    assert found[0] is start and start.endpoint == "colocated"
    assert start.numbers["start"] == 7.0 and start.numbers["undecided"] == [4.118]
    text = " ".join(v for f in found for _, v in f.evidence)
    assert not re.search(r"drained -", text)
    # it did overload its endpoints above their capacity: the search's probes hid it
    assert O.rates(d.frame)["overloaded"].fillna(False).astype(bool).any()


def test_one_numbering_in_console_run_json_and_report(tmp_path):
    # the console: probe N for run.json stage index N - 1; the warm-up has no number
    assert console.probe_line(Probe(2, 5.0, 6.0, "ramp"), "pass", "ok").startswith(
        "    probe 3 (ramp) 5 req/s")
    assert numbering.label(0, "warmup") == "warm-up" and numbering.label(4) == "probe 5"
    assert numbering.label(4, search=False) == "stage 5"
    # run.json: a void probe's note names the probe it assumed, by the same number
    d = _committed()
    by = {(s.endpoint, s.index): s for s in d.stages}
    voids = [s for s in d.stages if s.search and s.search.verdict is None]
    assert voids
    for s in voids:
        n = int(re.search(r"probe (\d+)", s.search.why).group(1))
        assumed = by[(s.endpoint, n - 1)]  # probe n is stage index n - 1 ...
        assert assumed.index < s.index and assumed.search.verdict != "pass"  # ... which failed
    # the report names stages as the console does: the largest loop pause's stage
    shutil.copytree(FIXTURE, tmp_path / "search")
    md = subprocess.run([sys.executable, "-m", "kvbench", "report", str(tmp_path / "search"),
                         "--format", "md"], capture_output=True, text=True, timeout=300).stdout
    pauses = [s for s in d.stages if s.endpoint == "offloaded" and s.loop_pause_max_ms]
    worst = max(pauses, key=lambda s: s.loop_pause_max_ms)
    assert f"largest event-loop pause of the load process (mix probe {worst.index + 1})" in md
    assert not re.search(r"\bmix stage \d", md)  # no 0-based "stage N" of a search


@pytest.mark.parametrize("rule", D.ACTION_ORDER)
def test_every_ordered_rule_exists(rule):
    assert rule in D.RULES or rule == "cache_verify"
