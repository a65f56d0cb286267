"""The capacity search's plan: where to probe next, from the verdicts so far (pure: no clock,
no process, no records; ``bench/search_sim.py`` and the tests drive it as it is).

Open loop: ramp geometrically from ``start_rps`` by ``growth`` to the first failing probe
(down from the start when it fails), then bisect the bracket geometrically until
fail / pass - 1 is within ``precision``. Closed loop: the same in whole users. A probe
straddling the target is run again at the same level (``refine`` times; its requests pooled,
so the sample grows). When the bracket is narrow enough its lower end is probed again
(``confirm``, pooled) unless two probes already judged it: one short probe can fall between two
queue bursts and pass a rate the endpoint does not sustain; a confirmation that fails refutes
the rate and the search goes on below it. A rate still straddling after its refinements (or
its confirmation) sits about where the attainment crosses the target: its pooled estimate
decides (``Planner.settle``), and the pass it gives is marked ``estimate``. Counting every such
rate as failed, as this search first did, biased it low by about the width of one interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvbench.core.contract import SearchSpec
from kvbench.runs.search.control import Probe

# A probe runs at least this many mean response times: the number in flight settles within
# about one or two below capacity, and the steady-state test compares its middle with its end
# (the default of ``SearchSpec.steady_residences``)
STEADY_RESIDENCES = SearchSpec.steady_residences


@dataclass
class Planner:
    """Where to probe next, from the verdicts so far."""

    spec: SearchSpec
    history: list = field(default_factory=list)  # (Probe, verdict)
    residence_s: float | None = None  # mean response time at the last passing level
    # where the attainment crosses the target inside the bracket (the driver sets it from
    # the probes' pooled attainment): the first hold's level; None: the highest pass
    hold_at: float | None = None
    # levels whose last verdict was settled on the pooled estimate (not shown at the confidence)
    estimated: set = field(default_factory=set)

    @property
    def closed(self) -> bool:
        """A closed-loop search: its levels are numbers of users (integers)."""
        return self.spec.closed

    def tries(self, level: float) -> int:
        return sum(1 for p, _ in self.history if p.level == level)

    def verdict_at(self, level: float) -> str | None:
        """The settled verdict at ``level`` (its last probe's, on all its requests pooled): a
        straddle after its refinements, or on a confirmation, counts as fail."""
        vs = [v for p, v in self.history if p.level == level]
        if not vs:
            return None
        last = vs[-1]
        if last == "straddle" and (len(vs) > self.spec.refine or "pass" in vs[:-1]):
            return "fail"
        return last

    def bracket(self) -> tuple[float | None, float | None]:
        """(highest passing level, lowest failing level above it); None where there is none."""
        levels = sorted({p.level for p, _ in self.history})
        settled = {r: self.verdict_at(r) for r in levels}
        passes = [r for r, v in settled.items() if v == "pass"]
        lo = max(passes) if passes else None
        fails = [r for r, v in settled.items() if v == "fail" and (lo is None or r > lo)]
        return lo, (min(fails) if fails else None)

    def duration(self, level: float) -> float:
        """A probe's length: ``probe_s``, longer at low rates to send ``min_requests``, and
        at least ``steady_residences`` mean response times of the last passing level plus the
        records' lag, so that its second half shows whether the number in flight settled
        (``reports.capacity.not_steady``); at most ``max_probe_s``. A refinement is as long
        again, its requests pooled with the earlier ones at its level."""
        s = self.spec
        k = s.steady_residences
        floor = (k * self.residence_s + 1.0) if self.residence_s and k else 0.0
        if self.closed:  # ``level`` users send about users / response time requests a second
            need = s.min_requests * self.residence_s / level if self.residence_s else 0.0
        else:
            need = s.min_requests / level
        return min(max(s.probe_s, need, floor), s.max_probe_s)

    def _probe(self, index: int, level: float, role: str) -> Probe:
        if self.closed:
            return Probe(index, None, self.duration(level), role, users=int(level))
        return Probe(index, level, self.duration(level), role)

    def holds(self) -> list:
        """The holds so far, as (Probe, verdict)."""
        return [(p, v) for p, v in self.history if p.role == "hold"]

    def held(self) -> float | None:
        """The level the search claims: the highest its holds held (None: none held)."""
        return max((p.level for p, v in self.holds() if v == "pass"), default=None)

    def hold_duration(self) -> float:
        """A hold's length: ``hold_s``, and at least three mean response times of the last
        passing level plus the records' lag (its second half must show the backlog settled)."""
        k = max(3.0, self.spec.steady_residences)
        return max(self.spec.hold_s, k * self.residence_s + 1.0 if self.residence_s else 0.0)

    def _hold(self, index: int, lo: float | None) -> Probe | None:
        """The next hold. The first goes to the crossing (the highest pass where there is
        none); then down by ``hold_step`` after each failed hold while none held, up by it
        after each that held while none failed, and between the highest that held and the
        lowest that failed (geometric bisection) once both are known, until they are within
        ``hold_precision``. The claim is the highest level held."""
        s = self.spec
        done = self.holds()
        up = self.held()
        down = min((p.level for p, v in done if v != "pass"), default=None)
        if not done:
            level = self.hold_at if self.hold_at is not None else lo
        elif up is None:
            level = down * s.hold_step
        elif down is None:
            level = up / s.hold_step
        elif down / up - 1 <= s.hold_precision or (self.closed and down - up <= 1):
            return None
        else:
            level = math.sqrt(up * down)
        if self.closed:
            level = int(round(level))
            if up is not None:
                level = max(level, int(up) + 1)
            if down is not None:
                level = min(level, int(down) - 1)
            if level < 1 or (up is not None and level <= up):
                return None
            return Probe(index, None, self.hold_duration(), "hold", users=level)
        if not s.min_rps <= level <= s.max_rps:
            return None
        level = float(f"{level:.4g}")
        return Probe(index, level, self.hold_duration(), "hold")

    def next(self) -> Probe | None:
        s = self.spec
        index = len(self.history)
        if s.hold_s and self.holds():
            return self._hold(index, None)
        if self.history:
            p, v = self.history[-1]
            if v == "straddle" and self.tries(p.level) <= s.refine:
                return self._probe(index, p.level, "refine")
        if self.closed:
            return self._next_users(index)
        lo, hi = self.bracket()
        if not self.history:
            rate, role = s.start_rps, "ramp"
        elif hi is None:
            rate, role = lo * s.growth, "ramp"
            if rate > s.max_rps:
                return None
        elif lo is None:
            rate, role = hi / s.growth, "ramp"
            if rate < s.min_rps:
                return None
        else:
            if hi / lo - 1 <= s.precision:
                show = self._show_failure(index, lo, hi)
                if show is not None:
                    return show
                if s.hold_s:
                    return self._hold(index, lo)
                if s.confirm and self.tries(lo) < 2:
                    return Probe(index, lo, self.duration(lo), "confirm")
                return None
            rate, role = math.sqrt(lo * hi), "bisect"
        rate = float(f"{rate:.4g}")
        return Probe(index, rate, self.duration(rate), role)

    def _next_users(self, index: int) -> Probe | None:
        """The closed loop's plan, in whole users: up from ``start_users`` by ``growth`` (one
        more at least, ``max_users`` at most) to the first failure, down from the start by
        ``growth`` (one fewer at least, one user at least) when it fails, then geometric
        bisection until the bracket is one user wide or within ``precision``; the
        confirmation as in the open loop."""
        s = self.spec
        lo, hi = self.bracket()
        if not self.history:
            return self._probe(index, s.start_users, "ramp")
        if hi is None:  # up to max_users itself: the most the search may claim
            if lo >= s.max_users:
                return None
            n = min(s.max_users, max(lo + 1, round(lo * s.growth)))
            return self._probe(index, n, "ramp")
        if lo is None:  # down to one user
            if hi <= 1:
                return None
            return self._probe(index, max(1, min(hi - 1, round(hi / s.growth))), "ramp")
        if hi - lo <= 1 or hi / lo - 1 <= s.precision:
            show = self._show_failure(index, lo, hi)
            if show is not None:
                return show
            if s.hold_s:
                return self._hold(index, lo)
            if s.confirm and self.tries(lo) < 2:
                return self._probe(index, lo, "confirm")
            return None
        n = min(hi - 1, max(lo + 1, round(math.sqrt(lo * hi))))
        return self._probe(index, n, "bisect")

    def _show_failure(self, index: int, lo: float, hi: float) -> Probe | None:
        """Once the bracket is narrow: where no failure above ``lo`` was shown (every one
        settled on its estimate, or the ramp's failure was a speculative probe voided), one
        probe at ``hi`` times ``growth``, so the interval the search claims has an upper end
        it showed. Without it a capacity sitting on a ramp level had no shown upper end
        whenever the ramp's next probe was voided (tests/test_search_aa.py on a busy host:
        ``high_rps`` None on a bracketed search). A pass there reopens the ramp."""
        s = self.spec
        for p, v in self.history:
            if p.level > lo and v == "fail" and p.level not in self.estimated:
                return None
        if self.closed:
            level = min(s.max_users, max(int(hi) + 1, round(hi * s.growth)))
            if level <= hi or self.tries(level):
                return None
            return self._probe(index, level, "ramp")
        level = float(f"{hi * s.growth:.4g}")
        if level > s.max_rps or self.tries(level):
            return None
        return Probe(index, level, self.duration(level), "ramp")

    def record(self, probe: Probe, verdict: str) -> None:
        self.estimated.discard(probe.level)
        self.history.append((probe, verdict))

    def settle(self, probe: Probe, verdict: str, why: str, detail) -> tuple[str, str, bool]:
        """Record ``probe``'s verdict (``detail``: its ``ProbeVerdict``, None if none) as the
        plan takes it: (verdict, why, whether its pooled estimate decided it)."""
        few = [c for c in (detail.classes if detail is not None else [])
               if c.verdict == "straddle"]
        if (verdict == "straddle" and probe.role == "ramp" and few
                and all(c.met == c.requests for c in few)):
            # straddling only for want of requests of a rare class, none of which missed: no
            # evidence either way, and a ramp far below capacity should not spend the budget
            # refining it (the capacity is confirmed before it is claimed)
            verdict = "pass"
            why += ("; too few requests of " + ", ".join(c.request_class for c in few)
                    + " to judge, none missed: the ramp goes on")
        self.record(probe, verdict)
        if verdict != "straddle" or self.verdict_at(probe.level) != "fail":
            return verdict, why, False
        worst = detail.worst if detail is not None else None
        est = worst.attainment if worst is not None else math.nan
        tried = ("the confirmation" if probe.role == "confirm" else
                 f"{self.spec.refine} refinement(s)")
        if not est >= self.spec.target:
            verdict = "fail"
            why += (f"; still straddling after {tried}, its estimate {est:.3f} under the "
                    "target: counted as failed")
        else:
            # as many requests as the search affords and still not conclusive: the level
            # sits about where the attainment crosses the target; its estimate decides, and
            # the capacity it supports is marked as not shown at the confidence
            verdict = "pass"
            why += (f"; still straddling after {tried}: its estimate {est:.3f} meets the "
                    f"target, not shown at {self.spec.confidence:.0%} confidence")
        self.history[-1] = (probe, verdict)
        self.estimated.add(probe.level)
        return verdict, why, True
