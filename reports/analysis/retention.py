"""The retention probe's report: hit probability and TTFT of a resent prefix against the idle
gap, one line per background working set, with the eviction knee measured (where the hit
probability falls through one half) beside the knee an LRU cache of the endpoint's capacity
predicts at the background rate the probe achieved."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

HIT = 0.5  # a resend "hits" when at least half its prefix came from the cache


def points_frame(result: dict) -> pd.DataFrame:
    f = pd.DataFrame(result.get("points") or [])
    if f.empty:
        return f
    f["hit"] = f["hit_fraction"].astype(float) >= HIT
    f["new_rate"] = f["background_new_tokens"] / f["gap_actual_s"].clip(lower=1e-9)
    return f


def _crossing(x: np.ndarray, y: np.ndarray, log: bool) -> float | None:
    """Where ``y`` (falling with ``x``) first passes below ``HIT``, interpolated (in log x
    when ``log``); None when it never does."""
    below = np.flatnonzero(y < HIT)
    if not len(below):
        return None
    i = below[0]
    if i == 0:
        return float(x[0])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    w = (y0 - HIT) / (y0 - y1) if y0 != y1 else 0.0
    if log:
        return float(math.exp(math.log(x0) + w * (math.log(x1) - math.log(x0))))
    return float(x0 + w * (x1 - x0))


def summary(result: dict) -> list[dict]:
    """Per working set: the ladder's hit probability and median TTFT per gap, the measured knee
    (gap, and new background tokens) and the LRU prediction at the achieved rate."""
    f = points_frame(result)
    if f.empty:
        return []
    spec = result["spec"]
    capacity, probe = spec["capacity_tokens"], spec["probe_tokens"]
    knee_tokens = (result.get("predicted_knee") or {}).get("new_tokens",
                                                           capacity - probe / 2)
    out = []
    for m, sub in f.groupby("working_set", sort=True):
        by_gap = sub.groupby("gap_s", sort=True).agg(
            hit_probability=("hit", "mean"), hit_fraction=("hit_fraction", "mean"),
            ttft_ms=("ttft_s", lambda s: 1e3 * float(np.median(s))),
            ttft_cold_ms=("ttft_cold_s", lambda s: 1e3 * float(np.median(s))),
            new_tokens=("background_new_tokens", "mean"), trials=("trial", "count"))
        gaps = by_gap.index.to_numpy(float)
        frac = by_gap["hit_fraction"].to_numpy(float)
        rate = float(np.median(sub["new_rate"]))
        evicts = m * capacity > capacity - probe
        measured_gap = _crossing(gaps, frac, log=True)
        order = np.argsort(by_gap["new_tokens"].to_numpy(float))
        measured_tokens = _crossing(by_gap["new_tokens"].to_numpy(float)[order], frac[order],
                                    log=False)
        out.append({
            "working_set": float(m), "evicts": bool(evicts),
            "gaps": [{"gap_s": float(g), **{k: float(v) for k, v in r.items()}}
                     for g, r in by_gap.iterrows()],
            "new_tokens_per_s": rate,
            "knee_gap_s": measured_gap, "knee_new_tokens": measured_tokens,
            "predicted_gap_s": knee_tokens / rate if evicts and rate > 0 else None,
            "predicted_new_tokens": knee_tokens if evicts else None,
        })
    return out


def figures(result: dict) -> list:
    """Two plotly figures: hit probability, and resend TTFT, against the gap."""
    import plotly.graph_objects as go

    rows = summary(result)
    hit, ttft = go.Figure(), go.Figure()
    for i, r in enumerate(rows):
        name = f"working set {r['working_set']:g}x capacity"
        g = [x["gap_s"] for x in r["gaps"]]
        hit.add_trace(go.Scatter(x=g, y=[x["hit_probability"] for x in r["gaps"]],
                                 mode="lines+markers", name=name))
        ttft.add_trace(go.Scatter(x=g, y=[x["ttft_ms"] for x in r["gaps"]],
                                  mode="lines+markers", name=name))
        if r["predicted_gap_s"]:  # a trace, not a shape: shapes misplace labels on log axes
            hit.add_trace(go.Scatter(x=[r["predicted_gap_s"]] * 2, y=[0, 1], mode="lines",
                                     line_dash="dash", name=f"LRU knee {r['working_set']:g}x"))
        if r["knee_gap_s"]:
            hit.add_trace(go.Scatter(x=[r["knee_gap_s"]], y=[HIT], mode="markers",
                                     marker_symbol="x", marker_size=12,
                                     name=f"measured knee {r['working_set']:g}x"))
    for fig, title, y in ((hit, "Hit probability of a resent prefix", "hit probability"),
                          (ttft, "Resend time to first token", "TTFT (ms)")):
        fig.update_layout(title=title, template="plotly_white", height=380,
                          xaxis_title="idle gap (s), background load running",
                          yaxis_title=y)
        fig.update_xaxes(type="log")
    return [hit, ttft]


def render_html(result: dict) -> str:
    """One self-contained page (plotly inlined): the figures and the knee table."""
    import html

    import plotly.io as pio

    rows = summary(result)
    spec = result["spec"]
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>kvbench retention "
             "probe</title></head><body style='font-family:sans-serif'>",
             f"<h1>Retention probe: {html.escape(str(result.get('endpoint')))}</h1>",
             f"<p>KV capacity {spec['capacity_tokens']:,} tokens (block "
             f"{spec['block_tokens']}), probe {spec['probe_tokens']:,} tokens, background "
             f"prompts of {spec['background_tokens']:,} tokens at "
             f"{spec['rate_tokens_s']:,.0f} tokens/s, {spec['trials']} trial(s) per point. "
             "Knee: where the resent prefix's cached fraction falls through one half; LRU "
             "predicts it after capacity - probe/2 newly computed background tokens.</p>",
             "<table border=1 cellpadding=4><tr><th>working set</th><th>measured knee "
             "(gap s)</th><th>LRU knee (gap s)</th><th>measured knee (new tokens)</th>"
             "<th>LRU knee (new tokens)</th><th>new tokens/s</th></tr>"]
    for r in rows:
        cells = [f"{r['working_set']:g}x", _f(r["knee_gap_s"]), _f(r["predicted_gap_s"]),
                 _f(r["knee_new_tokens"], 0), _f(r["predicted_new_tokens"], 0),
                 _f(r["new_tokens_per_s"], 0)]
        parts.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    parts.append("</table>")
    for note in result.get("notes") or ():
        parts.append(f"<p><b>Note:</b> {html.escape(note)}</p>")
    for i, fig in enumerate(figures(result)):
        parts.append(pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False))
    parts.append("</body></html>")
    return "\n".join(parts)


def _f(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "none"
    return f"{x:,.{digits}f}" if digits else f"{x:,.0f}"
