"""Offered rate against achieved throughput, per stage (or any grouping): is the endpoint
keeping up with the load it was offered?

A stage offers ``n`` requests over its schedule window (``offered_rps``); the endpoint
completes them over the achieved interval, from the stage's first send to its last completion
(``throughput_rps``), and starts them (first token) over the interval from the first send to
the last first token (``started_rps``). An endpoint that keeps up finishes the stage about one
response time after its last arrival: achieved falls below offered by the longest answer's
decode (the default bake-off's 10 s stages hold 1,024-token answers of 15 s), but first tokens
keep to the schedule. Under overload requests queue before their prefill: the backlog drains
long after the schedule ended and both fall far below offered. The verdict is a one-sided
Poisson test on each: clearly below when more than ``SHORTFALL`` below offered and seeing so
few requests at ``1 - SHORTFALL`` of the offered rate over the interval has probability under
``ALPHA``; overloaded when both are (definition "overloaded" in
``reports.metrics.DEFINITIONS``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from kvbench.reports.statistics import metrics as M

SHORTFALL = 0.2  # achieved more than 20% below offered ...
ALPHA = 0.01  # ... and a Poisson p-value of so few completions under 1%
MIN_SCHEDULED = 10  # fewest scheduled requests for a verdict


EXACT_MAX = 1_000_000  # above this many requests the Poisson tail is approximated


def poisson_cdf(k: int, mu: float) -> float:
    """P(X <= k) for X ~ Poisson(mu): summed in log space up to ``EXACT_MAX``, above it the
    Wilson-Hilferty approximation (``poisson_cdf_approx``)."""
    if mu <= 0:
        return 1.0
    if k < 0:
        return 0.0
    if k > EXACT_MAX:
        return poisson_cdf_approx(k, mu)
    ks = np.arange(int(k) + 1, dtype=np.float64)
    log_fact = np.cumsum(np.log(np.maximum(ks, 1.0)))  # log k!
    logp = ks * math.log(mu) - mu - log_fact  # log pmf
    top = float(logp.max())
    return float(min(1.0, math.exp(top) * np.exp(logp - top).sum()))


def poisson_cdf_approx(k: int, mu: float) -> float:
    """P(X <= k) = P(Gamma(k + 1) > mu), by the Wilson-Hilferty cube-root normal
    approximation of the gamma distribution (relative error far below the tests' 1% at
    the counts it is used for)."""
    a = k + 1.0
    z = ((mu / a) ** (1 / 3) - (1 - 1 / (9 * a))) / math.sqrt(1 / (9 * a))
    return 0.5 * math.erfc(z / math.sqrt(2))


def shortfall_p(count: int, window_s: float, offered_rps: float,
                shortfall: float = SHORTFALL) -> float:
    """The probability of ``count`` or fewer completions over ``window_s`` when the endpoint
    completes at ``(1 - shortfall)`` of ``offered_rps`` (small: clearly below offered)."""
    if not (window_s > 0 and offered_rps > 0):
        return math.nan
    return poisson_cdf(int(count), (1 - shortfall) * offered_rps * window_s)


def verdict(count: int, scheduled: int, window_s: float, offered_rps: float,
            shortfall: float = SHORTFALL, alpha: float = ALPHA) -> tuple[bool | None, float]:
    """(clearly below, p-value) for ``count`` requests over ``window_s`` against the offered
    rate; None when there is no verdict (no offered rate, too few requests)."""
    if scheduled < MIN_SCHEDULED or not (offered_rps > 0) or not (window_s > 0):
        return None, math.nan
    achieved = count / window_s
    p = shortfall_p(count, window_s, offered_rps, shortfall)
    return bool(achieved < (1 - shortfall) * offered_rps and p < alpha), p


def rates(frame: pd.DataFrame, by: Sequence[str] = ("endpoint", "workload", "stage"),
          shortfall: float = SHORTFALL, alpha: float = ALPHA) -> pd.DataFrame:
    """One row per group of ``by``: scheduled, completed, started (first token) and good
    request counts, the offered rate, achieved throughput, first tokens/s and goodput, the
    achieved, started and schedule intervals (s), the drain after the schedule (never below
    zero: a stage whose last answer came before its schedule ended, or that was cut with its
    requests in flight, left no backlog to drain), the requests cut in flight
    (``cancelled``), and the verdicts with p-values: ``overloaded`` (achieved and first tokens/s clearly below offered)
    and ``goodput_short`` (goodput and first tokens/s clearly below offered; None where the
    group has no class with an SLO)."""
    rows = []
    lean = M.slim(frame, by)
    for key, sub in lean.groupby(list(by), observed=True, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        rows.append(stage_row(dict(zip(by, key)), len(sub), int(M.finished(sub).sum()),
                              int(sub["ok"].sum()), int(M.met_slo(sub).sum()),
                              int(M.with_slo(sub).sum()),
                              int(sub["cancelled"].to_numpy(bool).sum()), M.achieved_s(sub),
                              M.offered_s(sub), M.started_s(sub), shortfall, alpha))
    return pd.DataFrame(rows, columns=list(by) + list(COLUMNS))


COLUMNS = ("scheduled", "completed", "started", "good", "offered_rps", "throughput_rps",
           "started_rps", "goodput_rps", "achieved_s", "started_s", "offered_s", "drain_s",
           "cancelled", "overloaded", "p_value", "started_p", "goodput_short", "goodput_p")


def stage_row(keys: dict, scheduled: int, completed: int, started: int, good: int, n_slo: int,
              cancelled: int, a_s: float, o_s: float, s_s: float,
              shortfall: float = SHORTFALL, alpha: float = ALPHA) -> dict:
    """One row of ``rates`` from a group's counts and intervals, however counted (the request
    frame's rows, or out of core: ``reports.rendering.scale``)."""
    offered = scheduled / o_s if o_s == o_s and o_s > 0 else math.nan
    below, p = verdict(completed, scheduled, a_s, offered, shortfall, alpha)
    late, p_s = verdict(started, scheduled, s_s, offered, shortfall, alpha)
    over = None if below is None or late is None else (below and late)
    g_short, g_p = None, math.nan
    if n_slo and o_s == o_s and o_s > 0:
        g_below, g_p = verdict(good, n_slo, a_s, n_slo / o_s, shortfall, alpha)
        g_short = None if g_below is None or late is None else (g_below and late)
    return {**keys, "scheduled": scheduled, "completed": completed,
            "started": started, "good": good, "offered_rps": offered,
            "throughput_rps": completed / a_s if a_s == a_s else math.nan,
            "started_rps": started / s_s if s_s == s_s else math.nan,
            "goodput_rps": (good / a_s if a_s == a_s and n_slo else math.nan),
            "achieved_s": a_s, "started_s": s_s, "offered_s": o_s,
            "drain_s": max(0.0, a_s - o_s) if a_s == a_s and o_s == o_s else math.nan,
            "cancelled": cancelled, "overloaded": over, "p_value": p, "started_p": p_s,
            "goodput_short": g_short, "goodput_p": g_p}
