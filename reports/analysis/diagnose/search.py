"""A capacity search's probes in the diagnosis: which of them are how the search found its limit
(not findings), and the one search outcome that is a finding by itself, an endpoint that
passed no probe at all.

A search raises its load until probes fail, then bisects: its probes above the capacity it
claims fail, queue, drain late or are cut by design, and a probe started on a guess that
proved wrong is void (cut unjudged). None of that is a problem of the endpoint. What still
is: nothing passing even at the lowest level tried, errors at or below the claimed capacity
(``errors``), overload at or below it (``load.overloaded``) and a load generator that sent
late or read slowly anywhere (``load.loadgen_saturated``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvbench.reports.analysis.numbering import stage_label
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose.base import Finding


def _level(stage) -> float | None:
    if stage.rate_rps is None and stage.users is not None:
        return float(stage.users)
    return None if stage.rate_rps is None else float(stage.rate_rps)


@dataclass
class Search:
    """One endpoint x workload's search as its run.json stages tell it."""

    endpoint: str
    workload: str
    capacity: float | None  # the highest level whose settled verdict is a pass
    lowest: float | None  # the lowest level it judged (a straddle too)
    unit: str
    probes: list = field(default_factory=list)  # StageEntry, in index order

    def beyond(self, stage) -> bool:
        """A probe above the claimed capacity, or (nothing passed) above the lowest level
        tried: how the search found its limit."""
        lv = _level(stage)
        bound = self.capacity if self.capacity is not None else self.lowest
        return lv is not None and bound is not None and lv > bound

    def unjudged(self, stage) -> bool:
        """A warm-up, or a probe void or cut before its verdict."""
        return stage.search.verdict is None


def searches(stages) -> dict[tuple[str, str], Search]:
    """Every searched endpoint x workload: its probes, claimed capacity (a level's settled
    verdict is its last probe's, as ``reports.analysis.capacity`` reads it) and lowest level
    judged."""
    out: dict[tuple[str, str], Search] = {}
    for s in sorted((s for s in stages if s.search is not None), key=lambda s: s.index):
        key = (str(s.endpoint), str(s.workload))
        if key not in out:
            closed = s.rate_rps is None and s.users is not None
            out[key] = Search(key[0], key[1], None, None, "users" if closed else "req/s")
        out[key].probes.append(s)
    for srch in out.values():
        settled: dict[float, str] = {}
        judged = []
        for s in srch.probes:
            lv = _level(s)
            if lv is not None and s.search.verdict in ("pass", "fail"):
                settled[lv] = s.search.verdict
            if lv is not None and s.search.verdict is not None:
                judged.append(lv)
        passes = [lv for lv, v in settled.items() if v == "pass"]
        srch.capacity = max(passes) if passes else None
        srch.lowest = min(judged) if judged else None
    return out


def exempt(stages, overload: bool = True) -> set[tuple[str, str, int]]:
    """(endpoint, workload, index) of the search probes that are no finding's evidence: those
    beyond the claimed capacity, and (``overload``: for overload and backlog) the unjudged
    ones too (a warm-up, a void or cut probe)."""
    out = set()
    for srch in searches(stages).values():
        for s in srch.probes:
            if srch.beyond(s) or (overload and srch.unjudged(s)):
                out.add((srch.endpoint, srch.workload, int(s.index)))
    return out


def windows(stages, skip: set[tuple[str, str, int]]) -> dict[str, list[tuple[int, int]]]:
    """Per endpoint (of a search), the (start, end) ns of its stages not in ``skip``: where an
    engine counter's increase is evidence."""
    searched = {srch.endpoint for srch in searches(stages).values()}
    out: dict[str, list[tuple[int, int]]] = {ep: [] for ep in searched}
    for s in stages:
        ep = str(s.endpoint)
        if ep in out and (ep, str(s.workload), int(s.index)) not in skip \
                and s.t_start_ns is not None and s.t_end_ns is not None:
            out[ep].append((int(s.t_start_ns), int(s.t_end_ns)))
    return out


def keep_mask(frame: pd.DataFrame, skip: set[tuple[str, str, int]]) -> np.ndarray:
    """Rows of ``frame`` not in a stage of ``skip``."""
    if not skip or not len(frame):
        return np.ones(len(frame), bool)
    keys = pd.MultiIndex.from_arrays([frame["endpoint"].astype(str), frame["workload"].astype(str),
                                      frame["stage"].astype(np.int64)])
    return ~keys.isin(list(skip))


def start_failed(d: ReportData) -> list[Finding]:
    """A search that passed no probe: the endpoint missed the SLOs at the load the search
    started from, and at every lower one it tried."""
    out = []
    for srch in searches(d.stages).values():
        judged = [s for s in srch.probes if s.search.verdict in ("pass", "fail", "straddle")]
        if srch.capacity is not None or not judged:
            continue
        start = _level(judged[0])
        u = srch.unit
        ev = [(f"{stage_label(s)} at {_level(s):g} {u}",
               f"{s.search.verdict.upper()}: {s.search.why or ''}") for s in judged]
        settled = {_level(s): s.search.verdict for s in judged}  # the last probe's, per level
        undecided = sorted(lv for lv, v in settled.items() if v == "straddle")
        title = (f"{srch.endpoint} x {srch.workload}: nothing passed the SLOs, not even the "
                 f"search's start, {start:g} {u}")
        if undecided:
            title += (f" (undecided at {', '.join(f'{x:g}' for x in undecided)} {u} when "
                      "the search ended)")
        out.append(Finding(
            "start_failed", title, ev,
            "the endpoint misses the SLOs at the load the search started from and at every "
            "lower load it tried: too slow for these SLOs at that load, or failing requests "
            "(see its errors)",
            "start the search lower (search.start_rps, or start_users) or give it more "
            "budget_s, check that the SLOs fit the model and hardware, or add capacity; the "
            "probes' misses name the SLO that failed", endpoint=srch.endpoint,
            severity="critical",
            numbers={"workload": srch.workload, "lowest": srch.lowest, "start": start,
                     "probes": len(judged), "undecided": undecided}))
    return out
