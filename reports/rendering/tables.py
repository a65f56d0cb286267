"""The report's tables built from the request frame: per group and per stage (its load, the
overload verdict, the load process's loop pauses), the errors, and the per-GPU and Pareto block
of the stages."""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

from kvbench.core.contract import StageEntry
from kvbench.reports.statistics import metrics as M
from kvbench.reports.analysis import pareto as P
from kvbench.reports.rendering.cells import NO_SLO, SLO_METRICS, Cell, fmt, table_rows
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.numbering import label_of, number

# ITL stays in the per-endpoint summary: pooling gaps per group costs a gather of millions.
GROUP_METRICS = ("offered_rps", "throughput_rps", "goodput_rps", "slo_attainment", "ttft_p50",
                 "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p99", "ttft_intended_p99",
                 "e2e_intended_p99", "error_rate", "hit_ratio")


def group_tables(f: pd.DataFrame, key: str,
                 metrics: Sequence[str] = GROUP_METRICS) -> list[dict]:
    t = _mark_no_slo(M.summarise(f, by=[key, "endpoint"], metrics=metrics), f, [key, "endpoint"])
    return table_rows(t, [key, "endpoint"], mark_within=key)


def _mark_no_slo(t: pd.DataFrame, f: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Column ``_no_slo``: the group has no request of a class with an SLO."""
    if t.empty or not any(m in t.columns for m in SLO_METRICS):
        return t
    has = M.slim(f, keys).groupby(keys, observed=True, sort=True)["has_slo"].any()
    t["_no_slo"] = [not bool(has.get(tuple(k) if len(k) > 1 else k[0], False))
                    for k in t[keys].itertuples(index=False, name=None)]
    return t


def no_slo_classes(f: pd.DataFrame) -> list[dict]:
    """Classes without an SLO: not in goodput or SLO attainment (shown "no SLO")."""
    lean = f[["request_class", "has_slo"]]
    rows = lean[~lean["has_slo"].to_numpy()]
    if not len(rows):
        return []
    counts = rows["request_class"].astype(object).fillna("(none)").astype(str).value_counts()
    return [{"class": c, "requests": f"{int(n):,}"} for c, n in sorted(counts.items())]


def overload_row(rates: pd.DataFrame, eps: list[str], names: dict | None = None) -> dict:
    """Per endpoint: its stages whose achieved throughput is clearly below offered (named as
    ``numbering.labels`` gives them in ``names``)."""
    cells = []
    for ep in eps:
        r = rates[rates["endpoint"].astype(str) == ep]
        judged = r[r["overloaded"].notna()]
        over = judged[judged["overloaded"].astype(bool)]
        if not len(judged):
            text = "–"
        elif not len(over):
            text = f"none of {len(judged)}"
        else:
            text = f"{len(over)} of {len(judged)}: " + ", ".join(
                f"{w} {label_of(names or {}, e, w, s)}"
                for e, w, s in zip(over["endpoint"], over["workload"], over["stage"]))
        cells.append(Cell(text, float(len(over))))
    return {"label": "overloaded stages (achieved and first tokens/s clearly below offered)",
            "unit": "", "cells": cells, "better": "lower"}


def error_rows(f: pd.DataFrame, outcomes: dict[str, dict]) -> list[dict]:
    """The errors by endpoint and status (requests cancelled at the stop are not errors),
    each with its share of the endpoint's errors and its most frequent error text."""
    bad = M.failed(f)
    if not bad.any():
        return []
    errs = f.loc[bad, ["endpoint", "status", "error"]]
    counts = M.error_breakdown(errs, by=("endpoint",))
    top = (errs.groupby(["endpoint", "status", "error"], observed=True).size()
           .rename("n").reset_index().sort_values("n", ascending=False, kind="stable"))
    rows = []
    for _, r in counts.iterrows():
        ex = top[(top["endpoint"] == r["endpoint"]) & (top["status"] == r["status"])]
        finished = outcomes[str(r["endpoint"])]["requests"] - outcomes[str(r["endpoint"])][
            "cancelled"]
        rows.append({"endpoint": r["endpoint"], "status": r["status"],
                     "requests": f"{int(r['requests']):,}",
                     "share": fmt(r["requests"] / finished if finished else math.nan,
                                  "fraction"),
                     "example": str(ex["error"].iloc[0]) if len(ex) else "",
                     "example_n": f"{int(ex['n'].iloc[0]):,}" if len(ex) else ""})
    return rows



LOOP_PAUSE = "largest loop pause"  # the stage table's column, beside client lateness


def loop_pause_text(stage: StageEntry) -> str:
    """The load process's largest event-loop pause in a stage, and how many were over 5 ms
    (every stream is read late together during one: lateness per request cannot show it)."""
    ms = stage.loop_pause_max_ms
    if ms is None:
        return "–"  # not measured (a run recorded before kvbench measured it)
    n = stage.loop_pauses_over_5ms or 0
    off = stage.loop_pause_max_offcpu_ms
    parts = []
    if off is not None and float(off) >= 0.5:  # the host's share: the process was not running
        parts.append(f"{float(off):.1f} off-CPU")
    if n:
        parts.append(f"{int(n)} over 5 ms")
    return f"{float(ms):.1f} ms" + (f" ({'; '.join(parts)})" if parts else "")


STAGE_METRICS = ("offered_rps", "throughput_rps", "started_rps", "goodput_rps", "ttft_p50",
                 "ttft_p99", "tpot_p50", "e2e_p99", "error_rate", "lateness_p99")


def stage_table(d: ReportData, rates: pd.DataFrame,
                summary: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per stage: its load (offered req/s, or users of a closed loop), offered rate, achieved
    throughput and goodput (``reports.overload.rates``), the verdict and latencies.
    ``summary``: the per-stage figures (endpoint, workload, stage, requests, ``STAGE_METRICS``
    and ``_no_slo``) computed elsewhere (out of core: ``reports.rendering.scale``)."""
    f = d.frame
    if summary is not None:
        t = summary.copy()
    else:
        t = M.summarise(f, by=["endpoint", "workload", "stage"], metrics=STAGE_METRICS)
    if t.empty:
        return t
    if summary is None:
        t = _mark_no_slo(t, f, ["endpoint", "workload", "stage"])
    verdicts = {(str(r["endpoint"]), str(r["workload"]), int(r["stage"])): r["overloaded"]
                for _, r in rates.iterrows()}
    offered, load, kind, over, pauses = [], [], set(), [], []
    idx = {(str(s.endpoint), str(s.workload), int(s.index)): s for s in d.stages}
    for _, r in t.iterrows():
        k = (str(r["endpoint"]), str(r["workload"]), int(r["stage"]))
        s = idx.get(k) or StageEntry()  # a stage run.json does not list: its load unknown
        v = verdicts.get(k)
        pauses.append(loop_pause_text(s))
        over.append("–" if v is None or v != v else ("yes" if v else "no"))
        if r["offered_rps"] == r["offered_rps"]:
            offered.append(float(r["offered_rps"]))
            load.append(f"{s.pacing or 'rate'} {fmt(s.rate_rps)} req/s planned"
                        if s.rate_rps else f"{s.pacing or 'scheduled'} replay"
                        if s.pacing == "trace" else "scheduled")
            kind.add("rate")
        elif s.users:
            offered.append(float(s.users))
            load.append(f"{int(s.users)} users")
            kind.add("users")
        else:
            offered.append(float(r["throughput_rps"]))
            load.append("–")
            kind.add("measured")
    t.insert(3, "offered", offered)
    t.insert(4, "load", load)
    t.insert(5, "overloaded", over)
    t.insert(6, LOOP_PAUSE, pauses)
    t.attrs["x_title"] = ("offered load (req/s)" if kind == {"rate"} else
                          "concurrent users" if kind == {"users"} else
                          "offered load (req/s, users, or measured req/s)")
    return t


def per_gpu_block(points: pd.DataFrame, stage_table: pd.DataFrame) -> dict:
    """Per stage: GPUs, output tokens/s (total, per GPU), per-user tokens/s, $ / M output
    tokens, and whether the stage is on the Pareto frontier or is its endpoint's knee."""
    if points.empty:
        return {"rows": [], "example_price": False, "unknown_gpus": [], "knee_pct": ""}
    on_front = set(P.frontier(points["tps_per_gpu"], points["per_user_tps"]).tolist())
    knees = set()
    for _, rows in points.groupby(["endpoint", "workload"], sort=False):
        k = P.knee(rows["tps_per_gpu"], rows["per_user_tps"])
        if k is not None:
            knees.add(int(rows.index[k]))
    loads = {}
    if not stage_table.empty:
        loads = {(str(r["endpoint"]), str(r["workload"]), int(r["stage"])): (r["load"],
                                                                              r["overloaded"])
                 for _, r in stage_table.iterrows()}
    out = []
    for i, r in points.iterrows():
        load, over = loads.get((r["endpoint"], r["workload"], int(r["stage"])), ("–", "–"))
        out.append({"endpoint": r["endpoint"], "workload": r["workload"],
                    "stage": number(int(r["stage"])), "load": load, "overloaded": over,
                    "gpus": fmt(r["gpus"], "count") + ("" if r["gpus_known"] else " (assumed)"),
                    "output_tps": fmt(r["output_tps"]), "tps_per_gpu": fmt(r["tps_per_gpu"]),
                    "per_user_tps": fmt(r["per_user_tps"]), "cost_per_m": fmt(r["cost_per_m"]),
                    "example_price": bool(r["example_price"]),
                    "frontier": i in on_front, "knee": i in knees,
                    "pareto": ", ".join(w for w, on in (("frontier", i in on_front),
                                                         ("knee", i in knees)) if on) or "–"})
    return {"rows": out, "example_price": bool(points["example_price"].any()),
            "knee_pct": f"{P.KNEE_FRACTION:.0%}",
            "unknown_gpus": sorted(set(points.loc[~points["gpus_known"].astype(bool),
                                                  "endpoint"]))}



def bake_rankings(frames: dict[str, pd.DataFrame], entry) -> list[dict]:
    """Per workload, the endpoints ranked by goodput at SLO and by cost per million output
    tokens over their stages of it (``frames``: per endpoint label, the rows to rank on; the
    stages outside a capacity search); ``entry(label)``: the endpoint's run.json entry. Only
    endpoints that ran the same workload are compared."""
    out = []
    workloads = list(dict.fromkeys(str(w) for sub in frames.values()
                                   for w in sub["workload"].astype(str).unique()))
    for wl in workloads:
        goodput, cost = [], []
        for ep, sub in frames.items():
            rows = sub[sub["workload"].astype(str).to_numpy() == wl]
            if not len(rows):
                continue
            no_slo = not M.with_slo(rows).any()
            v = M.evaluate(rows, ("goodput_rps", "slo_attainment"))
            goodput.append({"endpoint": ep, "value": v["goodput_rps"], "no_slo": no_slo,
                            "text": NO_SLO if no_slo else fmt(v["goodput_rps"]),
                            "slo": NO_SLO if no_slo else fmt(v["slo_attainment"], "fraction")})
            figs = P.endpoint_figures(rows, entry(ep))
            if not math.isnan(figs["cost_per_m"]):
                cost.append({"endpoint": ep, "value": figs["cost_per_m"],
                             "text": fmt(figs["cost_per_m"]), "gpus": entry(ep).gpus,
                             "gpu_hour_cost": entry(ep).gpu_hour_cost,
                             "example_price": figs["example_price"]})
        goodput.sort(key=lambda r: -(r["value"] if r["value"] == r["value"] else -math.inf))
        cost.sort(key=lambda r: r["value"])
        out.append({"workload": wl, "by_goodput": goodput, "by_cost": cost})
    return out
