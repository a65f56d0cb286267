"""Capacity at SLO: the capacity a search found, from its probes' requests and verdicts
(``verdict``: how one probe is judged), in req/s or users, per GPU and per dollar, and the words
the report and kvbench run say it in. Pure pandas/numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvbench.core.contract import StageEntry
# the probe's verdict, also reachable here (the capacity search reads both)
from kvbench.reports.analysis.verdict import (CONFIDENCE, RESAMPLES, TARGET,  # noqa: F401
                                              ClassVerdict, ProbeVerdict, bounded_verdict,
                                              class_verdict, effective_n, in_flight_at,
                                              misses_by_slo, needed_for, not_steady,
                                              probe_verdict, saturated, short_of_offered,
                                              thin_text)

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
    # whether the claimed level held: the search's last probe there ("hold") ran at least three
    # mean response times with no backlog growing and its attainment estimate at the target
    # (None: a search without a hold, e.g. runs made before holds existed)
    held: bool | None = None

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
        # a search with a hold claims only the level its hold held: its short probes'
        # passes above it were first seconds the endpoint does not sustain (a failed hold is
        # a failure at its level); holds but none held: the bracket stands, marked not held
        holds = [s for s in probes if s.search.role == "hold" and s.search.verdict]
        held = None
        if holds:
            held_at = [level(s) for s in holds if s.search.verdict == "pass"]
            held = bool(held_at)
            for s in holds:
                settled[level(s)] = s.search.verdict
                shown[level(s)] = True
        passes = [r for r, v in settled.items() if v == "pass"]
        fails = [r for r, v in settled.items() if v == "fail"]
        cap = max(held_at) if held else max(passes) if passes else None
        above = [r for r in fails if cap is None or r > cap]
        fail = min(above) if above else None
        shown_passes = [r for r in passes if shown[r]]
        low = max(shown_passes) if shown_passes else None
        high = min((r for r in fails if shown[r] and (low is None or r > low)), default=None)
        if held:  # from the hold's level to the lowest failure shown above it: short
            # passes above a held level were their first seconds, not shown passes
            low = cap
            high = min((r for r in above if shown[r]), default=None)
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
        if cap is not None and fail is not None and not held:
            def pooled(rate):
                idx = [s.index for s in probes if level(s) == rate]
                return class_attainment(sub[np.isin(sub["stage"], idx)])

            estimate = crossing(cap, fail, pooled(cap), pooled(fail),
                                kw_ep.get("target", TARGET))
            if closed:  # whole users: the most the interpolation says meet the target
                estimate = float(max(cap, math.floor(estimate + 1e-9)))
        out.append(Capacity(ep, wl, cap, fail, status, len(probes),
                            float(sum(_ran_s(s) for s in probes)), breaks, at, low, high,
                            estimate, "users" if closed else "req/s", held))
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
