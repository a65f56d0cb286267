"""Capacity at SLO: the verdict of one probe of a capacity search, and the capacity a search
found, from the probes' requests. Pure pandas/numpy: ``kvbench.runs.search`` calls it while
it searches, the report calls it on the finished run.

A probe is judged per request class that has an SLO: its attainment (requests within every SLO
of the class, over the class's requests of the probe) gets a smoothed bootstrap interval
(draws from the proportion's Jeffreys posterior, ``resampling.proportion_replicates``: the
plain bootstrap of a class whose every request met its SLO is the point 1.0, however few they
were). The class *passes* when the interval's lower bound clears the target, *fails* when its
upper bound misses it, and *straddles* otherwise (also when it has fewer than
``min_class_requests`` requests and has not failed). A class whose every request met its SLO
but too few to show the target at the confidence asked *passes thinly*: nothing it sent says
it misses, nothing says it meets the target either; the search moves on and the report marks
the capacity it supports as thin, with the requests it would take (``needed_for``).
Misses near capacity come in bursts (a queue that builds for seconds), so a probe's requests
are not independent draws: the interval is computed on the class's *effective* number of
requests (``effective_n``: its requests over the integrated autocorrelation time of the miss
indicator in arrival order), without which a short probe that caught one burst, or none,
looks conclusive. The probe passes when every class passes, fails when any class fails, and
straddles otherwise. A request cancelled in a probe (a cut at saturation, or still unanswered when the
search moved on) counts as a miss: it was not served within its SLO.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvbench.core.contract import SLO, StageEntry, slo_map
from kvbench.reports.statistics import resampling

TARGET = 0.95
CONFIDENCE = 0.95
RESAMPLES = 2000
SLO_KINDS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"))


@dataclass
class ClassVerdict:
    request_class: str
    requests: int
    met: int
    attainment: float
    low: float
    high: float
    verdict: str  # pass | fail | straddle
    thin: bool = False  # passed with every request within SLO, too few to show the target
    missed: str | None = None  # the SLO missed most often: TTFT, TPOT, E2E or "errors"
    misses: dict = field(default_factory=dict)  # SLO kind -> requests that missed it
    effective: float | None = None  # independent requests they are worth (None: all met)


@dataclass
class ProbeVerdict:
    verdict: str  # pass | fail | straddle | empty
    classes: list  # [ClassVerdict], worst attainment first

    @property
    def worst(self) -> ClassVerdict | None:
        """The class that decides the verdict: the first failing one, else the lowest."""
        failing = [c for c in self.classes if c.verdict == "fail"]
        return failing[0] if failing else self.classes[0] if self.classes else None


def _limit(slo: SLO | None, key: str) -> float | None:
    """The class's limit on ``key`` (``ttft_ms``, ...) in ms; None: no SLO or no limit."""
    v = None if slo is None else getattr(slo, key)
    return None if v is None else float(v)


def misses_by_slo(sub: pd.DataFrame, slo: dict[str, SLO], cls: str) -> dict:
    """How many of a class's requests missed each of its SLOs (and how many failed)."""
    out = {}
    ok = sub["ok"].to_numpy()
    n_bad = int((~ok).sum())
    if n_bad:
        out["errors or cut"] = n_bad
    for key, name in SLO_KINDS:
        limit = _limit(slo.get(cls), key)
        if limit is None:
            continue
        v = sub[key].to_numpy(np.float64)
        out[name] = int((ok & (v > limit)).sum())
    return out


def effective_n(flags: np.ndarray) -> float:
    """How many independent requests ``flags`` (within SLO or not, in arrival order) are
    worth: n / tau, tau the integrated autocorrelation time of the miss indicator (1 + twice
    the sum of its autocorrelations, summed in pairs while the pairs stay positive: Geyer's
    initial positive sequence). Misses spread at random give tau about 1; a burst of k misses
    in a row gives about k. n itself when every request met its SLO or none did (no
    variation to measure)."""
    x = np.asarray(flags, np.float64)
    n = len(x)
    p = x.mean() if n else 0.0
    if n < 4 or p in (0.0, 1.0):
        return float(n)
    d = x - p
    m = 1 << int(np.ceil(np.log2(2 * n)))
    f = np.fft.rfft(d, m)
    acov = np.fft.irfft(f * np.conj(f), m)[:n] / n
    rho = acov / acov[0]
    tau = -1.0
    for k in range(0, n - 1, 2):
        pair = rho[k] + rho[k + 1]
        if pair <= 0:
            break
        tau += 2.0 * pair
    tau = min(max(tau, 1.0), float(n))
    return n / tau


def class_verdict(flags: np.ndarray, cls: str, *, target: float = TARGET,
                  confidence: float = CONFIDENCE, min_requests: int = 1,
                  rng: np.random.Generator | None = None) -> ClassVerdict:
    """The verdict on one class from its per-request "within SLO" flags, in arrival order
    (the interval is that of their ``effective_n``)."""
    flags = np.asarray(flags, bool)
    n = len(flags)
    if n == 0:
        return ClassVerdict(cls, 0, 0, math.nan, math.nan, math.nan, "straddle")
    rng = rng if rng is not None else np.random.default_rng(0)
    met = int(flags.sum())
    est = met / n
    eff = effective_n(flags)
    ci = resampling.proportion_interval(est * eff, eff, RESAMPLES, rng, confidence)
    thin = False
    if ci.high < target:
        verdict = "fail"
    elif n >= min_requests and (ci.low >= target or met == n):
        verdict, thin = "pass", ci.low < target
    else:
        verdict = "straddle"
    return ClassVerdict(cls, n, met, est, ci.low, ci.high, verdict, thin,
                        effective=round(eff, 1) if 0 < met < n else None)


@functools.lru_cache(maxsize=64)
def needed_for(target: float = TARGET, confidence: float = CONFIDENCE) -> int:
    """The fewest requests, all within SLO, whose interval's lower bound clears ``target``
    (48 at 95% / 95%): fewer pass only thinly."""
    rng = np.random.default_rng(0)
    a = (1 - confidence) / 2
    n = 1
    while n < 100_000:
        if np.quantile(rng.beta(n + 0.5, 0.5, size=RESAMPLES), a) >= target:
            return n
        n = n + 1 if n < 200 else int(n * 1.05)
    return n


def thin_text(classes, target: float = TARGET, confidence: float = CONFIDENCE) -> str:
    """"agent 5/5, rag 9/9 (48 needed each to show 95%)" for the thinly passing classes."""
    thin = [c for c in classes if c.thin]
    if not thin:
        return ""
    return (", ".join(f"{c.request_class} {c.met}/{c.requests}" for c in thin)
            + f" ({needed_for(target, confidence)} needed each to show {target:.0%} at "
              f"{confidence:.0%} confidence)")


def probe_verdict(frame: pd.DataFrame, slo: dict, *, target: float = TARGET,
                  confidence: float = CONFIDENCE, min_class_requests: int = 1,
                  seed: int = 0) -> ProbeVerdict:
    """The verdict on a probe's requests (``reports.frame.request_frame`` rows: request_class,
    ok, cancelled, slo_met, has_slo and the latency columns). Only classes with an SLO count.
    ``slo``: by class, ``SLO``s or the config's ``[slo.*]`` tables as run.json keeps them."""
    slo = slo_map(slo)
    rng = np.random.default_rng(seed)
    judged = frame[frame["has_slo"].to_numpy(bool)] if len(frame) else frame
    if "t_scheduled" in judged.columns and len(judged):  # arrival order (effective_n)
        judged = judged.sort_values("t_scheduled", kind="stable")
    classes = []
    for cls, sub in judged.groupby("request_class", observed=True, sort=True):
        if not len(sub):
            continue
        flags = sub["slo_met"].to_numpy(bool) & sub["ok"].to_numpy(bool)
        cv = class_verdict(flags, str(cls), target=target, confidence=confidence,
                           min_requests=min_class_requests, rng=rng)
        cv.misses = misses_by_slo(sub, slo, str(cls))
        # the SLO answered requests missed most; errors and cuts only when none missed one
        slos = {k: n for k, n in cv.misses.items() if k != "errors or cut" and n}
        worst = max(slos.items(), key=lambda kv: kv[1], default=(None, 0))
        cv.missed = worst[0] if worst[1] else ("errors or cut" if cv.misses.get(
            "errors or cut") else None)
        classes.append(cv)
    if not classes:
        return ProbeVerdict("empty", [])
    classes.sort(key=lambda c: (c.attainment, c.low, c.request_class))  # ties: the thinnest
    verdicts = {c.verdict for c in classes}
    v = "fail" if "fail" in verdicts else "pass" if verdicts == {"pass"} else "straddle"
    return ProbeVerdict(v, classes)


def bounded_verdict(done: pd.DataFrame, pending: pd.DataFrame, slo: dict,
                    **kw) -> tuple[str | None, ProbeVerdict]:
    """The verdict on a probe with requests still running (``pending``: rows of the same
    shape, any outcome): decided when it is the same whether they all meet their SLOs or all
    miss them (None otherwise), with the pessimistic verdict's detail."""
    if not len(pending):
        v = probe_verdict(done, slo, **kw)
        return v.verdict, v
    good = pending.assign(ok=True, cancelled=False, slo_met=True)
    bad = pending.assign(ok=False, cancelled=True, slo_met=False)
    hi = probe_verdict(pd.concat([done, good], ignore_index=True), slo, **kw)
    lo = probe_verdict(pd.concat([done, bad], ignore_index=True), slo, **kw)
    if lo.verdict != hi.verdict:
        return None, lo
    # a pass that holds when they all miss: the pessimistic detail; a failure (or straddle)
    # that holds when they all succeed: the optimistic one names what really missed
    return lo.verdict, (lo if lo.verdict == "pass" else hi)


# How long a finished request can take to show in the records a search reads while it runs
# (the record shards flush about every 0.5 s, the search reads them every 0.5 s)
RECORD_LAG_S = 1.0


def saturated(pending_ages_s, elapsed_s: float, rate_rps: float, e2e_ref_s: float | None,
              lateness_ms: float | None = None) -> str | None:
    """Why a running probe is saturated (None: not saturated as far as can be told): ten or
    more of its requests still unanswered long after a steady state would have answered them
    (four times the mean response time of the last passing probe, and at least a second, plus
    the records' own lag), so the queue grows; or the load generator sending late (it cannot
    keep up with the schedule). ``pending_ages_s``: how long ago each of the probe's requests
    without a record was sent. (Counting every request without a record, as this first did,
    took the records' lag for a queue: at 28 req/s a second of lag is 28 "in flight".)"""
    import numpy as np

    if lateness_ms is not None and lateness_ms > 500:
        return f"the load generator sends {lateness_ms:.0f} ms late (median, last second)"
    if e2e_ref_s is None or elapsed_s < 2 * max(1.0, e2e_ref_s):
        return None
    stuck_after = RECORD_LAG_S + max(1.0, 4 * e2e_ref_s)
    stuck = int((np.asarray(pending_ages_s, float) > stuck_after).sum())
    if stuck >= 10:
        return (f"{stuck} requests unanswered after {stuck_after:.1f} s (the last passing "
                f"probe answered in {e2e_ref_s:.2f} s on average): the queue grows")
    return None


def in_flight_at(sent_s, done_s, t_s: float) -> int:
    """A probe's requests in flight at ``t_s`` (seconds from its start): sent by then and not
    finished by then (``done_s``: each request's finish, NaN while it runs)."""
    import numpy as np

    sent = np.asarray(sent_s, float)
    done = np.asarray(done_s, float)
    return int((sent <= t_s).sum() - (done <= t_s).sum())


def not_steady(sent_s, done_s, now_s: float, end_s: float, residence_s: float | None
               ) -> str | None:
    """Why a probe has not reached a steady state (None: it has, or it cannot be told yet):
    its requests in flight kept growing over the second half of the time it ran, beyond
    what Poisson arrivals explain. Below capacity the number in flight settles at rate x
    mean response time (Little's law) within a few response times; above it, it grows by
    the shortfall every second. An endpoint with room to admit (KV memory, a batch of 256)
    keeps its first tokens fast for tens of seconds while that backlog builds: a short
    probe's latencies pass a rate it cannot sustain (the default bake-off's offloaded
    endpoint passed 25 req/s in 6 s where 16 req/s fails after 20 s of load).

    Judged from 1.5 residence times on (``residence_s``: the mean response time, the fill-up
    before it), over the latest time the records show (``now_s`` less their lag, at most
    ``end_s``, the schedule's end, after which arrivals stop): the mean count over the first
    quarter of the second half against the mean over its last quarter. Means over quarters,
    not the counts at two instants: near capacity a queue comes and goes in bursts, and two
    instants 1-5 s apart called a steady endpoint at 80-95% of its capacity unsteady in 5-20%
    of 10 s probes (an M/M/4 queue; on the real path it cut a probe at 93% of the capacity
    after 3 s), which biased the search low."""
    import math

    import numpy as np

    if residence_s is None or not math.isfinite(residence_s):
        return None
    t1 = min(now_s - RECORD_LAG_S, end_s)
    t0 = t1 / 2
    if t0 < 1.5 * residence_s or t1 - t0 < 1.0:
        return None
    q = (t1 - t0) / 4
    sent = np.sort(np.asarray(sent_s, float))
    done = np.sort(np.asarray(done_s, float))  # NaN (still running) sorts last, never counted

    def mean_in_flight(a: float, b: float) -> float:
        ts = np.linspace(a, b, 25)
        return float(np.mean(np.searchsorted(sent, ts, "right")
                             - np.searchsorted(done, ts, "right")))

    means = [mean_in_flight(t0 + k * q, t0 + (k + 1) * q) for k in range(4)]
    m0, m1 = means[0], means[-1]
    if any(b <= a for a, b in zip(means, means[1:])):
        return None  # not rising quarter after quarter: a queue's burst, not a backlog
    rate = in_flight_at(sent_s, [], t1) / max(t1, 1e-9)
    level = rate * residence_s  # Little's law: the steady number in flight
    # a count is about Poisson(level) in a steady state: two means over quarters differ by
    # more than 3 sd (of the difference of two counts) and a fifth of the level only when
    # the count grows
    allowed = 3 * math.sqrt(2 * max(level, 1.0)) + 0.2 * level
    if m1 - m0 > allowed:
        return (f"in flight grew from {m0:.0f} to {m1:.0f} between {t0:.1f} s and {t1:.1f} s "
                f"(quarter means; steady: about {level:.0f}, rate x mean response time "
                f"{residence_s:.1f} s): the endpoint falls behind")
    return None


def short_of_offered(sent: int, elapsed_s: float, rate_rps: float) -> str | None:
    """Why the load generator is not offering the probe's rate (None: it is): it sent
    clearly fewer requests than the rate asks for (``overload.verdict``'s test: dropped at
    its in-flight cap, or too busy to send on time), so the endpoint is not being offered
    the rate the probe claims."""
    from kvbench.reports.analysis import overload

    if elapsed_s < 2.0:
        return None
    below, _ = overload.verdict(sent, int(rate_rps * elapsed_s), elapsed_s, rate_rps)
    if below:
        return (f"the load generator sent {sent} requests in {elapsed_s:.1f} s, not the "
                f"{rate_rps * elapsed_s:.0f} the rate asks for (in-flight cap or its own CPU)")
    return None


# --------------------------------------------------------------------------- the result

@dataclass
class Capacity:
    """What a search found for one endpoint x workload."""

    endpoint: str
    workload: str
    capacity_rps: float | None  # the highest passing rate (None: even the lowest failed)
    fail_rps: float | None  # the lowest failing rate above it (None: never failed)
    status: str  # bracketed | no pass | no failure | budget
    probes: int
    load_s: float
    breaks: dict | None  # {class, missed, attainment, low, high, rate_rps} at the first fail
    at_capacity: dict | None  # {attainment low/high of the worst class, output_tps, ...}
    # The interval the search showed: from the highest rate whose pass its bootstrap interval
    # showed to the lowest failure above the capacity so shown (None: none shown). A rate
    # still straddling after its refinement is settled on its estimate: it sets the capacity
    # or the first failure, but lies inside this interval, whose ends were shown.
    low_rps: float | None = None
    high_rps: float | None = None
    # The capacity at SLO itself: where the attainment crosses the target between the highest
    # passing rate and the lowest failing one (``crossing``); the highest passing rate where
    # the search found no failure (a lower bound: status "no failure"); None: no pass
    estimate_rps: float | None = None
    # what the search varied: "req/s" (open loop, offered Poisson rate) or "users" (closed
    # loop: the fields named *_rps then hold numbers of users, the concurrency at SLO)
    unit: str = "req/s"

    @property
    def interval_text(self) -> str:
        lo = "–" if self.low_rps is None else f"{self.low_rps:g}"
        return f"{lo} – {self.high_rps:g}" if self.high_rps is not None else f"≥ {lo}"


def class_attainment(rows: pd.DataFrame) -> dict[str, float]:
    """Each class with an SLO: the share of its requests (``rows``, request frame rows) within
    every SLO of the class; errors and cancelled requests are misses, as in a verdict."""
    judged = rows[rows["has_slo"].to_numpy(bool)] if len(rows) else rows
    if not len(judged):
        return {}
    met = judged["slo_met"].to_numpy(bool) & judged["ok"].to_numpy(bool)
    g = judged.assign(_met=met).groupby("request_class", observed=True)["_met"].mean()
    return {str(k): float(v) for k, v in g.items()}


def crossing(lo: float, hi: float, at_lo: dict, at_hi: dict, target: float = TARGET) -> float:
    """The rate between ``lo`` (passed) and ``hi`` (failed) at which the first class's
    attainment reaches ``target``: per class, linear in rate between its pooled attainment at
    the two ends (``at_lo``, ``at_hi``: class -> attainment), as a fixed-rate sweep reads its
    capacity between two of its rates; the lowest over the classes, within [lo, hi].

    Why not the highest passing rate: the bisection's rates fall where the start rate and the
    growth put them, so the pass below the crossing lies anywhere up to ``precision`` under it
    (about half of it on average; ground truth, bench/search_truth.py: -4% median). Two
    endpoints' highest passes differ by their grids as much as by their capacities. The
    crossing uses the attainment measured at both ends instead; the bracket stays its
    interval. A class at or above the target at ``hi`` does not cross in the bracket
    (``hi``); one under it at ``lo`` (a pass settled on its estimate) crosses at ``lo``."""
    out = hi
    for cls in set(at_lo) | set(at_hi):
        a, b = at_lo.get(cls, 1.0), at_hi.get(cls, 1.0)
        if a != a or b != b or b >= target:
            continue
        x = lo if a <= target else lo + (a - target) / (a - b) * (hi - lo)
        out = min(out, x)
    return float(min(max(out, lo), hi))


def level(stage: StageEntry) -> float | None:
    """What a probe (a run.json stage) was run at: its offered rate, or its number of users
    for a closed-loop probe."""
    if stage.rate_rps is None and stage.users is not None:
        return stage.users
    return stage.rate_rps


def summarise(stages: list[StageEntry], frame: pd.DataFrame, slo: dict,
              **kw) -> list[Capacity]:
    """One ``Capacity`` per searched endpoint x workload: from run.json's stages (their
    ``search`` notes: rate and verdict each probe got, the target it was judged against) and
    the probes' requests (``frame``: ``reports.frame.request_frame`` of the run), the bracket
    between the highest passing rate and the lowest failing one, the capacity at SLO within
    it (``crossing``), the class that broke first and which SLO it missed. A closed-loop
    search's levels are numbers of users: its capacity is the whole number of users at the
    crossing (at least the highest passing one), in ``Capacity.unit`` "users"."""
    out = []
    searched = [s for s in stages if s.search is not None]
    keys = sorted({(s.endpoint, s.workload) for s in searched})
    for ep, wl in keys:
        probes = [s for s in searched if (s.endpoint, s.workload) == (ep, wl)]
        kw_ep = dict(kw)
        for key in ("target", "confidence"):  # the search's own, where its notes say it
            v = next((getattr(p.search, key) for p in probes if getattr(p.search, key)), None)
            if v is not None and key not in kw:
                kw_ep[key] = float(v)
        sub = frame[(frame["endpoint"].astype(str) == ep) & (frame["workload"].astype(str) == wl)]
        closed = any(s.rate_rps is None and s.users is not None for s in probes)
        # a rate's settled verdict is its last probe's (a refinement or confirmation pools
        # the earlier probes at that rate): a pass refuted by its confirmation is a failure
        settled, shown = {}, {}
        for s in sorted(probes, key=lambda s: s.index):
            if s.search.verdict in ("pass", "fail"):
                settled[level(s)] = s.search.verdict
                shown[level(s)] = not s.search.estimate
        passes = [r for r, v in settled.items() if v == "pass"]
        fails = [r for r, v in settled.items() if v == "fail"]
        cap = max(passes) if passes else None
        above = [r for r in fails if cap is None or r > cap]
        fail = min(above) if above else None
        shown_passes = [r for r in passes if shown[r]]
        low = max(shown_passes) if shown_passes else None
        high = min((r for r in fails if shown[r] and (low is None or r > low)), default=None)
        notes = {s.search.stop for s in probes if s.search.stop}
        status = ("no pass" if cap is None else "no failure" if fail is None else "bracketed")
        if "budget" in notes:
            status += " (budget)"
        breaks = None
        if fail is not None:
            idx = [s.index for s in probes if level(s) == fail]
            rows = sub[np.isin(sub["stage"], idx)]
            v = probe_verdict(rows, slo, **kw_ep)
            w = next((c for c in v.classes if c.verdict == "fail"), v.worst)
            # the class that broke is the one whose answered requests missed: a failed
            # probe's stragglers are cut once its verdict is settled, and counting them would
            # name the class with the longest answers ("errors or cut") instead (the default
            # bake-off named longctx where chat's TTFT had failed the probe)
            done = rows[~rows["cancelled"].to_numpy(bool)] if "cancelled" in rows else rows
            if len(done) and len(done) < len(rows):
                vd = probe_verdict(done, slo, **kw_ep)
                wd = next((c for c in vd.classes if c.verdict != "pass"), None)
                if wd is not None and wd.missed not in (None, "errors or cut"):
                    w = wd
            if w is not None:
                breaks = {"class": w.request_class, "missed": w.missed,
                          "attainment": w.attainment, "low": w.low, "high": w.high,
                          "rate_rps": fail, "misses": w.misses}
        at = None
        if cap is not None:
            idx = [s.index for s in probes if level(s) == cap]
            rows = sub[np.isin(sub["stage"], idx)]
            v = probe_verdict(rows, slo, **kw_ep)
            wall = sum(_ran_s(s) for s in probes if level(s) == cap)
            out_tok = float(np.nansum(rows.loc[rows["ok"], "completion_tokens"]))
            w = v.worst
            at = {"worst_class": w.request_class if w else None,
                  "attainment": w.attainment if w else math.nan,
                  "low": w.low if w else math.nan, "high": w.high if w else math.nan,
                  "thin": thin_text(v.classes, kw_ep.get("target", TARGET),
                                    kw_ep.get("confidence", CONFIDENCE)),
                  "output_tps": out_tok / wall if wall > 0 else math.nan,
                  # requests answered a second (closed loop: what its users got through)
                  "achieved_rps": (int(rows["ok"].sum()) / wall if wall > 0 else math.nan),
                  "output_tokens_per_request": (out_tok / max(1, int(rows["ok"].sum()))),
                  # its pass is the pooled estimate's, the interval straddling the target
                  "estimate": any(s.search.estimate for s in probes if level(s) == cap)}
        estimate = cap
        if cap is not None and fail is not None:
            def pooled(rate):
                idx = [s.index for s in probes if level(s) == rate]
                return class_attainment(sub[np.isin(sub["stage"], idx)])

            estimate = crossing(cap, fail, pooled(cap), pooled(fail),
                                kw_ep.get("target", TARGET))
            if closed:  # whole users: the most the interpolation says meet the target
                estimate = float(max(cap, math.floor(estimate + 1e-9)))
        out.append(Capacity(ep, wl, cap, fail, status, len(probes),
                            float(sum(_ran_s(s) for s in probes)), breaks, at, low, high,
                            estimate, "users" if closed else "req/s"))
    return out


def capacity_text(cap: Capacity, fmt, unit: bool = False) -> str:
    """The capacity at SLO in words, as the report's capacity table and kvbench run's line
    both show it: the estimate, "≥" it where nothing failed (a lower bound), "–" where nothing
    passed; a closed loop's in whole users, with the requests a second its users got answered
    there. ``fmt(x[, "count"])``: the report's number format (``reports.render.fmt``, passed
    in: render imports this module); ``unit``: the unit follows the number."""
    closed = cap.unit == "users"
    est = cap.estimate_rps

    def num(x):
        return fmt(x, "count") if closed else fmt(x)  # whole users

    text = num(est) if cap.fail_rps is not None or est is None else f"≥ {num(est)}"
    if unit and est is not None:
        text += f" {cap.unit}"
    got = (cap.at_capacity or {}).get("achieved_rps")
    if closed and got is not None and got == got:
        text += f" ({fmt(got)} req/s answered at {num(cap.capacity_rps)} users)"
    return text


def _ran_s(stage: StageEntry) -> float:
    """The seconds a probe really sent load: from its start to its end (a cut or an early
    pass ends it before its planned ``duration_s``)."""
    if stage.t_end_ns is None or stage.t_start_ns is None:
        return float(stage.duration_s or 0)
    return max(0.0, (int(stage.t_end_ns) - int(stage.t_start_ns)) / 1e9)


def per_gpu_and_cost(cap: Capacity, gpus: int | None, gpu_hour_cost: float | None) -> dict:
    """Capacity per GPU (req/s), output tokens/s per GPU and cost per million output tokens
    at the capacity at SLO (``Capacity.estimate_rps``; its output tokens/s are those measured
    at the highest passing rate, scaled to it: the same requests, offered faster);
    ``gpu_hour_cost`` per GPU; None where unknown."""
    out = {"capacity_per_gpu": None, "output_tps_per_gpu": None, "usd_per_mtok": None,
           "capacity_per_usd_hour": None}
    rps = cap.estimate_rps if cap.estimate_rps is not None else cap.capacity_rps
    if rps is None or not gpus:
        return out
    out["capacity_per_gpu"] = rps / gpus
    tps = (cap.at_capacity or {}).get("output_tps")
    if tps is not None and cap.capacity_rps:
        tps = tps * rps / cap.capacity_rps
    if tps is not None and tps == tps and tps > 0:
        out["output_tps_per_gpu"] = tps / gpus
        if gpu_hour_cost:
            out["usd_per_mtok"] = gpus * gpu_hour_cost / (tps * 3600) * 1e6
    if gpu_hour_cost:
        out["capacity_per_usd_hour"] = rps / (gpus * gpu_hour_cost)
    return out
