"""A calibrated twin's prediction beside the run's measurement, and the finding that names the
parameter explaining a gap between them.

``kvbench predict --save RUN_DIR`` writes ``RUN_DIR/prediction.json`` (``PREDICTION_FILE``):
``{"kind": "kvbench-prediction", "predictions": [...]}``, each entry one ``predict`` result
(workload, SLOs, seeds, virtual seconds, the twin's source) whose endpoints each name the
run's endpoint they predict (``measured_endpoint``). Where the run holds a capacity search of
that endpoint and workload, ``compare`` sets the predicted capacity at SLO beside the
search's, and each predicted latency point (TTFT/TPOT p50/p99 per class at a fraction of the
predicted capacity) beside the same class in the measured stage of the nearest rate.

``twin_gap`` (a diagnosis rule) then names one parameter per endpoint, first that applies:

1. a measured prefix hit ratio more than ``GAP`` below the predicted one: KV capacity
   (``kv_capacity_tokens``): the twin keeps prefixes the engine evicts;
2. TTFT p50 at the lowest predicted load off by more than ``GAP`` while TPOT p50 there is
   within it: prefill rate (``prefill_tok_per_ms``, ``frontend_us_per_prompt_token``);
3. TPOT p50 at the lowest load off by more than ``GAP``: decode (``hbm_gb_s``,
   ``kv_bytes_per_token``);
4. capacity at SLO off by more than ``GAP`` while both low-load medians are within it (and
   the prediction judged the report's SLOs): scheduler limits (``max_num_seqs``,
   ``step_token_budget``): the same per-request speed, a different point where requests
   start to queue. Where the search found no failure its capacity is a lower bound: only a
   prediction below it by more than ``GAP`` is a gap; where it passed no rate, the capacity
   lies below its lowest failure: only a prediction above that by more than ``GAP`` is.

Medians at the lowest load, not p99s: with few requests per class a p99 is a handful of
requests, and at low load the median is one request's own prefill and decode.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvbench.reports.analysis.diagnose.base import MIN_ROWS, Finding
from kvbench.reports.analysis.numbering import stage_label
from kvbench.reports.measures.data import ReportData

PREDICTION_FILE = "prediction.json"
KIND = "kvbench-prediction"
GAP = 0.15  # a relative gap beyond this is a finding (the "within 15%")
LATENCY = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")

NAMES = {"ttft_p50": "TTFT p50", "tpot_p50": "TPOT p50"}
PARAMETERS = {
    "kv_capacity": ("KV capacity", ("kv_capacity_tokens",)),
    "prefill": ("prefill rate", ("prefill_tok_per_ms", "frontend_us_per_prompt_token",
                                 "prefill_ms_per_token2")),
    "decode": ("decode", ("hbm_gb_s", "kv_bytes_per_token", "step_us_per_seq")),
    "scheduler": ("scheduler limits", ("max_num_seqs", "step_token_budget")),
}


def read_predictions(run_dir: Path | str) -> list[dict]:
    """The predictions saved in ``run_dir`` (none: an empty list). A file that is not a
    saved prediction is ignored rather than failing the whole report."""
    p = Path(run_dir) / PREDICTION_FILE
    try:
        data = json.loads(p.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("kind") != KIND:
        return []
    return [x for x in data.get("predictions", []) if isinstance(x, dict)]


def error(pred, meas) -> float | None:
    """(predicted - measured) / measured; None where either is missing or measured is 0."""
    if pred is None or meas is None or not meas or _nan(pred) or _nan(meas):
        return None
    return (float(pred) - float(meas)) / float(meas)


def _nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _label(d: ReportData, name: str, run_id: str) -> str | None:
    shown = set(d.endpoint_names)
    for label in (name, f"{name}@{run_id}"):
        if label in shown:
            return label
    return None


def compare(d: ReportData, caps=None) -> list[dict]:
    """Per predicted endpoint that the run measured under the same workload: the predicted
    and measured capacity at SLO (the search's estimate; None: no search of it), per GPU,
    their error, and the latency points (see the module's docstring)."""
    from kvbench.reports.analysis import capacity as C

    saved = [(str(meta.run_id or Path(path).name), pred) for path, meta in zip(d.paths, d.runs)
             for pred in read_predictions(path)]
    if not saved:
        return []
    if caps is None:
        caps = C.summarise(d.stages, d.frame, d.slo) if any(
            s.search is not None for s in d.stages) else []
    out = []
    for run_id, pred in saved:
        wl = str(pred.get("workload"))
        for e in pred.get("endpoints", []):
            label = _label(d, str(e.get("measured_endpoint") or e.get("endpoint")), run_id)
            if label is not None:
                out.append(_one(d, pred, e, label, wl, caps))
    return out


def _one(d: ReportData, pred: dict, e: dict, label: str, wl: str, caps) -> dict:
    cap = next((c for c in caps if c.endpoint == label and c.workload == wl
                and c.unit == "req/s"), None)
    pc = (e.get("capacity") or {}).get("median")
    mc = cap.estimate_rps if cap is not None else None
    # nothing failed: the capacity is a lower bound (the error an upper one); nothing
    # passed: below the lowest failure (an upper bound, the error a lower one)
    bound = None
    if cap is not None and mc is not None and cap.fail_rps is None:
        bound = "lower"
    elif cap is not None and mc is None and cap.fail_rps is not None:
        bound, mc = "upper", cap.fail_rps
    gpus = d.endpoint(label).gpus
    rows = d.frame[(d.frame["endpoint"].astype(str) == label)
                   & (d.frame["workload"].astype(str) == wl)]
    stages = [s for s in d.stages if str(s.endpoint) == label and str(s.workload) == wl
              and s.rate_rps is not None and (s.search is None or s.search.role != "warmup")]
    points = []
    for p in e.get("latency", []):
        rate = float(p["rate"])
        near = min(stages, key=lambda s: abs(math.log(float(s.rate_rps) / rate)),
                   default=None) if rate > 0 else None
        sub = rows[rows["stage"].astype(int) == int(near.index)] if near is not None else None
        for cls, x in sorted((p.get("classes") or {}).items()):
            mine = sub[sub["request_class"].astype(str) == cls] if sub is not None else None
            meas = _measured(mine)
            pt = {"load": p.get("load"), "rate": rate, "class": cls,
                  "stage": None if near is None else int(near.index),
                  "stage_label": None if near is None else stage_label(near),
                  "measured_rate": None if near is None else float(near.rate_rps),
                  "n": 0 if mine is None else int(len(mine))}
            for m in LATENCY:
                pt[f"pred_{m}"] = x.get(f"{m}_ms")
                pt[f"meas_{m}"] = meas.get(m)
                pt[f"err_{m}"] = error(x.get(f"{m}_ms"), meas.get(m))
            pt["pred_hit_ratio"] = x.get("hit_ratio")
            pt["meas_hit_ratio"] = meas.get("hit_ratio")
            points.append(pt)
    return {"endpoint": label, "twin_endpoint": e.get("endpoint"), "workload": wl,
            "slo_differs": slo_differs(pred.get("slo"), d.slo),
            "topology": e.get("topology"), "what_if": bool(e.get("what_if")),
            "twin": pred.get("twin") or {"config": pred.get("config")},
            "seeds": pred.get("seeds"), "seconds": pred.get("seconds"),
            "pred_capacity": pc, "meas_capacity": mc, "err_capacity": error(pc, mc),
            "pred_per_gpu": (e.get("capacity") or {}).get("median_per_gpu"),
            "meas_per_gpu": mc / gpus if mc is not None and gpus else None,
            "meas_status": None if cap is None else cap.status,
            "meas_bound": bound,
            "points": points, "fitted": e.get("fitted", []), "assumed": e.get("assumed", [])}


def slo_differs(predicted: dict | None, judged: dict) -> list[str]:
    """Classes whose SLO the prediction judged otherwise than the report does (its capacity
    then answers another question); empty where the prediction did not say."""
    if not isinstance(predicted, dict):
        return []
    mine = {c: s.limits() for c, s in judged.items() if s.judged}
    theirs = {str(c): {k: float(v) for k, v in (x or {}).items()}
              for c, x in predicted.items() if isinstance(x, dict) and x}
    return sorted(c for c in set(mine) | set(theirs) if mine.get(c) != theirs.get(c))


def _measured(rows) -> dict:
    if rows is None or len(rows) < MIN_ROWS:
        return {}
    from kvbench.reports.statistics import metrics as M

    v = M.evaluate(rows, (*LATENCY, "hit_ratio"))
    return {k: (None if _nan(x) else float(x)) for k, x in v.items()}


def _big(err) -> bool:
    return err is not None and abs(err) > GAP


def _small(err) -> bool:
    return err is not None and abs(err) <= GAP


def explain(c: dict) -> tuple[str, dict] | None:
    """The parameter explaining ``c``'s gap (a ``compare`` entry), by the module's rule:
    (key of ``PARAMETERS``, the gaps that decided it); None: no gap beyond ``GAP``, or no
    evidence to tell."""
    low = [p for p in c["points"] if p["load"] is not None]
    lowest = min((p["load"] for p in low), default=None)
    low = [p for p in low if p["load"] == lowest and p["n"] >= MIN_ROWS]
    # measured below predicted, relative to the prediction (a measured 0 is a gap too)
    hit = max((1 - p["meas_hit_ratio"] / p["pred_hit_ratio"] for p in c["points"]
               if p["pred_hit_ratio"] and p["meas_hit_ratio"] is not None), default=None)
    if hit is not None and hit > GAP:
        return "kv_capacity", {"hit_ratio": hit}
    ttft = _worst([p["err_ttft_p50"] for p in low])
    tpot = _worst([p["err_tpot_p50"] for p in low])
    if _big(ttft) and not _big(tpot):
        return "prefill", {"ttft_p50": ttft, "tpot_p50": tpot}
    if _big(tpot):
        return "decode", {"ttft_p50": ttft, "tpot_p50": tpot}
    cap = c["err_capacity"]
    if cap is not None and (c["meas_bound"] == "lower" and cap > 0
                            or c["meas_bound"] == "upper" and cap < 0):
        cap = None  # on the open side of a bound: no gap shown
    if _big(cap) and _small(ttft) and (_small(tpot) or tpot is None) \
            and not c["slo_differs"]:
        return "scheduler", {"capacity": cap, "ttft_p50": ttft, "tpot_p50": tpot}
    return None


def _worst(errs) -> float | None:
    errs = [e for e in errs if e is not None]
    return max(errs, key=abs) if errs else None


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}%"


def twin_gap(d: ReportData) -> list[Finding]:
    """A finding per endpoint whose prediction misses its measurement by more than ``GAP``,
    naming the parameter the module's rule picks."""
    out = []
    for c in compare(d):
        why = explain(c)
        if why is None:
            continue
        key, gaps = why
        name, options = PARAMETERS[key]
        meas_word = {"lower": "at least ", "upper": "below "}.get(c["meas_bound"], "")
        err_word = {"lower": "at most ", "upper": "at least "}.get(c["meas_bound"], "")
        ev = [("predicted capacity at SLO (req/s)",
               "n/a" if c["pred_capacity"] is None else f"{c['pred_capacity']:.3g}"),
              ("measured capacity at SLO (req/s)",
               "n/a" if c["meas_capacity"] is None else f"{meas_word}{c['meas_capacity']:.3g}"),
              ("capacity error", err_word + _pct(c["err_capacity"]))]
        ev += [(f"{NAMES[k]} error at the lowest predicted load", _pct(v))
               for k, v in gaps.items() if k in ("ttft_p50", "tpot_p50")]
        if "hit_ratio" in gaps:
            ev.append(("prefix hit ratio: measured below predicted by",
                       f"{100 * gaps['hit_ratio']:.0f}% of the predicted"))
        out.append(Finding(
            rule="twin_gap", endpoint=c["endpoint"],
            title=f"{c['endpoint']}: the twin's prediction misses on {name} ({c['workload']})",
            evidence=ev,
            cause=f"the gap is the kind {name} makes ({', '.join(options)}): "
                  + {"kv_capacity": "the engine keeps fewer prefixes than the twin",
                     "prefill": "first tokens at low load differ while decode agrees",
                     "decode": "time per output token differs at low load",
                     "scheduler": "per-request latency agrees at low load, yet the load "
                                  "at which requests queue differs"}[key],
            fix=f"recalibrate {', '.join(options)} (kvbench calibrate on a run whose "
                "calibration profile exercises it), or set it in the twin's options, and "
                "predict again",
            numbers={"parameter": key, "options": list(options), **gaps,
                     "capacity_error": c["err_capacity"]}))
    return out
