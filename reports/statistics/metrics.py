"""The one registry of every metric kvbench reports, and its evaluation over a request frame.

A metric is an object (``reports.metric_kinds``) that knows its definition (``value(frame) ->
float`` over a request frame, ``reports.frame.request_frame``) and its own replicate strategy
(``replicates``). The report, the gate and the ``kvbench run`` summary all evaluate metrics
through ``statistic``/``bootstrap``/``evaluate`` here, so a report and a gate verdict can never
disagree on a definition; the per-request values under them are ``reports.definitions``', the
live view's too.

Definitions (DESIGN.md; printed in every report's appendix from ``DEFINITIONS``):
latency metrics count successful requests only; lateness counts every request sent; the
intended-send latencies (``ttft_intended``, ``e2e_intended``) add a request's lateness to its
TTFT and E2E (coordinated omission: a backlog's delay is not hidden); rates
divide by the wall time of the load stages the rows came from. A request cancelled at the stop
(status ``cancelled``: still in flight when its stage or the run ended) is neither a success
nor an error: it is counted apart and left out of error rate, SLO attainment, throughput and
latency.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

# request_frame and NS_PER_MS are re-exported: the run summary, the gate and diagnosis build
# and read frames through this module
from kvbench.reports.measures.frame import (NS_PER_MS, achieved_s, itl_values,  # noqa: F401
                                   offered_s, request_frame, started_s, wall_s)
# the metric kinds and the flags over a frame are re-exported: the report's sections read them
from kvbench.reports.statistics.metric_kinds import (DEFINITIONS, Count, Goodput, Metric,  # noqa: F401
                                          PerRequest, PooledGaps, PrefixHitRatio, Sample,
                                          TokenRate, failed, finished, judged, mean, met_slo,
                                          quantile, with_slo)
from kvbench.reports.statistics.resampling import CI, drop_nan, interval
from kvbench.reports.measures.spec import METRIC_NAMES, metric_name  # noqa: F401 - re-exported

QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99, "p999": 0.999}


# --------------------------------------------------------------------------------------------
# the registry

METRIC_INFO: dict[str, Metric] = {}


def register(metric: Metric) -> Metric:
    if metric.name in METRIC_INFO:
        raise ValueError(f"metric {metric.name!r} is registered twice")
    METRIC_INFO[metric.name] = metric
    return metric


def _register_latencies() -> None:
    """Quantiles and means of each latency: ttft_p50 ... ttft_p999, ttft_mean, ..."""
    for base, col, label, term in (("ttft", "ttft_ms", "TTFT", "TTFT"),
                                   ("tpot", "tpot_ms", "TPOT", "TPOT"),
                                   ("itl", None, "ITL", "ITL"),
                                   ("e2e", "e2e_ms", "E2E", "E2E"),
                                   ("lateness", "lateness_ms", "client lateness", "lateness"),
                                   ("ttft_intended", "ttft_intended_ms", "TTFT from intended",
                                    "intended"),
                                   ("e2e_intended", "e2e_intended_ms", "E2E from intended",
                                    "intended")):
        for qn, q in [*QUANTILES.items(), ("mean", None)]:
            name, text = f"{base}_{qn}", f"{label} {qn.replace('p999', 'p99.9')}"
            register(PerRequest(name, text, term, col, q) if col else
                     PooledGaps(name, text, term, q))


_register_latencies()
register(Count("throughput_rps", "achieved throughput", "throughput", finished,
               per_second=True, higher_is_better=True, over=finished))
register(Count("offered_rps", "offered rate", "offered", lambda f: np.ones(len(f), bool),
               per_second=True, higher_is_better=True, window=offered_s))
register(Count("started_rps", "first tokens/s", "started", lambda f: f["ok"].to_numpy(),
               per_second=True, higher_is_better=True, over=finished, window=started_s))
register(Goodput("goodput_rps", "goodput at SLO", "goodput", met_slo,
                 per_second=True, higher_is_better=True, over=judged))
register(TokenRate("input_tps", "input tokens/s", "prompt_tokens"))
register(TokenRate("output_tps", "output tokens/s", "completion_tokens"))
register(Count("error_rate", "error rate", "error rate", failed,
               per_second=False, higher_is_better=False, over=finished))
register(Count("slo_attainment", "SLO attainment", "goodput", met_slo, per_second=False,
               higher_is_better=True, over=judged))
register(PrefixHitRatio("hit_ratio", "prefix hit ratio"))

# name -> function(frame) -> float, for callers that only evaluate.
METRICS: dict[str, Callable[[pd.DataFrame], float]] = {k: m.value for k, m in
                                                        METRIC_INFO.items()}


assert set(METRIC_INFO) == METRIC_NAMES, (
    "reports.spec.METRIC_NAMES must list every registered metric (and only those): "
    f"{sorted(set(METRIC_INFO) ^ METRIC_NAMES)}")


def statistic(frame: pd.DataFrame, name: str) -> float:
    """The value of metric ``name`` (see ``METRIC_INFO``) on the rows of ``frame``."""
    return METRIC_INFO[metric_name(name)].value(frame)


def hit_ratio(frame: pd.DataFrame) -> float:
    """The server-reported prefix hit ratio of ``frame``'s requests (metric ``hit_ratio``)."""
    return METRIC_INFO["hit_ratio"].value(frame)


def bootstrap_replicates(frame: pd.DataFrame, name: str, resamples: int = 1000,
                         seed: int = 0) -> tuple[float, np.ndarray]:
    """(estimate, seeded bootstrap replicates) of metric ``name`` over the requests of
    ``frame``, by the metric's own strategy."""
    return METRIC_INFO[metric_name(name)].replicates(frame, resamples,
                                                     np.random.default_rng(seed))


def bootstrap(frame: pd.DataFrame, name: str, resamples: int = 1000, confidence: float = 0.95,
              seed: int = 0) -> CI:
    """Seeded bootstrap percentile interval of metric ``name`` (see ``bootstrap_replicates``)."""
    return interval(*bootstrap_replicates(frame, name, resamples, seed), confidence)


def evaluate(frame: pd.DataFrame, names: Iterable[str], ci: bool = False,
             resamples: int = 1000, confidence: float = 0.95,
             seed: int = 0) -> dict[str, float | CI]:
    """Several metrics at once, extracting each sample (ITL pooled once) a single time.

    Same definitions and replicates as ``statistic``/``bootstrap``; CI tuples when ``ci``."""
    names = [metric_name(x) for x in names]
    by_source: dict[str, list[Sample]] = {}
    out: dict[str, float | CI] = {}
    for name in names:
        m = METRIC_INFO[name]
        if isinstance(m, Sample):
            by_source.setdefault(m.source, []).append(m)
        elif ci:
            out[name] = interval(*m.replicates(frame, resamples, np.random.default_rng(seed)),
                                 confidence)
        else:
            out[name] = m.value(frame)
    for ms in by_source.values():
        v = drop_nan(ms[0].sample(frame))
        if ci:
            for m in ms:
                out[m.name] = interval(*m.sample_replicates(
                    frame, v, resamples, np.random.default_rng(seed)), confidence)
            continue
        qs = [m for m in ms if m.q is not None]
        if qs:  # one partition for every quantile of the sample
            vals = np.quantile(v, [m.q for m in qs]) if len(v) else [math.nan] * len(qs)
            out.update({m.name: float(x) for m, x in zip(qs, vals)})
        for m in ms:
            if m.q is None:
                out[m.name] = m.of(v)
    return {n: out[n] for n in names}


# --------------------------------------------------------------------------------------------
# group-bys

# Columns the registry's metrics read (besides the group keys).
METRIC_COLUMNS = ("ok", "cancelled", "slo_met", "has_slo", "stage_key", "stage_wall_s",
                  "stage_achieved_s", "stage_offered_s", "stage_started_s", "prompt_tokens",
                  "completion_tokens", "cached_tokens", "ttft_ms", "tpot_ms", "e2e_ms",
                  "lateness_ms", "ttft_intended_ms", "e2e_intended_ms", "itl_row")


def slim(frame: pd.DataFrame, keep: Iterable[str] = ()) -> pd.DataFrame:
    """Only the columns metrics need (plus ``keep``): cheaper to subset and group."""
    cols = list(dict.fromkeys([*keep, *METRIC_COLUMNS]))
    return frame[cols]


def summarise(frame: pd.DataFrame, by: Sequence[str] = ("endpoint",),
              metrics: Iterable[str] = ("throughput_rps", "goodput_rps", "ttft_p50", "ttft_p99",
                                        "tpot_p50", "e2e_p99", "error_rate"),
              min_rows: int = 1) -> pd.DataFrame:
    """One row per group of ``by`` with each metric as a column (groups in sorted order)."""
    names = [metric_name(m) for m in metrics]
    rows = []
    frame = slim(frame, by)
    for key, sub in frame.groupby(list(by), observed=True, sort=True):
        if len(sub) < min_rows:
            continue
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(by, key))
        row["requests"] = len(sub)
        row.update(evaluate(sub, names))
        rows.append(row)
    return pd.DataFrame(rows, columns=list(by) + ["requests"] + names)


def outcomes(frame: pd.DataFrame) -> dict[str, int]:
    """How the requests ended: {requests, ok, errors, cancelled} (cancelled at the stop is
    neither ok nor an error), for run summaries and reports."""
    ok = int(frame["ok"].sum())
    cancelled = int(frame["cancelled"].sum())
    return {"requests": len(frame), "ok": ok, "errors": len(frame) - ok - cancelled,
            "cancelled": cancelled}


def error_breakdown(frame: pd.DataFrame, by: Sequence[str] = ("endpoint",)) -> pd.DataFrame:
    """Counts of requests by status (and ``by``), with each status's share of the group.
    Pass the errors only (``frame[failed(frame)]``) for a breakdown of errors."""
    g = frame.groupby(list(by) + ["status"], observed=True).size().rename("requests")
    out = g.reset_index()
    out["share"] = out["requests"] / out.groupby(list(by), observed=True)["requests"].transform(
        "sum")
    return out
