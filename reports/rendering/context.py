"""The template context of a report: everything the HTML and Markdown templates show, built
from the runs' data (``reports.data``), the tables (``reports.tables``), the diagnosis and the
capacity search's section."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pandas as pd

from kvbench.core import redact
from kvbench.core.contract import EndpointEntry
from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.rendering import agentic_section
from kvbench.reports.statistics import metrics as M
from kvbench.reports.analysis import overload as O
from kvbench.reports.analysis import pareto as P
from kvbench.reports.rendering import tables
from kvbench.reports.rendering.capacity_section import build_capacity
from kvbench.reports.rendering.capacity_section import ranked as _ranked  # noqa: F401
from kvbench.reports.rendering.prediction_section import build_prediction
from kvbench.reports.rendering.cells import SLO_METRICS, fmt, metric_row, table_rows
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose import diagnose, order
from kvbench.reports.analysis.numbering import label_of, labels, number
from kvbench.reports.measures.frame import itl_values, wall_s

# findings whose ``numbers["summary"]`` explains a workload's ranking: shown under its verdict
RANKING_REASONS = ("session_cache",)

SUMMARY_METRICS = ("offered_rps", "throughput_rps", "started_rps", "goodput_rps",
                   "slo_attainment", "output_tps", "input_tps",
                   "ttft_p50", "ttft_p90", "ttft_p99", "ttft_p999", "ttft_mean", "tpot_p50",
                   "tpot_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99", "lateness_p99",
                   "ttft_intended_p50", "ttft_intended_p99", "e2e_intended_p50",
                   "e2e_intended_p99", "error_rate", "hit_ratio")
CI_METRICS = ("goodput_rps", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99",
              "e2e_p99", "error_rate", "hit_ratio")
REPORT_RESAMPLES = 1000
REPORT_SEED = 0


def build_context(d: ReportData, title: str | None = None, figures: bool = True,
                  stages: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> dict:
    """Everything a template shows; ``figures=False`` skips the plots (the Markdown report
    has none). ``stages``: (per-stage rates as ``overload.rates`` gives them, per-stage
    figures for ``tables.stage_table``) computed over every request where ``d`` holds a
    sample of them (``reports.rendering.scale``)."""
    f = d.frame
    eps = d.endpoint_names
    lean = M.slim(f, ("endpoint", "topology", "workload", "stage"))
    ep_col = lean["endpoint"].to_numpy()
    per_ep = {ep: lean[ep_col == ep] for ep in eps}
    itl_cache = {ep: itl_values(sub) for ep, sub in per_ep.items()}
    engine_hits = E.hit_ratio(d.engine)
    gpu_figs = {ep: P.endpoint_figures(sub, d.endpoint(ep)) for ep, sub in per_ep.items()}
    example_price = any(gpu_figs[ep]["example_price"] for ep in eps)
    outcomes = {ep: M.outcomes(per_ep[ep]) for ep in eps}
    stage_rates = O.rates(f) if stages is None else stages[0]
    capacity = build_capacity(d)
    searched = {(str(s.endpoint), str(s.workload), int(s.index)) for s in d.stages
                if s.search is not None}
    # the stages outside a search: summarised per endpoint, as a run without one is
    plain = {ep: sub[~_in_stages(sub, searched)] for ep, sub in per_ep.items()
             } if searched else per_ep
    plain = {ep: sub for ep, sub in plain.items() if len(sub)}
    summaries = []
    if capacity:
        summaries += at_capacity_summaries(d, lean, capacity, example_price)
    if plain:
        cols = list(plain)
        summary = summary_rows(cols, [plain[ep] for ep in cols],
                               [itl_values(plain[ep]) if len(plain[ep]) < len(per_ep[ep])
                                else itl_cache[ep] for ep in cols],
                               ci=stages is None)  # a sample's: replaced (``scale``)
        summary.append(tables.overload_row(
            stage_rates[~_in_stages(stage_rates, searched)] if searched else stage_rates, cols,
            labels(d.stages)))
        if engine_hits and not searched:
            summary.append(metric_row("prefix hit ratio (engine counters)", "fraction",
                                      [engine_hits.get(ep, math.nan) for ep in cols], True))
        figs = {ep: P.endpoint_figures(plain[ep], d.endpoint(ep)) for ep in cols}
        summary.append(metric_row("output tokens/s per GPU", "tok/s",
                                  [figs[ep]["tps_per_gpu"] for ep in cols], True))
        if any(not math.isnan(figs[ep]["cost_per_m"]) for ep in cols):
            summary.append(metric_row("cost per million output tokens"
                                      + (" (example prices)" if example_price else ""), "$",
                                      [figs[ep]["cost_per_m"] for ep in cols], False))
        summary.append(metric_row("stage wall time", "s",
                                  [wall_s(plain[ep]) for ep in cols], None))
        summaries.append({"title": "Summary" if not summaries else
                          "Summary of the fixed-rate stages",
                          "key": "stages", "columns": cols, "rows": summary,
                          "note": "Over every stage of each endpoint outside a capacity "
                                  "search (stages of different rates pooled: see the per-stage "
                                  "table for each load)." if len(plain) and any(
                                      _rates_of(plain[ep]) > 1 for ep in cols) else ""})

    by_class = tables.group_tables(f, "request_class")
    stage_table = tables.stage_table(d, stage_rates, None if stages is None else stages[1])
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
                   for r in E.comparison(d.engine, f, _primed(d), _around_jobs(d))]

    # rankings of the stages outside a search: per workload (endpoints compete on the same
    # traffic only); a searched workload is ranked by its capacity (the verdict)
    bake = tables.bake_rankings(plain, d.endpoint)
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
    for g in capacity["verdict"] if capacity else []:
        # the finding that says why this workload's ranking came out as it did
        g["why"] = next((x.numbers["summary"] for x in findings if x.rule in RANKING_REASONS
                         and x.numbers.get("workload") == g["workload"]), None)
    return {
        "title": title or "kvbench report: " + ", ".join(eps),
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "runs": [{"run_id": r.run_id, "suite": r.suite, "started": _iso(r.started_ns),
                  "ended": _iso(r.ended_ns), "path": str(p)} for r, p in zip(d.runs, d.paths)],
        "endpoints": [_endpoint_row(ep, d.endpoint(ep), per_ep[ep], gpu_figs[ep]) for ep in eps],
        "endpoint_names": eps,
        "summaries": summaries,
        "summary": summaries[0]["rows"] if summaries else [],
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
        "verdict": capacity["verdict"] if capacity else [],
        "searched": bool(capacity),
        "prediction": build_prediction(d, capacity),
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
        "agentic": agentic_section.section(d),
        "intended_note": agentic_section.intended_note(f),
    }


def summary_rows(cols: list[str], frames: list[pd.DataFrame],
                 itls: list[np.ndarray], ci: bool = True) -> list[dict]:
    """The Summary's metric rows, one column per frame (``cols`` its headers): requests, the
    cancelled, each of ``SUMMARY_METRICS`` with its interval where ``CI_METRICS`` has one
    (``ci``)."""
    values, cis = [], []
    for sub, itl in zip(frames, itls):
        values.append(M.evaluate(sub, SUMMARY_METRICS))
        cis.append(M.evaluate(sub, CI_METRICS, ci=True, resamples=REPORT_RESAMPLES,
                              seed=REPORT_SEED) if ci else {})
    rows = [metric_row("requests", "count", [len(x) for x in frames], None)]
    cancelled = [M.outcomes(x)["cancelled"] for x in frames]
    if any(cancelled):
        rows.append(metric_row("cancelled at the stop (not errors)", "count", cancelled, None))
    no_slo = [not M.with_slo(x).any() for x in frames]
    for name in SUMMARY_METRICS:
        info = M.METRIC_INFO[name]
        rows.append(metric_row(info.label, info.unit, [v[name] for v in values],
                               None if name in ("offered_rps", "started_rps")
                               else info.higher_is_better,
                               [c.get(name) for c in cis] if name in CI_METRICS else None,
                               no_slo=no_slo if name in SLO_METRICS else None))
    return rows


def at_capacity_summaries(d: ReportData, lean: pd.DataFrame, capacity: dict,
                          example_price: bool) -> list[dict]:
    """Per searched workload, the Summary at each endpoint's capacity: every metric over the
    probes at the rate (or users) the search claimed, the highest that passed (the probes
    that decided it), never pooled over rates; per GPU and $ per million output tokens are
    ``capacity.per_gpu_and_cost``'s, the capacity table's own. An endpoint that passed no
    rate is shown at its lowest probed rate, labelled so."""
    from kvbench.reports.analysis.capacity import level

    rows_by = {(r["endpoint"], r["workload"], r["unit"]): r for r in capacity["rows"]}
    out = []
    for g in capacity["verdict"]:
        wl, unit = g["workload"], g["unit"]
        ranked_eps = [r["endpoint"] for r in g["ranking"]] + [
            r["endpoint"] for r in g["unranked"]]
        cols, frames, labels = [], [], []
        for ep in ranked_eps:
            row = rows_by[(ep, wl, unit)]
            probes = [s for s in d.stages if s.search is not None and str(s.endpoint) == ep
                      and str(s.workload) == wl]
            at = row["passed"]
            if at is None:
                judged = [level(s) for s in probes if s.search.verdict is not None]
                at = min(judged) if judged else None
            idx = {(ep, wl, int(s.index)) for s in probes if at is not None and level(s) == at}
            sub = lean[_in_stages(lean, idx)]
            num = fmt(at, "count") if unit == "users" else fmt(at)
            cols.append(ep)
            frames.append(sub)
            labels.append(f"{num} {unit}, " + (
                "the highest that passed" if row["passed"] is not None else
                "the lowest probed (none passed)") + f"; {len(idx)} probe"
                + ("s" if len(idx) != 1 else ""))
        if not cols:
            continue
        rows = [metric_row("measured at", "", labels, None)]
        rows += summary_rows(cols, frames, [itl_values(x) for x in frames])
        per = [rows_by[(ep, wl, unit)] for ep in cols]
        rows.append(metric_row("output tokens/s per GPU at capacity at SLO", "tok/s",
                               [_num(r["output_tps_per_gpu"]) for r in per], True))
        if any(r["usd_per_mtok_value"] is not None for r in per):
            rows.append(metric_row("cost per million output tokens at capacity at SLO"
                                   + (" (example prices)" if example_price else ""), "$",
                                   [_num(r["usd_per_mtok_value"]) for r in per], False))
        rows.append(metric_row("probe time at this load", "s",
                               [wall_s(x) for x in frames], None))
        out.append({"title": f"Summary at capacity: {wl}" + (" (closed loop)"
                                                             if unit == "users" else ""),
                    "key": f"capacity-{wl}-{unit}", "columns": cols, "rows": rows,
                    "note": "Each column: the probes at the endpoint's claimed capacity "
                            "(the highest rate that passed), never pooled over rates. Achieved "
                            "throughput and tokens/s run from a probe's first send to its last "
                            "completion, so a short probe's drain lowers them; output tokens/s "
                            "per GPU and $ per million output tokens at capacity are per second "
                            "of the probe's load, at the capacity at SLO: the capacity table's "
                            "own figures. Every probe: the per-stage table."})
    return out


def _in_stages(frame: pd.DataFrame, keys: set) -> np.ndarray:
    """Rows of ``frame`` in the stages ``keys`` ((endpoint, workload, stage index))."""
    if not keys or not len(frame):
        return np.zeros(len(frame), bool)
    k = pd.MultiIndex.from_arrays([frame["endpoint"].astype(str), frame["workload"].astype(str),
                                   frame["stage"].astype(int)])
    return np.asarray(k.isin(list(keys)), bool)


def _rates_of(frame: pd.DataFrame) -> int:
    """How many stages (of possibly different loads) the rows come from."""
    return int(frame["stage_key"].nunique()) if len(frame) else 0


def _num(x) -> float:
    return math.nan if x is None else float(x)


def _endpoint_row(label: str, entry: EndpointEntry, rows: pd.DataFrame, figures: dict) -> dict:
    """The endpoints table's row: what run.json recorded (the topology, where it did not, the
    one most of the endpoint's records carry), the URL without its userinfo."""
    return {"name": label, "topology": entry.topology or _mode(rows["topology"]),
            "model": entry.model, "url": redact.redact_url(entry.url), "gpus": entry.gpus,
            "gpu_hour_cost": entry.gpu_hour_cost, "example_price": figures["example_price"]}


def _around_jobs(d: ReportData) -> dict[str, dict[str, float]]:
    """Per endpoint label, the engine's token counters' increases around its jobs
    (``engine_counters.job_increases``), over every run shown."""
    shown = set(d.endpoint_names)
    out: dict[str, dict[str, float]] = {}
    for meta in d.runs:
        for ep, inc in E.job_increases(meta.cache_states).items():
            label = f"{ep}@{meta.run_id}" if f"{ep}@{meta.run_id}" in shown else ep
            mine = out.setdefault(label, {})
            for k, v in inc.items():
                mine[k] = mine.get(k, 0.0) + v
    return out


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


def _mode(s: pd.Series) -> str:
    return str(s.astype(str).value_counts().index[0]) if len(s) else ""


def _iso(ns) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(ns) / 1e9))
    except (TypeError, ValueError):
        return ""

