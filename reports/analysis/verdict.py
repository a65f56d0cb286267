"""The verdict of one probe of a capacity search, and the tests that cut a probe early (a
saturated endpoint, an unsteady queue). Pure pandas/numpy: ``kvbench.runs.search`` calls it
while it searches, ``capacity`` on the finished run.

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

from kvbench.core.contract import SLO, slo_map
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
