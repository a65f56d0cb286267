"""Render a comparison/bake-off report (one self-contained HTML file, or Markdown for CI logs).

Everything the HTML needs is inlined (plotly.js once, styles, figure JSON), so it opens with no
network now and in a year. Text from endpoints goes through Jinja autoescape; figure JSON is
escaped so that no string inside it can close its <script> element.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape

from kvbench.core import redact
from kvbench.core.contract import EndpointEntry, StageEntry
from kvbench.reports import engine_counters as E
from kvbench.reports import metrics as M
from kvbench.reports.data import ReportData
from kvbench.reports.diagnose import Finding, diagnose
from kvbench.reports import overload as O
from kvbench.reports import pareto as P
from kvbench.reports.frame import itl_values, wall_s
from kvbench.reports.resampling import CI

SUMMARY_METRICS = ("offered_rps", "throughput_rps", "started_rps", "goodput_rps",
                   "slo_attainment", "output_tps", "input_tps",
                   "ttft_p50", "ttft_p90", "ttft_p99", "ttft_p999", "ttft_mean", "tpot_p50",
                   "tpot_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99", "lateness_p99",
                   "error_rate", "hit_ratio")
CI_METRICS = ("goodput_rps", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99",
              "e2e_p99", "error_rate", "hit_ratio")
# ITL stays in the per-endpoint summary: pooling gaps per group costs a gather of millions.
GROUP_METRICS = ("offered_rps", "throughput_rps", "goodput_rps", "slo_attainment", "ttft_p50",
                 "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p99", "error_rate", "hit_ratio")
# Not computed for requests of classes without an SLO: shown as "no SLO", never 100%.
SLO_METRICS = ("goodput_rps", "slo_attainment")
NO_SLO = "no SLO"
REPORT_RESAMPLES = 1000
REPORT_SEED = 0


def fmt(x, unit: str = "") -> str:
    from jinja2 import Undefined

    if x is None or isinstance(x, Undefined):
        return "–"
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(xf):
        return "–"
    if unit == "fraction":
        return f"{100 * xf:.1f}%"
    if unit == "count":
        return f"{xf:,.0f}"
    if abs(xf) >= 1000:
        return f"{xf:,.0f}"
    if abs(xf) >= 100:
        return f"{xf:.1f}"
    if abs(xf) >= 1:
        return f"{xf:.2f}"
    return f"{xf:.3g}"


@dataclass
class Cell:
    text: str
    value: float
    best: bool = False
    ci: str = ""


def _best(values: Sequence[float], higher: bool, unit: str = "") -> set[int]:
    """Indices of the best value; values that print the same as the best tie with it."""
    finite = [(i, v) for i, v in enumerate(values) if v is not None and not math.isnan(v)]
    if len(finite) < 2:
        return set()
    target = max(v for _, v in finite) if higher else min(v for _, v in finite)
    shown = fmt(target, unit)
    best = {i for i, v in finite if v == target or fmt(v, unit) == shown}
    return set() if len(best) == len(finite) else best


def _row(label: str, unit: str, values: list[float], higher: bool | None,
         cis: list[CI | None] | None = None, unit_fmt: str | None = None,
         no_slo: Sequence[bool] | None = None) -> dict:
    """``no_slo[i]``: column i has no request of a class with an SLO (shown "no SLO")."""
    best = _best(values, higher, unit_fmt or unit) if higher is not None else set()
    cells = []
    for i, v in enumerate(values):
        ci = ""
        if cis and cis[i] is not None and not math.isnan(cis[i].low):
            ci = f"[{fmt(cis[i].low, unit_fmt or unit)}, {fmt(cis[i].high, unit_fmt or unit)}]"
        text = NO_SLO if no_slo is not None and no_slo[i] else fmt(v, unit_fmt or unit)
        cells.append(Cell(text, v, i in best, ci))
    shown_unit = "" if unit in ("count", "fraction") else unit
    return {"label": label, "unit": shown_unit, "cells": cells,
            "better": "" if higher is None else ("higher" if higher else "lower")}


def cost_per_m_output(d: ReportData, ep: str, frame: pd.DataFrame) -> float:
    """The endpoint's GPUs at its gpu_hour_cost, per million output tokens at the achieved
    output rate of its rows (``reports.pareto``)."""
    return P.endpoint_figures(frame, d.endpoint(ep))["cost_per_m"]


def build_context(d: ReportData, title: str | None = None, figures: bool = True) -> dict:
    """Everything a template shows; ``figures=False`` skips the plots (the Markdown report
    has none)."""
    f = d.frame
    eps = d.endpoint_names
    lean = M.slim(f, ("endpoint", "topology"))
    ep_col = lean["endpoint"].to_numpy()
    per_ep = {ep: lean[ep_col == ep] for ep in eps}
    itl_cache = {ep: itl_values(sub) for ep, sub in per_ep.items()}
    values: dict[str, dict[str, float]] = {}
    cis: dict[str, dict[str, CI]] = {}
    for ep, sub in per_ep.items():
        values[ep] = M.evaluate(sub, SUMMARY_METRICS)
        cis[ep] = M.evaluate(sub, CI_METRICS, ci=True, resamples=REPORT_RESAMPLES,
                             seed=REPORT_SEED)
    engine_hits = E.hit_ratio(d.engine)
    walls = {ep: wall_s(sub) for ep, sub in per_ep.items()}
    gpu_figs = {ep: P.endpoint_figures(sub, d.endpoint(ep)) for ep, sub in per_ep.items()}
    costs = {ep: gpu_figs[ep]["cost_per_m"] for ep in eps}
    example_price = any(gpu_figs[ep]["example_price"] for ep in eps)

    summary = [_row("requests", "count", [len(per_ep[ep]) for ep in eps], None)]
    outcomes = {ep: M.outcomes(per_ep[ep]) for ep in eps}
    if any(o["cancelled"] for o in outcomes.values()):
        summary.append(_row("cancelled at the stop (not errors)", "count",
                            [outcomes[ep]["cancelled"] for ep in eps], None))
    no_slo_ep = [not M.with_slo(per_ep[ep]).any() for ep in eps]
    for name in SUMMARY_METRICS:
        info = M.METRIC_INFO[name]
        summary.append(_row(info.label, info.unit, [values[ep][name] for ep in eps],
                            None if name in ("offered_rps", "started_rps")
                            else info.higher_is_better,
                            [cis[ep].get(name) for ep in eps] if name in CI_METRICS else None,
                            no_slo=no_slo_ep if name in SLO_METRICS else None))
    stage_rates = O.rates(f)
    summary.append(_overload_row(stage_rates, eps))
    if engine_hits:
        summary.append(_row("prefix hit ratio (engine counters)", "fraction",
                            [engine_hits.get(ep, math.nan) for ep in eps], True))
    summary.append(_row("output tokens/s per GPU", "tok/s",
                        [gpu_figs[ep]["tps_per_gpu"] for ep in eps], True))
    if any(not math.isnan(c) for c in costs.values()):
        summary.append(_row("cost per million output tokens"
                            + (" (example prices)" if example_price else ""), "$",
                            [costs[ep] for ep in eps], False))
    summary.append(_row("stage wall time", "s", [walls[ep] for ep in eps], None))

    by_class = _group_tables(f, "request_class")
    stage_table = _stage_table(d, stage_rates)
    by_stage = _table_rows(stage_table, ["endpoint", "workload", "stage", "load",
                                         "overloaded", LOOP_PAUSE]
                           ) if not stage_table.empty else []
    no_slo_classes = _no_slo_classes(f)
    # by topology alone, when endpoints share one (otherwise it repeats the summary)
    by_topology = (_table_rows(M.summarise(f, by=["topology"], metrics=GROUP_METRICS),
                               ["topology"], mark_within=None)
                   if 1 < f["topology"].nunique() < len(eps) else [])
    by_bucket = _group_tables(f, "prompt_bucket", metrics=("ttft_p50", "ttft_p99",
                                                           "tpot_p50", "hit_ratio"))
    error_rows = _error_rows(f, outcomes)
    cancelled = [{"endpoint": ep, "n": o["cancelled"],
                  "text": f"{o['cancelled']:,} cancelled at the stop"}
                 for ep, o in outcomes.items() if o["cancelled"]]
    engine_rows = [{**r, "records_text": fmt(r["records"], "count"),
                    "engine_text": fmt(r["engine"], "count"),
                    "diff_text": "–" if math.isnan(r["diff"]) else f"{100 * r['diff']:+.1f}%"}
                   for r in E.comparison(d.engine, f, _primed(d))]

    bake = {
        "by_goodput": sorted(({"endpoint": ep, "value": values[ep]["goodput_rps"],
                               "no_slo": no_slo,
                               "text": NO_SLO if no_slo else fmt(values[ep]["goodput_rps"]),
                               "slo": NO_SLO if no_slo else fmt(values[ep]["slo_attainment"],
                                                                 "fraction")}
                              for ep, no_slo in zip(eps, no_slo_ep)),
                             key=lambda r: -_nz(r["value"])),
        "by_cost": sorted(({"endpoint": ep, "value": costs[ep], "text": fmt(costs[ep]),
                            "gpus": d.endpoint(ep).gpus,
                            "gpu_hour_cost": d.endpoint(ep).gpu_hour_cost,
                            "example_price": gpu_figs[ep]["example_price"]}
                           for ep in eps if not math.isnan(costs[ep])),
                          key=lambda r: r["value"]),
    }
    capacity = build_capacity(d)
    from kvbench.reports.cache_verify import as_findings, cache_rows

    cache_verified = cache_rows(d.runs, f)
    cache = [{**r, "records_text": fmt(r["records_ratio"], "fraction"),
              "engine_text": fmt(r["engine_ratio"], "fraction"),
              "theory_text": fmt(r["theoretical_ratio"], "fraction"),
              "stage_text": "{} ({})".format(r["profile"] or "–",
                                             "all" if r["stage"] is None else r["stage"] + 1),
              "tokens_text": _token_check(r)}
             for r in cache_verified]
    traces = _server_traces(d)
    from kvbench.reports.plots import all_figures

    points = P.stage_points(f, d.endpoints, d.stages)
    per_gpu = _per_gpu_block(points, stage_table)
    figures = all_figures(d, stage_table, itl_cache, points) if figures else []
    findings = diagnose(d) + as_findings(cache_verified)
    return {
        "title": title or "kvbench report: " + ", ".join(eps),
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "runs": [{"run_id": r.run_id, "suite": r.suite, "started": _iso(r.started_ns),
                  "ended": _iso(r.ended_ns), "path": str(p)} for r, p in zip(d.runs, d.paths)],
        "endpoints": [_endpoint_row(ep, d.endpoint(ep), per_ep[ep], gpu_figs[ep]) for ep in eps],
        "endpoint_names": eps,
        "summary": summary,
        "by_class": by_class,
        "by_stage": by_stage,
        "by_topology": by_topology,
        "by_bucket": by_bucket,
        "errors": error_rows,
        "cancelled": cancelled,
        "outcomes": outcomes,
        "engine_comparison": engine_rows,
        "cache": cache,
        "server_traces": traces,
        "bake": bake,
        "per_gpu": per_gpu,
        "capacity": capacity,
        "findings": findings,
        "figures": figures,
        "slo": d.slo,
        "no_slo_classes": no_slo_classes,
        "definitions": {**M.DEFINITIONS, **P.DEFINITIONS},
        "config_json": json.dumps(redact.public_config(d.runs[0].config if d.runs else {}),
                                  indent=2, sort_keys=True, default=str),
        "versions": {k: v for r in d.runs for k, v in r.versions.items()},
        "git_commits": sorted({str(r.git_commit) for r in d.runs if r.git_commit}),
        "hosts": sorted({str(h) for r in d.runs for h in r.hosts}),
        "telemetry": {k: v for r in d.runs for k, v in r.telemetry.items()},
        "incomplete": [{"run_id": r.run_id, "what": x.what, "why": x.why}
                       for r in d.runs for x in r.incomplete],
        "counts": {r.run_id: r.counts for r in d.runs if r.counts},
        "workloads": d.workloads,
        "workloads_sent": d.workloads_sent,
        "n_requests": len(f),
    }


def _endpoint_row(label: str, entry: EndpointEntry, rows: pd.DataFrame, figures: dict) -> dict:
    """The endpoints table's row: what run.json recorded (the topology, where it did not, the
    one most of the endpoint's records carry), the URL without its userinfo."""
    return {"name": label, "topology": entry.topology or _mode(rows["topology"]),
            "model": entry.model, "url": redact.redact_url(entry.url), "gpus": entry.gpus,
            "gpu_hour_cost": entry.gpu_hour_cost, "example_price": figures["example_price"]}


def _per_gpu_block(points: pd.DataFrame, stage_table: pd.DataFrame) -> dict:
    """Per stage: GPUs, output tokens/s (total, per GPU), per-user tokens/s, $ / M output
    tokens, and whether the stage is on the Pareto frontier or is its endpoint's knee."""
    if points.empty:
        return {"rows": [], "example_price": False, "unknown_gpus": [], "knee_pct": ""}
    on_front = set(P.frontier(points["tps_per_gpu"], points["per_user_tps"]).tolist())
    knees = set()
    for _, rows in points.groupby("endpoint", sort=False):
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
                    "stage": int(r["stage"]), "load": load, "overloaded": over,
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


def _ranked(rows: list[dict], key: str) -> list[dict]:
    """``rows`` with a ``key`` figure, ranked by it within each workload (endpoints compete on
    the same traffic only), workloads in the order they first appear; each a copy with its
    ``rank``."""
    def group(r):  # an open loop's rate and a closed loop's users do not compare
        return (r["workload"], r.get("unit", "req/s"))

    order = {w: i for i, w in reversed(list(enumerate(group(r) for r in rows)))}
    out = sorted((r for r in rows if r[key] is not None),
                 key=lambda r: (order[group(r)], -r[key]))
    ranked, last, k = [], None, 0
    for r in out:
        k = k + 1 if group(r) == last else 1
        above = ranked[-1] if k > 1 else None
        last = group(r)
        ranked.append({**r, "rank": k, "apart": None if above is None else
                       ("yes" if _separated(above, r, key) else
                        f"no: its bracket overlaps {above['endpoint']}'s")})
    return ranked


def _separated(a: dict, b: dict, key: str) -> bool:
    """Whether ``a`` (ranked above) is shown better than ``b``: the highest rate ``a`` passed,
    in ``key``'s units, lies above the rate at which ``b`` failed (its capacity at SLO, an
    interpolation inside its bracket, is not evidence of itself). Otherwise the search cannot
    tell them apart (a bracket runs from the last passing rate to the first failing one; none
    failing: open above). Either end may have been settled on its estimate after refinement (the
    capacity table shows the interval the bootstrap showed beside the bracket): requiring
    shown ends called every pair of the default bake-off inseparable, where the brackets
    order the long-document shape as the steady state does."""
    fail = b.get("fail")
    return (fail is not None and a.get("passed") is not None
            and a["passed"] * a[key] / a["capacity"] > fail * b[key] / b["capacity"])


def build_capacity(d: ReportData) -> dict | None:
    """The capacity search's section: per endpoint x workload the capacity at SLO with its
    bracket (last passing, first failing rate) and the attainment interval of its worst class
    there, the class that broke first and the SLO it missed, per GPU and per dollar; and the
    ranking by capacity per GPU and per dollar (``reports.capacity``). None: no search ran."""
    from kvbench.reports import capacity as C

    caps = C.summarise(d.stages, d.frame, d.slo)
    if not caps:
        return None
    rows = []
    for c in caps:
        ep = d.endpoints.get(c.endpoint) or {}
        per = C.per_gpu_and_cost(c, ep.get("gpus"), ep.get("gpu_hour_cost"))
        at = c.at_capacity or {}
        br = c.breaks or {}
        closed = c.unit == "users"
        got = at.get("achieved_rps")
        num = (lambda x: fmt(x, "count")) if closed else fmt  # whole users
        rows.append({
            "endpoint": c.endpoint, "workload": c.workload, "status": c.status,
            "unit": c.unit, "loop": "closed loop: users" if closed else "open loop: req/s",
            "capacity": c.estimate_rps, "capacity_text": (
                num(c.estimate_rps) if c.fail_rps is not None or c.estimate_rps is None
                else f"≥ {num(c.estimate_rps)}")
            + (f" ({fmt(got)} req/s answered at {num(c.capacity_rps)} users)"
               if closed and got is not None and got == got else ""),
            "passed": c.capacity_rps,
            "fail": c.fail_rps, "low": c.low_rps, "high": c.high_rps,
            "bracket": (f"{num(c.capacity_rps)} – {num(c.fail_rps)}" if c.fail_rps is not None
                        else f"≥ {num(c.capacity_rps)}" if c.capacity_rps is not None
                        else "–")
            + ("" if (c.low_rps, c.high_rps) == (c.capacity_rps, c.fail_rps)
               else f" (shown: {c.interval_text})"),
            "attainment": (f"{fmt(at.get('attainment'), 'fraction')} "
                           f"[{fmt(at.get('low'), 'fraction')}, "
                           f"{fmt(at.get('high'), 'fraction')}] ({at.get('worst_class')})"
                           + (f"; thin: {at['thin']}" if at.get("thin") else "")
                           + ("; decided on its estimate: the interval still straddles the "
                              "target after refinement" if at.get("estimate") else "")
                           if at else "–"),
            "breaks": (f"{br['class']}: {br['missed'] or '?'} "
                       f"({fmt(br['attainment'], 'fraction')} within SLO at "
                       f"{num(br['rate_rps'])} {c.unit})" if br else "none seen"),
            "gpus": ep.get("gpus"), "gpu_hour_cost": ep.get("gpu_hour_cost"),
            "per_gpu": per["capacity_per_gpu"], "per_gpu_text": fmt(per["capacity_per_gpu"]),
            "per_usd": per["capacity_per_usd_hour"],
            "per_usd_text": fmt(per["capacity_per_usd_hour"]),
            "usd_per_mtok": fmt(per["usd_per_mtok"]),
            "probes": c.probes, "load_s": fmt(c.load_s)})
    by_gpu = _ranked(rows, "per_gpu")
    by_usd = _ranked(rows, "per_usd")
    probes = [{"endpoint": s.get("endpoint"), "workload": s.get("workload"),
               "stage": s.get("index"),
               "rate": (fmt(s.get("rate_rps")) if s.get("rate_rps") is not None
                        else f"{s['users']} users" if s.get("users") is not None else "–"),
               "duration": fmt(s.get("duration_s")), "role": s["search"].get("role"),
               "verdict": s["search"].get("verdict") or (
                   "not judged" if s["search"].get("role") == "warmup" else "void"),
               "why": s["search"].get("why") or ""}
              for s in d.stages if s.get("search")]
    return {"rows": rows, "by_gpu": by_gpu, "by_usd": by_usd, "probes": probes}


def _primed(d: ReportData) -> dict[str, tuple[int, int]]:
    """Per endpoint label: (requests, prompt tokens) the cache protocol sent to prime warm jobs
    (run.json ``cache_states``): counted by the engine, not recorded."""
    shown = set(d.endpoint_names)
    out: dict[str, tuple[int, int]] = {}
    for meta in d.runs:
        for entry in meta.cache_states:
            if not entry.primed_prefixes:
                continue
            name = str(entry.endpoint)
            label = f"{name}@{meta.run_id}" if f"{name}@{meta.run_id}" in shown else name
            n, tokens = out.get(label, (0, 0))
            out[label] = (n + int(entry.primed_prefixes), tokens + int(entry.primed_tokens or 0))
    return out


def _token_check(row: dict) -> str:
    """The records' token totals beside the engine counters' increase over the job:
    "prompt 1,200 / 1,200; cached ...; completion ..." (n/a where a side is unknown)."""
    def num(x) -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.0f}"

    return "; ".join(f"{what} {num(row[a])} / {num(row[b])}" for what, a, b in (
        ("prompt", "records_prompt", "engine_prompt"), ("cached", "records_cached", "engine_hits"),
        ("completion", "records_completion", "engine_generation")))


def _server_traces(d: ReportData) -> list[dict]:
    """TTFT split by the spans the servers exported over OTLP (runs that received any)."""
    import pyarrow as pa

    from kvbench.core.store import read_table
    from kvbench.reports import server_traces as T

    rows = []
    for path, meta in zip(d.paths, d.runs):
        spans = read_table(path, "spans")
        if spans.num_rows == 0:
            continue
        req = read_table(path, "requests", columns=["request_id", "server_request_id",
                                                    "endpoint", "status", "ttft_ns", "t_sent"])
        if len(d.runs) > 1:  # the labels the rest of the report uses for repeated names
            shown = set(d.endpoint_names)
            req = req.set_column(2, "endpoint", pa.array(
                [f"{e}@{meta.run_id}" if f"{e}@{meta.run_id}" in shown else e
                 for e in req["endpoint"].to_pylist()], pa.string()))
        for r in T.breakdown(T.join(req, spans)):
            rows.append({**r, **{k + "_text": fmt(r[k]) for k in (
                "client_ttft_ms", "queue_ms", "prefill_ms", "frontend_ms", "outside_ms",
                "decode_ms")}})
    return rows


def _error_rows(f: pd.DataFrame, outcomes: dict[str, dict]) -> list[dict]:
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


def _nz(x: float) -> float:
    return -math.inf if x is None or math.isnan(x) else x


def _mode(s: pd.Series) -> str:
    return str(s.astype(str).value_counts().index[0]) if len(s) else ""


def _iso(ns) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(ns) / 1e9))
    except (TypeError, ValueError):
        return ""


def _group_tables(f: pd.DataFrame, key: str,
                  metrics: Sequence[str] = GROUP_METRICS) -> list[dict]:
    t = _mark_no_slo(M.summarise(f, by=[key, "endpoint"], metrics=metrics), f, [key, "endpoint"])
    return _table_rows(t, [key, "endpoint"], mark_within=key)


def _mark_no_slo(t: pd.DataFrame, f: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Column ``_no_slo``: the group has no request of a class with an SLO."""
    if t.empty or not any(m in t.columns for m in SLO_METRICS):
        return t
    has = M.slim(f, keys).groupby(keys, observed=True, sort=True)["has_slo"].any()
    t["_no_slo"] = [not bool(has.get(tuple(k) if len(k) > 1 else k[0], False))
                    for k in t[keys].itertuples(index=False, name=None)]
    return t


def _no_slo_classes(f: pd.DataFrame) -> list[dict]:
    """Classes without an SLO: not in goodput or SLO attainment (shown "no SLO")."""
    lean = f[["request_class", "has_slo"]]
    rows = lean[~lean["has_slo"].to_numpy()]
    if not len(rows):
        return []
    counts = rows["request_class"].astype(object).fillna("(none)").astype(str).value_counts()
    return [{"class": c, "requests": f"{int(n):,}"} for c, n in sorted(counts.items())]


def _overload_row(rates: pd.DataFrame, eps: list[str]) -> dict:
    """Per endpoint: its stages whose achieved throughput is clearly below offered."""
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
                f"{w} stage {s}" for w, s in zip(over["workload"], over["stage"]))
        cells.append(Cell(text, float(len(over))))
    return {"label": "overloaded stages (achieved and first tokens/s clearly below offered)",
            "unit": "", "cells": cells, "better": "lower"}


def _table_rows(t: pd.DataFrame, keys: list[str], mark_within: str | None = None) -> dict:
    """Rows of a grouped table with each metric formatted and the best per group marked."""
    metric_cols = [c for c in t.columns if c in M.METRIC_INFO]
    best: dict[tuple, set] = {}
    if mark_within is not None:
        for _, grp in t.groupby(mark_within, sort=False, observed=True):
            for c in metric_cols:
                info = M.METRIC_INFO[c]
                for i in _best(list(grp[c]), info.higher_is_better, info.unit):
                    best.setdefault((grp.index[i],), set()).add(c)
    rows = []
    for idx, r in t.iterrows():
        no_slo = bool(r.get("_no_slo", False))
        cells = [Cell(NO_SLO if no_slo and c in SLO_METRICS else fmt(r[c], M.METRIC_INFO[c].unit),
                      r[c], c in best.get((idx,), set()) and not (no_slo and c in SLO_METRICS))
                 for c in metric_cols]
        rows.append({"keys": [str(r[k]) if not (isinstance(r[k], float) and math.isnan(r[k]))
                              else "–" for k in keys],
                     "requests": f"{int(r['requests']):,}", "cells": cells})
    return {"keys": keys, "metrics": [M.METRIC_INFO[c].label for c in metric_cols],
            "rows": rows}


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


def _stage_table(d: ReportData, rates: pd.DataFrame) -> pd.DataFrame:
    """Per stage: its load (offered req/s, or users of a closed loop), offered rate, achieved
    throughput and goodput (``reports.overload.rates``), the verdict and latencies."""
    f = d.frame
    t = M.summarise(f, by=["endpoint", "workload", "stage"],
                    metrics=("offered_rps", "throughput_rps", "started_rps", "goodput_rps",
                             "ttft_p50", "ttft_p99", "tpot_p50", "e2e_p99", "error_rate",
                             "lateness_p99"))
    if t.empty:
        return t
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


# --------------------------------------------------------------------------------------------


def _env() -> Environment:
    env = Environment(loader=PackageLoader("kvbench.reports", "templates"),
                      autoescape=select_autoescape(["html", "j2"], default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = fmt
    env.filters["script_json"] = script_json
    return env


def script_json(obj) -> str:
    """JSON that is safe inside <script>: no '<', '>', '&' or line separators in the text."""
    import plotly.utils

    s = json.dumps(obj, cls=plotly.utils.PlotlyJSONEncoder, separators=(",", ":"))
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_html(ctx: dict) -> str:
    from markupsafe import Markup
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    if "</script" in js.lower():  # would end the inline element early
        js = js.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")
    figs = [{"key": f["key"], "title": f["title"], "note": f["note"],
             "json": Markup(script_json({"data": f["data"], "layout": f["layout"]}))}
            for f in ctx["figures"]]
    tpl = _env().get_template("report.html.j2")
    return tpl.render(**{**ctx, "figures": figs}, plotly_js=Markup(js))


def md_escape(text) -> str:
    s = str(text)
    for ch in "\\`*_[]<>|":
        s = s.replace(ch, "\\" + ch)
    return s.replace("\n", " ")


def render_md(ctx: dict) -> str:
    env = Environment(loader=PackageLoader("kvbench.reports", "templates"), autoescape=False,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["md"] = md_escape
    return env.get_template("report.md.j2").render(**ctx)


def render(paths: Sequence[Path | str], fmt_: str = "html", slo=None,
           title: str | None = None) -> str:
    from kvbench.reports.data import load

    d = load(paths, slo=slo)
    ctx = build_context(d, title, figures=fmt_ == "html")
    return render_html(ctx) if fmt_ == "html" else render_md(ctx)


__all__ = ["render", "render_html", "render_md", "build_context", "Finding"]
