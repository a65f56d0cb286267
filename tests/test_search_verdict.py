"""Capacity search, the pure parts: the probe verdict (reports/capacity.py) on synthetic
attainment data, and the plan (kvbench/runs/search.py Planner) against an oracle endpoint
whose capacity is known."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
from hypothesis import given, settings, strategies as st

from kvbench.config import load_config
from kvbench.core.contract import StageEntry
from kvbench.reports.analysis import capacity as C
from kvbench.reports.statistics.resampling import proportion_interval
from kvbench.core.contract import SearchSpec
from kvbench.runs.search import Planner, Probe

ROOT = Path(__file__).resolve().parent.parent
SLO = {"chat": {"ttft_ms": 500, "tpot_ms": 50}, "rag": {"ttft_ms": 1000}}
SPEC = {"start_rps": 1.0, "growth": 2.0, "target": 0.95, "confidence": 0.95, "probe_s": 10.0,
        "min_requests": 30, "max_probe_s": 60.0, "min_class_requests": 5, "refine": 1,
        "precision": 0.1, "budget_s": 10_000.0, "max_rps": 10_000.0, "min_rps": 0.05,
        "settle_s": 10.0, "confirm": True}


def typed(stages: list[dict]) -> list[StageEntry]:
    """Stages written as run.json holds them, as the contract's entries."""
    return [StageEntry.from_dict(s) for s in stages]


def frame(rows):
    """request_frame-like rows: (class, ttft_ms, tpot_ms, status)."""
    df = pd.DataFrame(rows, columns=["request_class", "ttft_ms", "tpot_ms", "status"])
    df["ok"] = df["status"] == "ok"
    df["cancelled"] = df["status"] == "cancelled"
    df["e2e_ms"] = df["ttft_ms"] + 100 * df["tpot_ms"]
    met = []
    for _, r in df.iterrows():
        s = SLO.get(r["request_class"], {})
        met.append(bool(r["ok"]) and all(r[k] <= v for k, v in s.items()))
    df["slo_met"] = met
    df["has_slo"] = df["request_class"].isin(list(SLO))
    df["request_class"] = df["request_class"].astype("category")
    return df


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 400), frac=st.floats(0, 1), target=st.floats(0.5, 0.99),
       seed=st.integers(0, 2**16))
def test_class_verdict_follows_its_bootstrap_interval(n, frac, target, seed):
    met = int(round(frac * n))
    flags = np.zeros(n, bool)
    flags[:met] = True
    v = C.class_verdict(flags, "c", target=target, rng=np.random.default_rng(seed))
    eff = C.effective_n(flags)  # the misses in one run: a burst, worth fewer requests
    ci = proportion_interval(met / n * eff, eff, C.RESAMPLES, np.random.default_rng(seed))
    assert (v.low, v.high) == (ci.low, ci.high)
    assert v.low <= v.attainment <= v.high
    if ci.high < target:
        assert v.verdict == "fail"
    elif ci.low >= target:
        assert v.verdict == "pass" and not v.thin
    elif met == n:  # every request within SLO, too few to show the target: a thin pass
        assert v.verdict == "pass" and v.thin
    else:
        assert v.verdict == "straddle"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 200), target=st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_a_few_successes_are_never_shown_as_certain(n, target):
    """An all-success class's interval widens as it shrinks (the plain bootstrap gives the point
    1.0 for 5/5): it clears the target exactly from ``needed_for`` requests on, and below that
    it passes only thinly, marked so."""
    v = C.class_verdict(np.ones(n, bool), "c", target=target)
    need = C.needed_for(target)
    assert v.verdict == "pass" and v.high == 1.0
    assert v.thin == (n < need) or abs(n - need) <= 2  # the edge is drawn, not exact
    if n <= 5:
        assert v.low < 0.8


@settings(max_examples=60, deadline=None)
@given(n=st.integers(40, 300), misses=st.integers(0, 300))
def test_clear_cases(n, misses):
    misses = min(misses, n)
    flags = np.ones(n, bool)  # the misses spread evenly (no burst)
    flags[np.linspace(0, n - 1, misses).astype(int)] = False
    v = C.class_verdict(flags, "c", target=0.95)
    if misses == 0:
        assert v.verdict == "pass"  # every request within SLO
    if misses >= 0.2 * n:
        assert v.verdict == "fail"  # 80% at most, on at least 40 requests


@settings(max_examples=150, deadline=None)
@given(flags=st.lists(st.booleans(), max_size=400))
def test_effective_n_is_between_one_and_n(flags):
    n = len(flags)
    eff = C.effective_n(np.array(flags, bool))
    if n == 0 or len(set(flags)) <= 1:
        assert eff == n  # nothing varies: nothing to measure
    else:
        assert 1.0 <= eff <= n


def test_a_burst_of_misses_is_worth_fewer_requests_than_scattered_ones():
    """Misses near capacity come in queue bursts. 30 misses in 300 requests scattered at
    random are 300 independent draws and show attainment under 95%; the same 30 in one burst
    (one queue build-up) are about one draw in every 27 requests, and show nothing either
    way: the probe is refined, not failed on one burst."""
    rng = np.random.default_rng(1)
    scattered = np.ones(300, bool)
    scattered[rng.choice(300, 30, replace=False)] = False
    burst = np.ones(300, bool)
    burst[100:130] = False
    a, b = C.class_verdict(scattered, "c"), C.class_verdict(burst, "c")
    assert C.effective_n(scattered) > 250 and a.verdict == "fail" and a.high < 0.95
    assert C.effective_n(burst) < 30 and b.verdict == "straddle"
    assert b.effective == round(C.effective_n(burst), 1) and b.low < 0.8 < 0.95 < b.high
    assert a.attainment == b.attainment == 0.9
    # two bursts are worth about twice one
    two = np.ones(300, bool)
    two[100:115] = False
    two[200:215] = False
    assert 1.5 < C.effective_n(two) / C.effective_n(burst) < 2.5


def test_too_few_requests_cannot_pass_but_can_fail():
    assert C.class_verdict(np.ones(3, bool), "c", min_requests=5).verdict == "straddle"
    assert C.class_verdict(np.zeros(3, bool), "c", min_requests=5).verdict == "fail"


def test_probe_verdict_names_the_failing_class_and_the_slo_it_missed():
    rows = [("chat", 30, 20, "ok")] * 60 \
        + ([("rag", 100, 20, "ok")] * 3 + [("rag", 1500, 20, "ok")]) * 15 \
        + [("trace", 1e6, 1e6, "ok")] * 5  # rag's misses spread (not one burst)
    v = C.probe_verdict(frame(rows), SLO)
    assert v.verdict == "fail"
    assert v.worst.request_class == "rag" and v.worst.missed == "TTFT"
    assert v.worst.misses == {"TTFT": 15}
    assert {c.request_class for c in v.classes} == {"chat", "rag"}  # no SLO: not judged
    tpot = frame([("chat", 30, 20, "ok")] * 40 + [("chat", 30, 80, "ok")] * 20)
    assert C.probe_verdict(tpot, SLO).worst.missed == "TPOT"


def test_a_cancelled_request_of_a_probe_is_a_miss():
    rows = ([("chat", 30, 20, "ok")] * 2 + [("chat", math.nan, math.nan, "cancelled")]) * 20
    v = C.probe_verdict(frame(rows), SLO)
    assert v.verdict == "fail" and v.worst.missed == "errors or cut"


def test_bounded_verdict_waits_only_while_pending_requests_could_change_it():
    done = frame([("chat", 30, 20, "ok")] * 200)
    few = frame([("chat", math.nan, math.nan, "cancelled")] * 2)
    many = frame([("chat", math.nan, math.nan, "cancelled")] * 60)
    assert C.bounded_verdict(done, few, SLO)[0] == "pass"  # passes even if both miss
    assert C.bounded_verdict(done, many, SLO)[0] is None  # 60 misses would fail it
    bad = frame([("chat", 900, 20, "ok")] * 100)
    decided, v = C.bounded_verdict(bad, many, SLO)
    assert decided == "fail" and v.worst.missed == "TTFT"


def test_saturation_signals():
    # answers take 0.1 s on average: unanswered after 1 s + the records' lag is stuck
    recent = np.full(40, 0.8)  # 40 sent in the last 0.8 s, no record yet: the records' lag
    assert C.saturated(recent, 5.0, 50.0, 0.1) is None
    stuck = np.r_[np.full(12, 2.5), recent]
    assert "12 requests unanswered after 2.0 s" in C.saturated(stuck, 5.0, 50.0, 0.1)
    assert C.saturated(stuck[3:], 5.0, 50.0, 0.1) is None  # 9 are not enough
    assert C.saturated(stuck, 1.0, 50.0, 0.1) is None  # too early to tell
    assert C.saturated(stuck, 5.0, 50.0, None) is None  # nothing passed yet: no reference
    assert "late" in C.saturated(0, 1.0, 6.0, None, lateness_ms=900)
    assert C.short_of_offered(98, 10.0, 10.0) is None
    assert "sent 40 requests" in C.short_of_offered(40, 10.0, 10.0)


# --------------------------------------------------------------------------- the plan

def search(capacity, spec=SPEC, noise=None):
    """Run the planner against an oracle that passes at or below ``capacity``; straddles
    within ``noise`` (relative) of it."""
    p = Planner(SearchSpec.from_dict(spec))
    spent = 0.0
    while (probe := p.next()) is not None:
        assert probe.index == len(p.history)
        if spent + probe.duration_s > spec["budget_s"]:
            break
        spent += probe.duration_s
        r = probe.rate_rps
        v = ("straddle" if noise and abs(r / capacity - 1) < noise else
             "pass" if r <= capacity else "fail")
        p.record(probe, v)
    return p, spent


@settings(max_examples=100, deadline=None)
@given(capacity=st.floats(0.2, 2000), start=st.floats(0.1, 50), growth=st.floats(1.3, 4))
def test_planner_brackets_a_known_capacity(capacity, start, growth):
    spec = dict(SPEC, start_rps=start, growth=growth)
    p, _ = search(capacity, spec)
    lo, hi = p.bracket()
    assert lo is not None and hi is not None
    assert lo <= capacity < hi
    assert hi / lo - 1 <= spec["precision"] + 1e-3  # bisected to the precision asked
    roles = [q.role for q, _ in p.history]
    first_fail = next(i for i, (_, v) in enumerate(p.history) if v == "fail")
    assert all(r == "ramp" for r in roles[:first_fail + 1])
    ramp = math.ceil(abs(math.log(capacity / start)) / math.log(growth)) + 1
    bisect = math.ceil(math.log2(math.log(growth) / math.log(1 + spec["precision"]))) + 1
    assert len(p.history) <= ramp + max(0, bisect) + 1  # + the confirmation
    (last, v), = p.history[-1:]
    assert last.role == "confirm" and last.rate_rps == lo and v == "pass"


def test_planner_refines_a_straddle_then_counts_it_as_a_failure():
    p, _ = search(10.0, dict(SPEC, start_rps=10.0), noise=0.01)
    probes = [q for q, _ in p.history]
    assert probes[0].rate_rps == probes[1].rate_rps == 10.0
    assert probes[1].role == "refine" and probes[1].duration_s == probes[0].duration_s
    assert p.verdict_at(10.0) == "fail"  # still straddling after its refinement
    lo, hi = p.bracket()
    assert hi == 10.0 and lo < 10.0


def test_capacity_is_confirmed_before_it_is_claimed():
    """A single pass between queue bursts is probed again; when the confirmation (pooled)
    does not pass, the rate counts as failed and the search goes on below it."""
    lucky = {"rate": None}

    def oracle(probe, capacity=10.0):
        if probe.role == "confirm" and probe.rate_rps > capacity:
            return "straddle"  # the pooled sample shows the misses the first probe missed
        if probe.rate_rps <= capacity:
            return "pass"
        if lucky["rate"] is None and probe.role == "bisect":
            lucky["rate"] = probe.rate_rps  # the first bisection above capacity passes
            return "pass"
        return "fail"

    p = Planner(SearchSpec.from_dict(dict(SPEC, start_rps=4.0, precision=0.1)))
    while (probe := p.next()) is not None:
        p.record(probe, oracle(probe))
    lo, hi = p.bracket()
    assert lucky["rate"] is not None and p.verdict_at(lucky["rate"]) == "fail"
    assert lo <= 10.0 < hi and hi / lo - 1 <= 0.1
    confirms = [q for q, _ in p.history if q.role == "confirm"]
    assert confirms[-1].rate_rps == lo and p.verdict_at(lo) == "pass"
    # a rate already judged on two probes (a refined straddle that passed) is not confirmed
    q = Planner(SearchSpec.from_dict(dict(SPEC, start_rps=10.0, precision=0.5)))
    for probe, v in ((Probe(0, 10.0, 10.0), "straddle"), (Probe(1, 10.0, 10.0, "refine"), "pass"),
                     (Probe(2, 12.0, 10.0), "fail")):
        q.record(probe, v)
    assert q.next() is None
    assert Planner(SearchSpec.from_dict(dict(SPEC, confirm=False)), [(Probe(0, 10.0, 10.0), "pass"),
                                               (Probe(1, 10.5, 10.0), "fail")]).next() is None


def test_summarise_takes_a_rates_last_verdict():
    rows = [("chat", 30, 20, "ok")] * 40
    f = pd.concat([frame(rows).assign(stage=i) for i in range(3)], ignore_index=True)
    f["endpoint"], f["workload"] = "ep", "mix"
    f["completion_tokens"] = 10.0
    stages = [{"endpoint": "ep", "workload": "mix", "index": i, "rate_rps": r,
               "duration_s": 5.0, "search": {"role": role, "verdict": v}}
              for i, (r, role, v) in enumerate([(4.0, "ramp", "pass"), (8.0, "bisect", "pass"),
                                                (8.0, "confirm", "fail")])]
    (cap,) = C.summarise(typed(stages), f, SLO)
    assert (cap.capacity_rps, cap.fail_rps) == (4.0, 8.0)


def test_the_shown_interval_leaves_rates_settled_on_their_estimates_inside():
    """A rate still straddling after its refinement is settled on its estimate: it sets the
    capacity (or the first failure) but the interval runs between rates the bootstrap showed,
    so two searches of one endpoint that settled such rates differently still overlap."""
    rows = [("chat", 30, 20, "ok")] * 40
    f = pd.concat([frame(rows).assign(stage=i) for i in range(4)], ignore_index=True)
    f["endpoint"], f["workload"] = "ep", "mix"
    f["completion_tokens"] = 10.0
    plan = [(4.0, "pass", False), (6.0, "pass", True), (7.0, "fail", True), (8.0, "fail", False)]
    stages = [{"endpoint": "ep", "workload": "mix", "index": i, "rate_rps": r,
               "duration_s": 5.0, "search": {"role": "bisect", "verdict": v,
                                             **({"estimate": True} if est else {})}}
              for i, (r, v, est) in enumerate(plan)]
    (cap,) = C.summarise(typed(stages), f, SLO)
    assert (cap.capacity_rps, cap.fail_rps) == (6.0, 7.0)
    assert (cap.low_rps, cap.high_rps) == (4.0, 8.0) and cap.interval_text == "4 – 8"
    shown = [dict(s, search={k: v for k, v in s["search"].items() if k != "estimate"})
             for s in stages]
    (cap,) = C.summarise(typed(shown), f, SLO)
    assert (cap.low_rps, cap.high_rps) == (cap.capacity_rps, cap.fail_rps) == (6.0, 7.0)


def test_planner_stays_within_its_budget():
    spec = dict(SPEC, budget_s=45.0, probe_s=10.0, min_requests=1)
    p, spent = search(100.0, spec)
    assert spent <= 45.0 and len(p.history) == 4  # 10 s each: a fifth would overrun
    p2 = Planner(SearchSpec.from_dict(dict(SPEC, probe_s=5.0, min_requests=30)))
    assert p2.duration(1.0) == 30.0  # long enough for min_requests at a low rate
    assert p2.duration(100.0) == 5.0
    assert p2.duration(0.1) == 60.0  # capped by max_probe_s


def test_first_probe_failing_ramps_down():
    p, _ = search(0.3, dict(SPEC, start_rps=4.0))
    lo, hi = p.bracket()
    assert lo <= 0.3 < hi
    assert p.history[1][0].rate_rps == 2.0


def test_summarise_reads_bracket_and_breaking_class_from_stages():
    rows_pass = [("chat", 30, 20, "ok")] * 40 + [("rag", 100, 20, "ok")] * 40
    rows_fail = [("chat", 30, 90, "ok")] * 40 + [("rag", 100, 20, "ok")] * 40
    f = pd.concat([frame(rows_pass).assign(stage=0), frame(rows_fail).assign(stage=1)],
                  ignore_index=True)
    f["endpoint"], f["workload"] = "ep", "mix"
    f["completion_tokens"] = 100.0
    stages = [{"endpoint": "ep", "workload": "mix", "index": 0, "rate_rps": 4.0,
               "duration_s": 10.0, "search": {"role": "ramp", "verdict": "pass"}},
              {"endpoint": "ep", "workload": "mix", "index": 1, "rate_rps": 8.0,
               "duration_s": 10.0, "search": {"role": "ramp", "verdict": "fail"}}]
    (cap,) = C.summarise(typed(stages), f, SLO)
    assert (cap.capacity_rps, cap.fail_rps, cap.status) == (4.0, 8.0, "bracketed")
    assert cap.breaks["class"] == "chat" and cap.breaks["missed"] == "TPOT"
    assert cap.at_capacity["output_tps"] == 800.0  # 80 answers x 100 tokens over 10 s
    # chat within SLO: all 40 at 4 req/s, none at 8: it crosses 0.95 a twentieth of the way up
    assert math.isclose(cap.estimate_rps, 4.2)
    per = C.per_gpu_and_cost(cap, 2, 3.0)
    assert math.isclose(per["capacity_per_gpu"], 2.1)
    # $6 an hour for 840 tokens/s (800 measured at 4 req/s, scaled to 4.2): 6 / (840 * 3600)
    assert math.isclose(per["usd_per_mtok"], 6 / (840 * 3600) * 1e6)


def test_the_capacity_is_where_the_attainment_crosses_the_target_inside_the_bracket():
    """As a fixed-rate sweep reads its capacity between two of its rates: the attainment
    pooled over every probe at the last passing and the first failing rate, linear in rate."""
    def probe(n_ok, n_miss):
        return [("chat", 30, 20, "ok")] * n_ok + [("chat", 900, 20, "ok")] * n_miss

    parts = [(0, probe(99, 1)), (1, probe(98, 2)), (2, probe(90, 10)), (3, probe(88, 12))]
    f = pd.concat([frame(rows).assign(stage=i) for i, rows in parts], ignore_index=True)
    f["endpoint"], f["workload"] = "ep", "mix"
    f["completion_tokens"] = 10.0
    plan = [(10.0, "bisect", "pass"), (10.0, "confirm", "pass"), (11.0, "bisect", "straddle"),
            (11.0, "refine", "fail")]
    stages = [{"endpoint": "ep", "workload": "mix", "index": i, "rate_rps": r,
               "duration_s": 10.0, "search": {"role": role, "verdict": v, "target": 0.95}}
              for i, (r, role, v) in enumerate(plan)]
    (cap,) = C.summarise(typed(stages), f, SLO)
    assert (cap.capacity_rps, cap.fail_rps) == (10.0, 11.0)
    # 0.985 at 10 req/s, 0.89 at 11: 0.95 is crossed 0.035 / 0.095 of the way
    assert math.isclose(cap.estimate_rps, 10.0 + 0.035 / 0.095)
    # judged against the search's own target (its notes): 0.9 is crossed further up
    lax = [dict(s, search=dict(s["search"], target=0.9)) for s in stages]
    (cap,) = C.summarise(typed(lax), f, SLO)
    assert math.isclose(cap.estimate_rps, 10.0 + 0.085 / 0.095)
    # nothing failed: the highest pass is all the search can say (a lower bound)
    (cap,) = C.summarise(typed(stages[:2]), f, SLO)
    assert cap.fail_rps is None and cap.estimate_rps == 10.0


@settings(max_examples=200, deadline=None)
@given(lo=st.floats(0.1, 100), width=st.floats(0.01, 2.0),
       at_lo=st.dictionaries(st.sampled_from("abc"), st.floats(0, 1), max_size=3),
       at_hi=st.dictionaries(st.sampled_from("abc"), st.floats(0, 1), max_size=3),
       target=st.floats(0.5, 0.99), bump=st.floats(0, 0.5))
def test_crossing_lies_in_the_bracket_and_rises_with_attainment(lo, width, at_lo, at_hi,
                                                                  target, bump):
    hi = lo * (1 + width)
    x = C.crossing(lo, hi, at_lo, at_hi, target)
    assert lo <= x <= hi
    # a class doing better at either end never lowers the capacity
    for cls in at_lo:
        better = dict(at_lo, **{cls: min(1.0, at_lo[cls] + bump)})
        assert C.crossing(lo, hi, better, at_hi, target) >= x - 1e-9 * hi
    for cls in at_hi:
        better = dict(at_hi, **{cls: min(1.0, at_hi[cls] + bump)})
        assert C.crossing(lo, hi, at_lo, better, target) >= x - 1e-9 * hi
    # a single class is linear between its ends
    if len(at_lo) == 1 and set(at_hi) == set(at_lo):
        (a,), (b,) = at_lo.values(), at_hi.values()
        if a > target > b:
            assert math.isclose(x, lo + (a - target) / (a - b) * (hi - lo), rel_tol=1e-9)


def test_the_class_that_broke_is_the_one_whose_answers_missed_not_the_cut_stragglers():
    """A failed probe's stragglers are cut once its verdict is settled: the long answers of
    one class then look like its misses, but the probe failed on another class's TTFT."""
    rows_pass = [("chat", 30, 20, "ok")] * 40 + [("rag", 100, 20, "ok")] * 40
    rows_fail = ([("chat", 30, 20, "ok")] * 32 + [("chat", 900, 20, "ok")] * 8
                 + [("rag", 100, 20, "ok")] * 28 + [("rag", float("nan"), float("nan"),
                                                    "cancelled")] * 12)
    f = pd.concat([frame(rows_pass).assign(stage=0), frame(rows_fail).assign(stage=1)],
                  ignore_index=True)
    f["endpoint"], f["workload"] = "ep", "mix"
    f["completion_tokens"] = 100.0
    stages = [{"endpoint": "ep", "workload": "mix", "index": i, "rate_rps": r,
               "duration_s": 10.0, "search": {"role": "ramp", "verdict": v}}
              for i, (r, v) in enumerate([(4.0, "pass"), (8.0, "fail")])]
    (cap,) = C.summarise(typed(stages), f, SLO)
    assert cap.breaks["class"] == "chat" and cap.breaks["missed"] == "TTFT"


def test_default_config_is_the_capacity_bake_off():
    cfg = load_config(ROOT / "bench.toml")
    prof = cfg.profiles[cfg.suite.profile]
    assert prof.pacing == "search" and prof.search.target == 0.95
    assert cfg.profiles["ladder"].pacing == "poisson"  # kept: `kvbench run --profile ladder`
    assert {e.topology for e in cfg.endpoints} == {"colocated", "disaggregated", "offloaded"}


def test_the_jobs_search_settings_are_the_configs():
    """The job's copy of the search settings (read without pydantic by the load process) has
    the config's fields and defaults: a setting added to one is added to the other."""
    from dataclasses import fields

    from kvbench.config.load import SearchSpec as ConfigSpec

    ours = {f.name: f.default for f in fields(SearchSpec) if f.name != "extra"}
    assert ours == ConfigSpec().model_dump()


def test_a_failure_settled_on_its_estimate_is_shown_before_the_search_ends():
    """The capacity on a ramp level: the ramp's probe above it voided (it started on the
    guess that the level passed), the level straddles and is settled failed on its estimate,
    then the bisection below passes. No failure above the capacity was shown, so the search
    probes the failed level times ``growth`` before it ends: its interval gets an upper end
    it showed (tests/test_search_aa.py once got none on a busy host)."""
    spec = SearchSpec.from_dict(dict(SPEC, start_rps=3.0, growth=2.0, precision=0.5,
                                     confirm=False))
    p = Planner(spec)
    settled = []
    for level, role, v in ((3.0, "ramp", "pass"), (6.0, "ramp", "straddle"),
                           (6.0, "refine", "straddle")):
        probe = p.next()
        assert (probe.rate_rps, probe.role) == (level, role)
        settled.append(p.settle(probe, v, "", None)[2])
    assert settled[-1] and p.verdict_at(6.0) == "fail"  # counted failed on its estimate
    probe = p.next()
    assert probe.rate_rps == 4.243 and probe.role == "bisect"
    p.settle(probe, "pass", "", None)
    show = p.next()
    assert (show.rate_rps, show.role) == (12.0, "ramp")  # the upper end, shown
    p.settle(show, "fail", "", None)
    assert p.next() is None and p.bracket() == (4.243, 6.0)
    # a shown failure above the capacity: nothing more to show
    q = Planner(spec, [(Probe(0, 3.0, 10.0), "pass"), (Probe(1, 6.0, 10.0), "fail"),
                       (Probe(2, 4.243, 10.0, "bisect"), "pass")])
    assert q.next() is None
