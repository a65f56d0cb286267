"""One probe being judged while it runs and after (``Watch``): its verdict once it is known.

The verdict is ``reports.capacity.bounded_verdict``; while a probe runs it is cut as soon as
it is saturated (``reports.capacity.saturated``), or when its failure can no longer change
once half of it ran (a queue burst in its first seconds is one draw, not a verdict); after
its schedule, the verdict waits for its stragglers only as long as they could change it
(``settle_s`` at most), so long answers do not idle the endpoint.
"""

from __future__ import annotations

from kvbench.core.contract import SearchSpec
from kvbench.runs.search.console import why_text
from kvbench.runs.search.control import Probe


class Watch:
    """``frames(index)``: the backend's (finished requests, still running, load) of a probe,
    request frames and the load's figures (``LocustBackend.frames``); ``pooled``: earlier
    probes at the same level, whose finished requests count with this one's."""

    def __init__(self, frames, slo: dict, probe: Probe, pooled: list[int], spec: SearchSpec,
                 t_start: float, e2e_ref_s: float | None) -> None:
        self.frames, self.slo, self.probe, self.spec = frames, slo, probe, spec
        self.t_start = t_start
        self.end = t_start + probe.duration_s
        self.settle_end = self.end + spec.settle_s
        self.e2e_ref_s = e2e_ref_s
        self.kw = dict(target=spec.target, confidence=spec.confidence,
                       min_class_requests=spec.min_class_requests, seed=probe.index)
        self.old = [f for i in pooled for f in frames(i)[:1] if f is not None]
        self.cut = False
        self.ended = False  # ended early on a shown pass (its requests in flight finish)
        self.detail = None  # the last ProbeVerdict (the pessimistic one while requests run)
        self.estimate = None  # the worst class's attainment over its finished requests

    def _why(self, v) -> str:
        return why_text(v, self.spec.target, self.spec.confidence)

    def _unsteady(self, done, load: dict) -> str | None:
        """``reports.capacity.not_steady`` on this probe's sends and finishes (None where the
        backend does not give them)."""
        from kvbench.reports.analysis import verdict as C

        if "sent_s" not in load:
            return None
        w = self.e2e_ref_s
        if w is None and done is not None and len(done):
            e2e = done["e2e_ms"].to_numpy(float)
            e2e = e2e[e2e == e2e]
            w = float(e2e.mean()) / 1e3 if len(e2e) else None
        return C.not_steady(load["sent_s"], load["done_s"], load["now_s"],
                            self.probe.duration_s, w)

    def running(self, now: float) -> bool:
        return now < self.end and not self.cut and not self.ended

    def promising(self) -> bool:
        """Whether the finished requests point to a pass (the worst class's attainment over
        them meets the target): only then does the next probe start before this one's verdict
        is known. (Its requests still running are no evidence either way: counting them as
        misses, as the pessimistic verdict does, held every probe with long answers back, and
        the endpoint idled 16 s of a 55 s budget waiting for them.)"""
        return self.estimate is not None and self.estimate >= self.spec.target

    def step(self, now: float) -> tuple[str | None, str]:
        """(verdict, why) once the verdict is known; (None, "") before."""
        import pandas as pd

        from kvbench.reports.analysis import verdict as C

        done, pending, load = self.frames(self.probe.index)
        frames = self.old + ([done] if done is not None else [])
        d = pd.concat(frames, ignore_index=True) if frames else None
        if d is None:
            if now > self.settle_end:
                return "fail", "no request of the probe finished"
            return None, ""
        p = pending if pending is not None else d.iloc[0:0]
        decided, v = C.bounded_verdict(d, p, self.slo, **self.kw)
        self.detail = v
        self.estimate = _worst_finished(d)
        if self.probe.role == "hold":
            return self._hold(now, v, p, done, load)
        if now < self.end:
            return self._while_running(now, decided, v, load)
        return self._after(now, decided, v, done, load, 0 if pending is None else len(pending))

    def _hold(self, now: float, v, pending, done, load: dict) -> tuple[str | None, str]:
        """A hold's verdict: it holds when its attainment estimate (every class's share of
        its requests within SLO, the worst class's) meets the target and no backlog grew over
        its second half; not a bootstrap bound: the hold asks whether the endpoint sustains
        the rate, the brackets' probes already showed where it crosses. Cut once it cannot
        hold whatever its requests still running do (after half its length: one early burst
        is one draw), or once saturated."""
        from kvbench.reports.analysis import verdict as C

        target = self.spec.target
        running = {}
        if len(pending):
            running = pending["request_class"].astype(str).value_counts().to_dict()
        elapsed = now - self.t_start
        # the requests its schedule still sends, each class in its share so far
        more = max(0.0, self.probe.duration_s / max(elapsed, 1e-9) - 1.0)
        worst_hi, worst_lo, who = 1.0, 1.0, None
        for c in v.classes:  # pessimistic counts: requests still running are misses
            n_run = running.get(c.request_class, 0)
            n_more = c.requests * more
            hi = ((c.met + n_run + n_more) / (c.requests + n_more)) if c.requests else 1.0
            lo = c.met / c.requests if c.requests else 1.0
            if c.requests and hi < target:
                who = c
            worst_hi, worst_lo = min(worst_hi, hi), min(worst_lo, lo)
        detail = (lambda: f"worst class {v.worst.request_class}: {v.worst.met}/"
                  f"{v.worst.requests} within SLO" if v.worst is not None else "no request")
        if now < self.end:
            sat = None if self.probe.users is not None else (
                C.saturated(load["pending_ages_s"], elapsed, self.probe.rate_rps,
                            self.e2e_ref_s, load["lateness_ms"])
                or C.short_of_offered(load["sent"], elapsed, self.probe.rate_rps))
            if sat or (who is not None and elapsed >= self.probe.duration_s / 2):
                self.cut = True
                why = (f"saturated: {sat}" if sat else
                       f"worst class {who.request_class}: {who.met}/{who.requests} within "
                       f"SLO, under the target {target:.0%} even if the rest all meet it")
                return "fail", f"did not hold, cut after {elapsed:.1f} s: {why}"
            return None, ""
        unsteady = self._unsteady(done, load) if self.probe.users is None else None
        if unsteady:
            return "fail", f"did not hold: {unsteady} ({detail()})"
        if worst_hi < target:
            return "fail", f"did not hold: {detail()}, under the target {target:.0%}"
        if worst_lo >= target or now > self.settle_end:
            if worst_lo < target:
                return "fail", (f"did not hold: {detail()}, under the target {target:.0%} "
                                f"with its requests still running {self.spec.settle_s:g} s "
                                "after it counted as misses")
            return "pass", (f"held {self.probe.duration_s:g} s: {detail()} (estimate "
                            f"{worst_lo:.3f}, target {target:.0%}), no backlog growing")
        return None, ""

    def _while_running(self, now: float, decided, v, load: dict) -> tuple[str | None, str]:
        from kvbench.reports.analysis import verdict as C

        elapsed = now - self.t_start
        # (a closed loop cannot outrun its endpoint: its users wait for their answers, so no
        # queue grows beyond them and nothing is offered that was not sent)
        sat = None if self.probe.users is not None else (
            C.saturated(load["pending_ages_s"], elapsed, self.probe.rate_rps,
                        self.e2e_ref_s, load["lateness_ms"])
            or C.short_of_offered(load["sent"], elapsed, self.probe.rate_rps))
        # (whether it is steady is judged at its end, over the whole second half: near
        # capacity a queue's burst over a second or two looked like a growing backlog and cut
        # a probe at 93% of the capacity after 3 s, search_truth seed 101)
        # a failure is cut once half the probe ran: a queue burst in its first second or two
        # is all a shorter sample holds, and one burst is one draw, whatever the number of
        # requests it spans (saturation is cut at once)
        if sat or (decided == "fail" and elapsed >= self.probe.duration_s / 2):
            self.cut = True
            why = f"saturated: {sat}" if sat else self._why(v)
            return "fail", f"cut after {elapsed:.1f} s: {why}"
        # a ramp probe that has shown its pass (not thinly) after half its length ends there:
        # far below the capacity the rest would only spend the budget the bisection needs
        # (its requests in flight finish)
        if (decided == "pass" and self.probe.role == "ramp"
                and elapsed >= self.probe.duration_s / 2
                and not any(c.thin for c in v.classes)):
            self.ended = True
            return "pass", f"ended after {elapsed:.1f} s, shown: {self._why(v)}"
        return None, ""

    def _after(self, now: float, decided, v, done, load: dict,
               n_pend: int) -> tuple[str | None, str]:
        if decided == "pass":
            # its latencies passed, but a backlog still building would fail them later. Near
            # capacity a queue also wanders for longer than a probe (an M/M/4 at 90% of its
            # capacity looked unsteady in 5% of 10 s probes), so a first sign is refined (the
            # rate probed again, pooled) and only a refinement or confirmation that still
            # shows it fails
            unsteady = self._unsteady(done, load) if self.probe.users is None else None
            if unsteady and (self.probe.role in ("refine", "confirm") or not self.spec.refine):
                return "fail", f"not steady again: {unsteady} ({self._why(v)})"
            if unsteady:
                return "straddle", f"not steady: {unsteady} ({self._why(v)})"
        if decided is not None:
            return decided, self._why(v) + (f" ({n_pend} still running: the verdict holds "
                                            "whatever their outcome)" if n_pend else "")
        if now > self.settle_end:  # stragglers still running: they missed their chance
            return v.verdict, (self._why(v) + f" ({n_pend} still running "
                               f"{self.spec.settle_s:g} s after the probe: counted as "
                               "misses)")
        return None, ""


def _worst_finished(d) -> float | None:
    """The lowest attainment of a class with an SLO over its finished requests (``d``: request
    frame rows), None when none finished."""
    judged = d[d["has_slo"].to_numpy(bool)]
    if not len(judged):
        return None
    met = judged["slo_met"].to_numpy(bool) & judged["ok"].to_numpy(bool)
    return float(judged.assign(_met=met).groupby("request_class", observed=True)["_met"]
                 .mean().min())
