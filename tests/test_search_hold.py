"""The capacity search's hold (``search.hold_s``): a capacity is claimed only at a level the
endpoint held for a hold's length. The plan of holds (pure: any sequence of verdicts), the
search over the emulator's engine in virtual time (bench/search_sim.py), and kvbench run end
to end, with run.json and the report's capacity read back."""

import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.core.contract import SearchSpec
from kvbench.core.store import load_results
from kvbench.reports.analysis import capacity as C
from kvbench.reports.statistics.metrics import request_frame
from kvbench.runs import search
from kvbench.runs.search.control import Probe
from kvbench.runs.search.plan import Planner
from kvbench_cli import run_config, tiny_chat_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from search_sim import OPTIONS, SimBackend  # noqa: E402

SPEC = SearchSpec(start_rps=4.0, growth=2.0, precision=0.5, hold_s=20.0, hold_step=0.8,
                  hold_precision=0.1, budget_s=1e6)


def _bracketed(spec: SearchSpec) -> Planner:
    """A plan whose bracket is settled within precision 0.5: 4 and 5.657 req/s passed, 8
    failed."""
    p = Planner(spec)
    p.record(Probe(0, 4.0, 10, "ramp"), "pass")
    p.record(Probe(1, 8.0, 10, "ramp"), "fail")
    p.record(Probe(2, 5.657, 10, "bisect"), "pass")
    return p


def test_the_first_hold_goes_to_the_crossing_once_the_bracket_is_within_precision():
    p = _bracketed(SPEC)
    p.hold_at = 6.5
    h = p.next()
    assert h.role == "hold" and h.rate_rps == 6.5 and h.duration_s >= SPEC.hold_s
    p.hold_at = None  # no crossing known: the highest pass
    assert p.next().rate_rps == 5.657
    p.residence_s = 9.0  # three mean response times and the records' lag, if longer
    assert p.next().duration_s == 3 * 9.0 + 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.floats(2.0, 50.0))
def test_holds_close_in_on_the_highest_level_held(verdicts, first):
    """Whatever the holds' verdicts: each next hold lies strictly between the highest level
    held and the lowest that failed (down by hold_step while none held, up by it while none
    failed), the plan ends once they are within hold_precision, and the claim is the highest
    level held."""
    p = _bracketed(SPEC)
    p.hold_at = first
    for ok in verdicts:
        h = p.next()
        up, down = p.held(), min((q.level for q, v in p.holds() if v != "pass"), default=None)
        if h is None:
            assert up is not None and down is not None
            assert down / up - 1 <= SPEC.hold_precision * 1.001
            return
        assert h.role == "hold"
        if up is not None:
            assert h.rate_rps > up
        if down is not None:
            assert h.rate_rps < down
        if up is None and down is not None:
            assert math.isclose(h.rate_rps, down * SPEC.hold_step, rel_tol=1e-3)
        p.record(h, "pass" if ok else "fail")
    held = [q.level for q, v in p.holds() if v == "pass"]
    assert p.held() == (max(held) if held else None)


@pytest.fixture
def _quiet_asyncio():
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    yield


@pytest.mark.parametrize("seed", [1, 2])
def test_the_search_ends_holding_what_it_claims(_quiet_asyncio, seed):
    """On the emulator's engine in virtual time (the truth of tests/test_search_sim.py: 31.2
    req/s at its SLO, measured on 800 s per rate), the search claims the level of a hold that
    passed, that hold ran its whole length, and the claim is within 15% of the truth."""
    slo = {"chat": {"ttft_ms": 100.0}}
    spec = dict(start_rps=7.5, growth=1.7, target=0.95, probe_s=10.0, min_requests=30,
                max_probe_s=14.0, min_class_requests=5, refine=0, precision=0.3,
                budget_s=150.0, settle_s=5.0, hold_s=20.0, hold_step=0.85)
    b = SimBackend(dict(OPTIONS, time_scale=0.2), 64, 32, slo, seed)
    planner, control = search.drive(b, spec, say=lambda line: None)
    held = planner.held()
    assert held is not None, [(p.rate_rps, p.role, p.verdict) for p in control.probes]
    holds = [p for p in control.probes if p.role == "hold"]
    passing = [p for p in holds if p.verdict == "pass" and p.rate_rps == held]
    assert passing and all(p.duration_s >= 20.0 for p in passing)
    assert all(p.verdict == "fail" for p in holds if p.rate_rps > held)
    assert abs(held / 31.2 - 1) <= 0.15, (held, [(p.rate_rps, p.role, p.verdict)
                                                 for p in control.probes])


SEQS = 2
CONFIG = tiny_chat_config("hold", SEQS, """
[profiles.search]
pacing = "search"
search = { start_rps = 3.0, growth = 3.0, probe_s = 4, min_requests = 12, max_probe_s = 5, min_class_requests = 5, refine = 0, precision = 1.0, budget_s = 45, settle_s = 3, hold_s = 8, hold_step = 0.7 }
drain_s = 2
""", 250)


def test_kvbench_run_claims_only_a_held_level(tmp_path):
    """kvbench run: every hold is a stage of role "hold" in run.json; the capacity the report
    reads is the highest level a hold held (marked held), or, where none held, the bracket
    marked not held; and no claim exceeds what 2 slots can serve (the queue model)."""
    run_dir, out = run_config(tmp_path, CONFIG, "h1", timeout_s=300)
    meta = json.loads((run_dir / "run.json").read_text())
    probes = [s for s in meta["stages"] if s.get("search")]
    holds = [s for s in probes if s["search"]["role"] == "hold"]
    assert holds, [s["search"] for s in probes]
    for s in holds:  # a hold that ran its length passed or failed on its estimate, or was cut
        assert s["search"]["verdict"] in ("pass", "fail")
        assert s["search"]["why"].startswith(("held", "did not hold"))
    res = load_results(run_dir)
    slo = res.meta.config["slo"]
    f = request_frame(res.requests, stages=res.meta.stages, slo=slo)
    (cap,) = C.summarise(res.meta.stages, f, slo)
    passed = [s["rate_rps"] for s in holds if s["search"]["verdict"] == "pass"]
    if passed:
        assert cap.held is True and cap.capacity_rps == max(passed) == cap.estimate_rps
    else:
        assert cap.held is False
    first = f[(f["stage"] == res.meta.stages[0].index) & f["ok"]]
    service_s = float(np.median(first["e2e_ms"] - first["server_queue_ms"])) / 1e3
    if cap.capacity_rps is not None:
        assert cap.capacity_rps <= 1.1 * SEQS / service_s, (cap, service_s)
    assert "CAPACITY at SLO: tiny x chat" in out
