"""Per-GPU and per-dollar figures, and the latency-throughput Pareto frontier.

Each load stage of an endpoint (a rung of a ladder, a probe of a capacity search) is one point:
output tokens/s per GPU (what the endpoint's GPUs deliver) against per-user output tokens/s
(how fast one user's answer streams). More load moves a point right and down; the frontier of
the points says which endpoint gives the most throughput at a given speed per user. Definitions
(``DEFINITIONS``) go into the report's appendix.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from kvbench.core.contract import EndpointEntry, StageEntry
from kvbench.reports.measures.frame import achieved_s

KNEE_FRACTION = 0.8  # the knee: the most throughput while users keep 80% of their best speed
SECONDS_PER_HOUR = 3600.0

DEFINITIONS = {
    "GPUs": "the GPUs an endpoint runs, from run.json: a built-in endpoint's from its topology "
            "(colocated and offloaded: replicas; disaggregated: prefill + decode GPUs; routed: "
            "regions x replicas; offloaded KV in DRAM or on disk is no GPU); an openai "
            "endpoint's as configured (gpus, default 1).",
    "per GPU": "output tokens/s per GPU: output tokens of successful requests per second of "
               "the achieved interval (first send to last completion, per stage), divided by "
               "the endpoint's GPUs.",
    "$ / M output tokens": "cost per million output tokens: GPUs x gpu_hour_cost / (3600 x "
                           "output tokens/s) x 1e6, at the achieved output rate of the stage "
                           "(or of all the endpoint's stages: their tokens over their summed "
                           "achieved intervals). Prices of built-in endpoints are example "
                           "prices from bench.toml, not quotes.",
    "per-user tokens/s": "per-user output tokens/s: median over a stage's successful requests "
                         "with more than one output token of 1000 / TPOT (ms), the speed at "
                         "which one user's answer streams once it started (TTFT is judged by "
                         "the SLOs, not here).",
    "Pareto frontier": "the stages (of every endpoint) that no other stage beats on both "
                       "output tokens/s per GPU and per-user tokens/s; to the right of it no "
                       "measured configuration is faster per user.",
    "knee": f"per endpoint, the point of its own frontier with the most output tokens/s per "
            f"GPU whose per-user tokens/s is still at least {KNEE_FRACTION:.0%} of the "
            f"endpoint's best: the most throughput before users lose more than "
            f"{1 - KNEE_FRACTION:.0%} of their speed.",
}


def gpus_of(entry: EndpointEntry) -> tuple[int, bool]:
    """(GPUs, known) of a run.json endpoint entry: 1 and False when it does not say."""
    try:
        n = int(entry.gpus)
    except (TypeError, ValueError):
        return 1, False
    return (n, True) if n > 0 else (1, False)


def output_tokens(frame: pd.DataFrame) -> float:
    """Output tokens of the successful requests (server-reported usage, else the client's
    count)."""
    return float(np.nansum(frame["completion_tokens"].to_numpy()[frame["ok"].to_numpy()]))


def output_tps(frame: pd.DataFrame) -> float:
    """Achieved output tokens/s of the rows' stages (each stage's achieved interval once)."""
    w = achieved_s(frame)
    tok = output_tokens(frame)
    return tok / w if w == w and w > 0 and tok > 0 else math.nan


def cost_per_m(gpus: float, gpu_hour_cost: float | None, tps: float) -> float:
    """Dollars per million output tokens at ``tps`` output tokens/s on ``gpus`` GPUs."""
    if gpu_hour_cost is None or not (tps > 0) or not (gpus > 0):
        return math.nan
    return float(gpu_hour_cost) * float(gpus) / (SECONDS_PER_HOUR * tps) * 1e6


def per_user_tps(frame: pd.DataFrame) -> float:
    """Median of 1000 / TPOT (ms) over the successful requests with a TPOT."""
    tpot = frame["tpot_ms"].to_numpy(dtype=np.float64)
    tpot = tpot[np.isfinite(tpot) & (tpot > 0)]
    return float(np.median(1000.0 / tpot)) if len(tpot) else math.nan


def stage_points(frame: pd.DataFrame, endpoints: Mapping[str, EndpointEntry],
                 stages: Sequence[StageEntry] = ()) -> pd.DataFrame:
    """One row per (endpoint, workload, stage): GPUs, price, output tokens, achieved interval,
    output tokens/s (total and per GPU), per-user tokens/s, $ / M output tokens, and the
    stage's planned load (``rate_rps`` or ``users`` from run.json stages, when given)."""
    cols = ["endpoint", "workload", "stage", "gpus", "gpus_known", "gpu_hour_cost",
            "example_price", "requests", "output_tokens", "achieved_s", "output_tps",
            "tps_per_gpu", "per_user_tps", "cost_per_m", "rate_rps", "users"]
    if not len(frame):
        return pd.DataFrame(columns=cols)
    plan = {(str(s.endpoint), str(s.workload), int(s.index)): s for s in stages}
    lean = frame[["endpoint", "workload", "stage", "ok", "completion_tokens", "tpot_ms",
                  "stage_key", "stage_achieved_s"]]
    rows = []
    for (ep, wl, st), sub in lean.groupby(["endpoint", "workload", "stage"], observed=True,
                                          sort=True):
        entry = endpoints.get(str(ep)) or EndpointEntry(name=str(ep))
        gpus, known = gpus_of(entry)
        price = entry.gpu_hour_cost
        tps = output_tps(sub)
        s = plan.get((str(ep), str(wl), int(st))) or StageEntry()
        rows.append({"endpoint": str(ep), "workload": str(wl), "stage": int(st), "gpus": gpus,
                     "gpus_known": known, "gpu_hour_cost": price,
                     "example_price": price is not None and entry.kind == "builtin",
                     "requests": len(sub), "output_tokens": output_tokens(sub),
                     "achieved_s": achieved_s(sub), "output_tps": tps,
                     "tps_per_gpu": tps / gpus, "per_user_tps": per_user_tps(sub),
                     "cost_per_m": cost_per_m(gpus, price, tps),
                     "rate_rps": s.rate_rps, "users": s.users})
    return pd.DataFrame(rows, columns=cols)


def endpoint_figures(frame: pd.DataFrame, entry: EndpointEntry) -> dict:
    """Over all of an endpoint's rows: output tokens/s, per GPU, and $ / M output tokens."""
    return endpoint_figures_of(output_tps(frame), entry)


def endpoint_figures_of(tps: float, entry: EndpointEntry) -> dict:
    """``endpoint_figures`` from the endpoint's output tokens/s (``tps``), however computed
    (the request frame's, or out of core: ``reports.rendering.scale``)."""
    gpus, known = gpus_of(entry)
    price = entry.gpu_hour_cost
    return {"gpus": gpus, "gpus_known": known, "gpu_hour_cost": price,
            "example_price": price is not None and entry.kind == "builtin",
            "output_tps": tps, "tps_per_gpu": tps / gpus,
            "cost_per_m": cost_per_m(gpus, price, tps)}


def frontier(x: Sequence[float], y: Sequence[float]) -> np.ndarray:
    """Indices of the points no other point dominates when both coordinates are better higher
    (q dominates p: q.x >= p.x, q.y >= p.y, one of them strictly), in order of increasing x.
    Points with a NaN coordinate are never on it; equal points are all on it."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    idx = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    if not len(idx):
        return np.zeros(0, dtype=np.int64)
    order = idx[np.lexsort((-y[idx], -x[idx]))]  # x descending, then y descending
    keep = []
    best_right = -math.inf  # the highest y among points of strictly larger x
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and x[order[j]] == x[order[i]]:
            j += 1
        top = y[order[i]]  # the group's highest y (sorted descending)
        if top > best_right:
            keep += [k for k in order[i:j] if y[k] == top]
        best_right = max(best_right, top)
        i = j
    keep = np.asarray(keep, dtype=np.int64)
    return keep[np.lexsort((y[keep], x[keep]))]


def knee(x: Sequence[float], y: Sequence[float], fraction: float = KNEE_FRACTION) -> int | None:
    """Index of the knee of one endpoint's points: among its frontier, the point with the
    highest x whose y is at least ``fraction`` of the highest y (None without points)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    front = frontier(x, y)
    if not len(front):
        return None
    floor = fraction * float(y[front].max())
    ok = [k for k in front if y[k] >= floor]
    return int(max(ok, key=lambda k: (x[k], y[k])))
