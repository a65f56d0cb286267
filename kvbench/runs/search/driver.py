"""The capacity search's driver: the state machine that asks the plan for a probe, has the
backend run it, follows it with a ``Watch`` until its verdict, and publishes every step in
the control file (``Search``); ``run`` is kvbench run's entry, over a real Locust child.

Pipelined: when a probe's schedule ends before its verdict is known (answers still streaming),
the next probe starts at once on the assumption that it passed; if it did not, that next probe
is cut and marked void (no verdict), and the search goes on from the real verdict. One probe at
most is speculative. A failed probe's stragglers are cancelled, so that its backlog does not
weigh on the next, lower probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from kvbench.core.contract import SearchSpec
from kvbench.runs.search import console
from kvbench.runs.search.backend import LocustBackend
from kvbench.runs.search.control import Control, Note, Probe, ProbeEntry
from kvbench.runs.search.plan import Planner
from kvbench.runs.search.watch import Watch

POLL_S = 0.5  # how often the search reads the records (the shards flush about every 0.5 s)


@dataclass
class Result:
    rc: int
    error: str | None
    log_path: Path
    capacity_rps: float | None
    fail_rps: float | None
    probes: list[ProbeEntry]


def run(job, processes: int = 1, say=console.say) -> Result:
    """Search ``job``'s endpoint x workload; every probe is a stage of one Locust child."""
    backend = LocustBackend(job, processes)
    planner, control = drive(backend, job.search, say)
    rc, error = backend.close()
    lo, hi = planner.bracket()
    return Result(rc, error, backend.log_path, lo, hi, control.probes)


def drive(backend, spec: SearchSpec | dict, say=console.say) -> tuple[Planner, Control]:
    """The search over ``backend`` (``LocustBackend``'s methods) to its end: the plan and the
    control file as they ended. ``spec`` may be given as its JSON object (the simulators')."""
    if not isinstance(spec, SearchSpec):
        spec = SearchSpec.from_dict(spec)
    return Search(backend, spec, say).run()


class Search:
    """One search's state: the plan, the control file, and the probes in hand."""

    def __init__(self, backend, spec: SearchSpec, say=console.say) -> None:
        self.backend, self.spec, self.say = backend, spec, say
        self.planner = Planner(spec)
        self.control = Control()  # what the child runs and the report reads
        self.e2e_ref_s: float | None = None  # mean response time at the last passing probe
        self.t0 = 0.0  # when the search began (the backend's clock)
        self.current: Watch | None = None  # the probe whose schedule runs (or just ended)
        self.behind: Watch | None = None  # a probe whose stragglers are still being judged
        self.attainment: dict = {}  # level -> class -> attainment over its pooled requests

    def run(self) -> tuple[Planner, Control]:
        self.publish()
        self.t0 = self.backend.now()
        self.backend.launch()
        try:
            if self.spec.warmup_s:
                self.warm_up()
            self.current = self.start(self.plan())
            while self.current is not None or self.behind is not None:
                self.backend.sleep(POLL_S)
                if not self.backend.alive():
                    break
                self.poll(self.backend.now())
        except BaseException:
            self.backend.abort()
            raise
        finally:
            self.control.done = True
            self.publish()
        return self.planner, self.control

    def publish(self) -> None:
        self.backend.publish(self.control)

    # -- one look at the probes in hand
    def poll(self, now: float) -> None:
        if self.behind is not None and not self.follow_behind(now):
            return
        if self.current is not None and self.follow_current(now):
            self.current = self.start(self.plan(after=self.behind))

    def follow_behind(self, now: float) -> bool:
        """Judge the probe behind; whether the current probe is to be followed too (False:
        the next probe was planned here)."""
        v, why = self.behind.step(now)
        if v is None:
            return True
        behind, self.behind = self.behind, None
        if self.settle(behind, v, why) != "pass" and self.current is not None:
            self.void(self.current, behind.probe.index)  # the guess was wrong
            self.current = None
        if self.current is None:
            self.current = self.start(self.plan())
            return False
        return True

    def follow_current(self, now: float) -> bool:
        """Judge the current probe; whether the next one starts now (it settled, or its
        schedule is over and it looks a pass: the next starts on that guess)."""
        w = self.current
        was_running = w.running(now)
        v, why = w.step(now)
        if v is not None:
            if was_running:  # cut (saturated or failed already) or ended (passed)
                if w.ended:
                    self.control.end.append(w.probe.index)
                    self.publish()
                else:
                    self.cut(w.probe.index)
            self.settle(w, v, why)
            self.current = None
            return True
        if was_running or self.behind is not None:
            return False
        self.behind, self.current = w, None  # schedule over, verdict pending
        # its estimate so far missing the target, the guess would likely be void, and a void
        # probe (a ramp 1.7x higher) leaves a backlog that fails the lower probe after it (sim
        # seed 106: 28.27 req/s failed at a capacity of 31.2 after a void 62.7 req/s probe):
        # wait for the verdict instead
        return w.promising()

    # -- the steps
    def cut(self, index: int) -> None:
        self.control.cut.append(index)
        self.publish()

    def void(self, w: Watch, after: int) -> None:
        """``w`` started assuming probe ``after`` passed, which failed: it is cut, unjudged."""
        self.control.cut.append(w.probe.index)
        entry = self.control.probes[w.probe.index]
        entry.verdict, entry.role = None, w.probe.role + " (void)"
        entry.why = f"started assuming probe {after + 1} passed"
        self.publish()

    def settle(self, w: Watch, verdict: str, why: str) -> str:
        """Record ``w``'s verdict in the plan and the control file; the settled verdict."""
        p = w.probe
        if w.detail is not None and p.role != "hold":
            self.attainment[p.level] = {c.request_class: c.attainment for c in w.detail.classes}
        verdict, why, on_estimate = self.planner.settle(p, verdict, why, w.detail)
        entry = self.control.probes[p.index]
        entry.verdict, entry.why = verdict, why
        if on_estimate:
            entry.estimate = True
        if verdict == "fail" and p.index not in self.control.cut:
            # its stragglers (a queue built above capacity) would weigh on the next probe,
            # which runs lower: they go, as misses (the verdict is settled already)
            self.control.cut.append(p.index)
        self.publish()
        if verdict == "pass":
            self.e2e_ref_s = self.backend.e2e_mean_s(p.index) or self.e2e_ref_s
            self.planner.residence_s = self.e2e_ref_s
        self.say(console.probe_line(p, verdict, why))
        return verdict

    def start(self, probe: Probe | None) -> Watch | None:
        """Ask the backend for ``probe``; its watch once it began (None: no probe, or the
        child ended first)."""
        if probe is None:
            return None
        self.control.probes.append(ProbeEntry.of(probe, target=self.spec.target,
                                                 confidence=self.spec.confidence))
        self.publish()
        t_start = self.backend.started(probe.index)
        if t_start is None:
            return None
        pooled = [q.index for q, _ in self.planner.history
                  if q.level == probe.level and probe.role != "hold" and q.role != "hold"]
        return Watch(self.backend.frames, self.backend.slo, probe, pooled, self.spec, t_start,
                     self.e2e_ref_s)

    def warm_up(self) -> None:
        """Load at the start level for ``warmup_s``, unjudged: a cold prefix cache, an empty
        batch and an idle queue are not the state a probe should measure (on the default mix
        the cold contracts' prefills failed chat's TTFT at every rate for the first minute,
        and the search put the offloaded endpoint at 3.9 req/s against its 12)."""
        s = self.spec
        probe = (Probe(0, None, s.warmup_s, "warmup", users=s.start_users) if s.closed
                 else Probe(0, s.start_rps, s.warmup_s, "warmup"))
        self.control.probes.append(ProbeEntry.of(probe, why="warm-up: not judged"))
        self.publish()
        t_start = self.backend.started(probe.index)
        if t_start is None:
            return
        while self.backend.alive() and self.backend.now() < t_start + probe.duration_s:
            self.backend.sleep(POLL_S)
        self.say(console.warmup_line(probe))

    def hold_at(self, planner: Planner) -> float | None:
        """Where the first hold goes: the crossing of the target inside the bracket, from
        the pooled attainment at its two ends (as the report reads the capacity)."""
        from kvbench.reports.analysis.capacity import crossing

        lo, hi = planner.bracket()
        if lo is None or hi is None or lo not in self.attainment or hi not in self.attainment:
            return lo
        x = crossing(lo, hi, self.attainment[lo], self.attainment[hi], self.spec.target)
        return math.floor(x) if self.spec.closed else x

    def plan(self, after: Watch | None = None) -> Probe | None:
        """The next probe (assuming ``after`` passes, if given), within the budget. With a
        hold, the bracket's next probe is skipped for the hold when both would not fit; a hold
        never starts on a guess (it goes where the bracket's verdicts put it)."""
        planner = self.planner
        if after is not None:
            planner = Planner(self.spec, list(self.planner.history), self.planner.residence_s,
                              estimated=set(self.planner.estimated))
            planner.record(after.probe, "pass")
        planner.hold_at = self.hold_at(planner)
        probe = planner.next()
        spent = self.backend.now() - self.t0
        if (probe is not None and self.spec.hold_s and probe.role != "hold"
                and not planner.holds() and planner.bracket()[0] is not None
                and spent + probe.duration_s + planner.hold_duration() > self.spec.budget_s):
            probe = planner._hold(len(planner.history), planner.bracket()[0])
        if probe is None or (after is not None and probe.role == "hold"):
            return None
        probe = replace(probe, index=len(self.control.probes))
        if spent + probe.duration_s > self.spec.budget_s:
            if not self.control.notes:
                self.control.notes.append(Note(stop="budget", after_s=round(spent, 1)))
            return None
        return probe
