"""Prediction beside measurement in the report: where a run folder holds a twin's prediction
(``kvbench predict --save RUN_DIR``, ``reports.analysis.diagnose.twin``) of an endpoint and
workload the run measured, per endpoint the predicted capacity at SLO beside the capacity
search's, their error, and predicted TTFT/TPOT p99 per class beside the measured stage of the
nearest rate. Every predicted figure says "predicted"; the twin's assumed (not fitted)
parameters are listed with it. The HTML and Markdown pages print the dicts built here."""

from __future__ import annotations

from kvbench.reports.analysis.diagnose import twin as T
from kvbench.reports.measures.data import ReportData
from kvbench.reports.rendering.cells import fmt


# options that shape no figure of a prediction (names, seeds, fault injection, wall-time
# scale): left out of the assumed list
OPERATIONAL = frozenset({"model_name", "hostname", "seed", "faults", "pin_header",
                         "time_scale", "region_names"})


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:+.1f}%"


def _value(v) -> str:
    return "derived" if v is None else str(v)


def build_prediction(d: ReportData, capacity: dict | None = None) -> list[dict]:
    """One entry per predicted endpoint x workload the run measured (empty: no prediction
    saved, or none of a measured endpoint)."""
    caps = capacity["caps"] if capacity else []
    out = []
    for c in T.compare(d, caps):
        twin = c["twin"] or {}
        rows = [{"load": f"{p['load']:g}x" if p["load"] is not None else "–",
                 "rate": fmt(p["rate"]), "class": p["class"],
                 "measured_at": ("–" if p["stage"] is None else
                                 f"{fmt(p['measured_rate'])} req/s ({p['stage_label']}, "
                                 f"{p['n']} requests)"),
                 **{f"{side}_{m}": fmt(p[f"{side}_{m}"]) for side in ("pred", "meas")
                    for m in ("ttft_p99", "tpot_p99")},
                 "err_ttft_p99": _pct(p["err_ttft_p99"]),
                 "err_tpot_p99": _pct(p["err_tpot_p99"]),
                 "pred_hit": fmt(p["pred_hit_ratio"], "fraction"),
                 "meas_hit": fmt(p["meas_hit_ratio"], "fraction")} for p in c["points"]]
        fitted = ", ".join(f"{f['option']}={f['value']}" + (
            f" ({f['status']})" if f.get("status") not in (None, "fit") else "")
            for f in c["fitted"]) or "none"
        assumed = ", ".join(f"{a['option']}={_value(a['value'])} ({a['source']}"
                            + ("; not observable in the measured topology"
                               if a.get("unobserved") else "") + ")" for a in c["assumed"]
                            if a["option"] not in OPERATIONAL)
        out.append({
            "endpoint": c["endpoint"], "workload": c["workload"],
            "twin_endpoint": c["twin_endpoint"],
            "topology": c["topology"] + (" (what-if)" if c["what_if"] else ""),
            "source": twin.get("path") or twin.get("config") or "–",
            "source_run": twin.get("source_run"),
            "seeds": ", ".join(str(s) for s in c["seeds"] or []) or "–",
            "seconds": fmt(c["seconds"]),
            "pred_capacity": fmt(c["pred_capacity"]),
            "meas_capacity": "no capacity search" if c["meas_capacity"] is None else {
                "lower": f"≥ {fmt(c['meas_capacity'])} (nothing failed: a lower bound)",
                "upper": f"< {fmt(c['meas_capacity'])} (the search passed no rate)"}.get(
                    c["meas_bound"], fmt(c["meas_capacity"])),
            "err_capacity": {"lower": "≤ ", "upper": "≥ "}.get(c["meas_bound"], "")
            + _pct(c["err_capacity"]),
            "err_capacity_value": c["err_capacity"],
            "pred_per_gpu": fmt(c["pred_per_gpu"]),
            "meas_per_gpu": {"lower": "≥ ", "upper": "< "}.get(c["meas_bound"], "")
            + fmt(c["meas_per_gpu"]),
            "rows": rows, "fitted": fitted, "assumed": assumed or "none",
            "slo_differs": ", ".join(c["slo_differs"])})
    return out
