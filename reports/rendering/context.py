"""The template context of a report: everything the HTML and Markdown templates show, built
from the runs' data (``reports.data``), the tables (``reports.tables``), the diagnosis and the
capacity search's section."""

from __future__ import annotations

import json
import math
import time

import pandas as pd

from kvbench.core import redact
from kvbench.core.contract import EndpointEntry
from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.statistics import metrics as M
from kvbench.reports.analysis import overload as O
from kvbench.reports.analysis import pareto as P
from kvbench.reports.rendering import tables
from kvbench.reports.rendering.cells import NO_SLO, SLO_METRICS, fmt, metric_row, table_rows
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose import diagnose, order
from kvbench.reports.analysis.numbering import label_of, labels, number
from kvbench.reports.measures.frame import itl_values, wall_s
from kvbench.reports.statistics.resampling import CI

SUMMARY_METRICS = ("offered_rps", "throughput_rps", "started_rps", "goodput_rps",
                   "slo_attainment", "output_tps", "input_tps",
                   "ttft_p50", "ttft_p90", "ttft_p99", "ttft_p999", "ttft_mean", "tpot_p50",
                   "tpot_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99", "lateness_p99",
                   "error_rate", "hit_ratio")
CI_METRICS = ("goodput_rps", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99",
              "e2e_p99", "error_rate", "hit_ratio")
REPORT_RESAMPLES = 1000
REPORT_SEED = 0


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

    summary = [metric_row("requests", "count", [len(per_ep[ep]) for ep in eps], None)]
    outcomes = {ep: M.outcomes(per_ep[ep]) for ep in eps}
    if any(o["cancelled"] for o in outcomes.values()):
        summary.append(metric_row("cancelled at the stop (not errors)", "count",
                                  [outcomes[ep]["cancelled"] for ep in eps], None))
    no_slo_ep = [not M.with_slo(per_ep[ep]).any() for ep in eps]
    for name in SUMMARY_METRICS:
        info = M.METRIC_INFO[name]
        summary.append(metric_row(info.label, info.unit, [values[ep][name] for ep in eps],
                                  None if name in ("offered_rps", "started_rps")
                                  else info.higher_is_better,
                                  [cis[ep].get(name) for ep in eps] if name in CI_METRICS
                                  else None,
                                  no_slo=no_slo_ep if name in SLO_METRICS else None))
    stage_rates = O.rates(f)
    summary.append(tables.overload_row(stage_rates, eps, labels(d.stages)))
    if engine_hits:
        summary.append(metric_row("prefix hit ratio (engine counters)", "fraction",
                                  [engine_hits.get(ep, math.nan) for ep in eps], True))
    summary.append(metric_row("output tokens/s per GPU", "tok/s",
                              [gpu_figs[ep]["tps_per_gpu"] for ep in eps], True))
    if any(not math.isnan(c) for c in costs.values()):
        summary.append(metric_row("cost per million output tokens"
                                  + (" (example prices)" if example_price else ""), "$",
                                  [costs[ep] for ep in eps], False))
    summary.append(metric_row("stage wall time", "s", [walls[ep] for ep in eps], None))

    by_class = tables.group_tables(f, "request_class")
    stage_table = tables.stage_table(d, stage_rates)
    names = labels(d.stages)  # "probe N" / "stage N", as the console says them
    by_stage = table_rows(stage_table.assign(stage=[label_of(names, *k) for k in zip(
        stage_table["endpoint"], stage_table["workload"], stage_table["stage"])]),
                          ["endpoint", "workload", "stage", "load",
                           "overloaded", tables.LOOP_PAUSE]) if not stage_table.empty else []
    no_slo_classes = tables.no_slo_classes(f)
    # by topology alone, when endpoints share one (otherwise it repeats the summary)
    by_topology = (table_rows(M.summarise(f, by=["topology"], metrics=tables.GROUP_METRICS),
                              ["topology"], mark_within=None)
                   if 1 < f["topology"].nunique() < len(eps) else [])
    by_bucket = tables.group_tables(f, "prompt_bucket", metrics=("ttft_p50", "ttft_p99",
                                                                 "tpot_p50", "hit_ratio"))
    error_rows = tables.error_rows(f, outcomes)
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
    from kvbench.reports.analysis.cache_verify import as_findings, cache_rows

    cache_verified = cache_rows(d.runs, f)
    cache = [{**r, "records_text": fmt(r["records_ratio"], "fraction"),
              "engine_text": fmt(r["engine_ratio"], "fraction"),
              "theory_text": fmt(r["theoretical_ratio"], "fraction"),
              "stage_text": "{} ({})".format(r["profile"] or "–",
                                             "all" if r["stage"] is None else r["stage"] + 1),
              "tokens_text": _token_check(r)}
             for r in cache_verified]
    traces = _server_traces(d)
    from kvbench.reports.rendering.plots import all_figures

    points = P.stage_points(f, d.endpoints, d.stages)
    per_gpu = tables.per_gpu_block(points, stage_table)
    figures = all_figures(d, stage_table, itl_cache, points) if figures else []
    findings = order(diagnose(d) + as_findings(cache_verified))
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
    from kvbench.reports.analysis import capacity as C

    caps = C.summarise(d.stages, d.frame, d.slo)
    if not caps:
        return None
    rows = []
    for c in caps:
        ep = d.endpoint(c.endpoint)
        per = C.per_gpu_and_cost(c, ep.gpus, ep.gpu_hour_cost)
        at = c.at_capacity or {}
        br = c.breaks or {}
        closed = c.unit == "users"
        num = (lambda x: fmt(x, "count")) if closed else fmt  # whole users
        rows.append({
            "endpoint": c.endpoint, "workload": c.workload, "status": c.status,
            "unit": c.unit, "loop": "closed loop: users" if closed else "open loop: req/s",
            "capacity": c.estimate_rps, "capacity_text": C.capacity_text(c, fmt),
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
            "gpus": ep.gpus, "gpu_hour_cost": ep.gpu_hour_cost,
            "per_gpu": per["capacity_per_gpu"], "per_gpu_text": fmt(per["capacity_per_gpu"]),
            "per_usd": per["capacity_per_usd_hour"],
            "per_usd_text": fmt(per["capacity_per_usd_hour"]),
            "usd_per_mtok": fmt(per["usd_per_mtok"]),
            "probes": c.probes, "load_s": fmt(c.load_s)})
    by_gpu = _ranked(rows, "per_gpu")
    by_usd = _ranked(rows, "per_usd")
    probes = [{"endpoint": s.endpoint, "workload": s.workload, "stage": number(s.index),
               "rate": (fmt(s.rate_rps) if s.rate_rps is not None
                        else f"{s.users} users" if s.users is not None else "–"),
               "duration": fmt(s.duration_s), "role": s.search.role,
               "verdict": s.search.verdict or (
                   "not judged" if s.search.role == "warmup" else "void"),
               "why": s.search.why or ""}
              for s in d.stages if s.search is not None]
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
    from kvbench.reports.analysis import server_traces as T

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


def _nz(x: float) -> float:
    return -math.inf if x is None or math.isnan(x) else x


def _mode(s: pd.Series) -> str:
    return str(s.astype(str).value_counts().index[0]) if len(s) else ""


def _iso(ns) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(ns) / 1e9))
    except (TypeError, ValueError):
        return ""

