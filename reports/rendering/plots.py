"""The report's figures, built with plotly from summarised data (quantiles and bins, never raw
points at scale), returned as plotly JSON-ready dicts. Over 400 lines: one function per
figure, each short; splitting them would only scatter the shared layout and colours."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvbench.model import costmodel
from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.statistics import metrics as M
from kvbench.reports.analysis import pareto as P
from kvbench.reports.measures.data import ReportData
from kvbench.reports.measures.frame import itl_values
from kvbench.reports.statistics.resampling import drop_nan

TIME_BINS = 60
SCATTER_POINTS = 1500  # per topology, seeded sample
_LAYOUT = dict(template="plotly_white", height=380, margin=dict(l=60, r=20, t=50, b=50),
               legend=dict(orientation="h", y=-0.2))


class Figure(dict):
    """A figure as plotly JSON (data, layout) plus a title and an optional note."""


def _fig(fig: go.Figure, key: str, title: str, note: str = "") -> Figure:
    fig.update_layout(title=title, **_LAYOUT)
    d = fig.to_plotly_json()
    return Figure(key=key, title=title, note=note, data=d["data"], layout=d["layout"])


def _colour(i: int) -> str:
    palette = plotly.colors.qualitative.Plotly
    return palette[i % len(palette)]


def _times_rel_s(frame: pd.DataFrame) -> np.ndarray:
    """Seconds since each endpoint's first send (endpoints of a bake-off ran at other times)."""
    t = frame["t_sent_ns"].to_numpy()
    first = frame.groupby("endpoint", observed=True)["t_sent_ns"].transform("min").to_numpy()
    return (t - first) / 1e9


def cdf_points(values: np.ndarray, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """(x, F(x)) for plotting a CDF without shipping raw points: quantiles at ``points``
    levels, or above 1M values a histogram on log-spaced bins (exact at the bin edges, O(n))."""
    v = drop_nan(values)
    if len(v) == 0:
        return np.zeros(0), np.zeros(0)
    if len(v) > 1_000_000:
        lo = max(float(v.min()), 1e-3)
        hi = max(float(v.max()), lo * 1.001)
        logs = np.log(np.maximum(v, lo, dtype=np.float32))
        counts, edges = np.histogram(logs, bins=points * 4, range=(math.log(lo),
                                                                   math.log(hi) + 1e-9))
        return np.exp(edges[1:]), np.cumsum(counts) / len(v)
    levels = np.concatenate([np.linspace(0, 0.99, points - 40, endpoint=False),
                             np.linspace(0.99, 1.0, 40)])
    return np.quantile(v, levels), levels


def cdfs(d: ReportData, itl_cache: dict[str, np.ndarray]) -> list[Figure]:
    """CDFs of TTFT, ITL and E2E: one series per endpoint x workload (per endpoint where
    every endpoint ran one workload)."""
    out = []
    f = d.frame
    ep_col = f["endpoint"].to_numpy()
    wl_col = f["workload"].astype(str).to_numpy()
    pairs = [(ep, wl) for ep in d.endpoint_names for wl in dict.fromkeys(wl_col[ep_col == ep])]
    names = series_names(pairs)
    one = len({wl for _, wl in pairs}) <= 1
    masks = {p: (ep_col == p[0]) & (wl_col == p[1]) for p in pairs}
    itls = ({p: itl_cache[p[0]] for p in pairs} if one else
            {p: itl_values(f[masks[p]]) for p in pairs})
    for key, col, title in (("cdf_ttft", "ttft_ms", "CDF of TTFT"),
                            ("cdf_itl", "itl_ms", "CDF of inter-token latency (ITL)"),
                            ("cdf_e2e", "e2e_ms", "CDF of end-to-end latency (E2E)")):
        fig = go.Figure()
        for p in pairs:
            v = itls[p] if col == "itl_ms" else f[col].to_numpy()[masks[p]]
            x, y = cdf_points(v)
            if len(x):
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=names[p]))
        fig.update_xaxes(title_text="ms", type="log")
        fig.update_yaxes(title_text="fraction of " + ("gaps" if col == "itl_ms" else
                                                      "requests"), range=[0, 1])
        out.append(_fig(fig, key, title))
    return out


def series_names(pairs) -> dict:
    """A legend name per (endpoint, workload): the endpoint alone when every series runs one
    workload, the workload alone when there is one endpoint, both otherwise (a legend names
    only what differs)."""
    pairs = list(dict.fromkeys((str(e), str(w)) for e, w in pairs))
    eps = {e for e, _ in pairs}
    wls = {w for _, w in pairs}
    return {(e, w): (e if len(wls) <= 1 else w if len(eps) == 1 else f"{e} · {w}")
            for e, w in pairs}


def load_curves(d: ReportData, stage_table: pd.DataFrame) -> list[Figure]:
    """Latency and goodput against offered load: one series per endpoint x workload (one
    point per stage; workloads are never joined into one line), and one offered-load
    reference (achieved = offered) where the stages ran at a rate."""
    if stage_table.empty:
        return []
    lat = go.Figure()
    good = go.Figure()
    x_title = stage_table.attrs.get("x_title", "offered load")
    groups = list(stage_table.groupby(["endpoint", "workload"], sort=False, observed=True))
    names = series_names(k for k, _ in groups)
    for i, (key, rows) in enumerate(groups):
        name = names[(str(key[0]), str(key[1]))]
        rows = rows.sort_values("offered")
        colour = _colour(i)
        lat.add_trace(go.Scatter(x=rows["offered"], y=rows["ttft_p50"], mode="lines+markers",
                                 line=dict(color=colour), legendgroup=name,
                                 name=f"{name}: TTFT p50"))
        lat.add_trace(go.Scatter(x=rows["offered"], y=rows["ttft_p99"], mode="lines+markers",
                                 line=dict(dash="dash", color=colour), legendgroup=name,
                                 name=f"{name}: TTFT p99"))
        good.add_trace(go.Scatter(x=rows["offered"], y=rows["goodput_rps"],
                                  mode="lines+markers", line=dict(color=colour),
                                  legendgroup=name, name=f"{name}: goodput"))
        good.add_trace(go.Scatter(x=rows["offered"], y=rows["throughput_rps"],
                                  mode="lines+markers", line=dict(dash="dot", color=colour),
                                  legendgroup=name, name=f"{name}: achieved"))
    rated = stage_table["offered_rps"].notna() if "offered_rps" in stage_table else None
    if rated is not None and rated.any() and x_title.startswith("offered load (req/s)"):
        top = float(np.nanmax(stage_table.loc[rated, "offered"].to_numpy(np.float64)))
        good.add_trace(go.Scatter(x=[0.0, top], y=[0.0, top], mode="lines",
                                  line=dict(dash="dash", color="#9aa1ad"),
                                  name="offered (achieved = offered)", hoverinfo="skip"))
    lat.update_xaxes(title_text=x_title)
    lat.update_yaxes(title_text="TTFT (ms)")
    good.update_xaxes(title_text=x_title)
    good.update_yaxes(title_text="requests/s")
    return [_fig(lat, "latency_vs_load", "Latency against offered load"),
            _fig(good, "goodput_vs_load", "Goodput at SLO against offered load")]


def ttft_vs_prompt(d: ReportData) -> Figure:
    f = d.frame[["ok", "prompt_tokens", "ttft_ms", "completion_tokens", "topology", "endpoint"]]
    f = f[f["ok"].to_numpy() & f["prompt_tokens"].notna().to_numpy()]
    fig = go.Figure()
    rng = np.random.default_rng(0)
    p_max = float(f["prompt_tokens"].max()) if len(f) else 1.0
    edges = np.unique(np.geomspace(1, max(p_max, 2) * 1.001, 25).astype(np.int64))
    for topo, rows in f.groupby("topology", observed=True):
        p = rows["prompt_tokens"].to_numpy()
        t = rows["ttft_ms"].to_numpy()
        pick = rng.choice(len(p), min(len(p), SCATTER_POINTS), replace=False)
        fig.add_trace(go.Scatter(x=p[pick], y=t[pick], mode="markers", opacity=0.35,
                                 marker=dict(size=4), name=f"{topo} (sample)",
                                 legendgroup=str(topo)))
        b = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, len(edges) - 2)
        med = pd.Series(t).groupby(b).median()
        centre = np.sqrt(edges[med.index.to_numpy()] * edges[med.index.to_numpy() + 1])
        fig.add_trace(go.Scatter(x=centre, y=med.to_numpy(), mode="lines+markers",
                                 name=f"{topo} median", legendgroup=str(topo)))
    note = _costmodel_overlay(fig, d, f)
    fig.update_xaxes(title_text="prompt tokens", type="log")
    fig.update_yaxes(title_text="TTFT (ms)", type="log")
    return _fig(fig, "ttft_vs_prompt", "TTFT against prompt length, per topology", note)


def _costmodel_overlay(fig: go.Figure, d: ReportData, f: pd.DataFrame) -> str:
    """The seeds' cost model (colocated and RDMA-disaggregated TTFT, the P/D crossover) over
    the requests of the endpoints whose hardware the config declares; returns the note."""
    eps = d.endpoint_names
    declared = [ep for ep in eps if d.declared_hardware(ep)]
    others = [f"{ep} ({d.endpoint(ep).kind or 'kind not recorded'})"
              for ep in eps if ep not in declared]
    skipped = (f"not drawn for {', '.join(others)}: hardware not declared in the config (the "
               "cost model describes the built-in endpoints' reference stack, not a real "
               "server)") if others else ""
    f = f[f["endpoint"].isin(declared).to_numpy()]
    if not len(f):
        return f"cost model overlay omitted: {skipped}" if others else ""
    out_med = float(np.nanmedian(f["completion_tokens"].to_numpy())) or 1.0
    grid = np.geomspace(max(1.0, float(f["prompt_tokens"].min())),
                        float(f["prompt_tokens"].max()), 60)
    try:
        colo = [costmodel.ms_colocated(int(g), 1) for g in grid]
        dis = [costmodel.ms_disaggregated(int(g), 1, use_rdma=True) for g in grid]
        cross = costmodel.pd_crossover_prompt_tokens(int(round(out_med)), use_rdma=True)
    except Exception as exc:  # the model's own error: show the data without the overlay
        return f"cost model overlay omitted: {type(exc).__name__}: {exc}"
    fig.add_trace(go.Scatter(x=grid, y=colo, mode="lines", line=dict(dash="dot"),
                             name="cost model: colocated (prefill + 1 token)"))
    fig.add_trace(go.Scatter(x=grid, y=dis, mode="lines", line=dict(dash="dot"),
                             name="cost model: disaggregated, RDMA"))
    note = ""
    if cross is not None and math.isfinite(float(cross)) and float(cross) > 0:
        fig.add_vline(x=float(cross), line_dash="dash", line_color="#555")
        fig.add_annotation(x=math.log10(float(cross)), y=1, yref="paper",
                           text=f"predicted P/D crossover: {float(cross):,.0f} tokens "
                                f"(output {out_med:.0f})", showarrow=False, xanchor="left")
        note = (f"Cost model (endpoints.costmodel): disaggregation predicted to win above "
                f"{float(cross):,.0f} prompt tokens for the median output of "
                f"{out_med:.0f} tokens, over RDMA.")
    if others:
        note = f"{note} Cost model {skipped}.".strip()
    return note


def _bin_edges(t_s: np.ndarray) -> np.ndarray:
    hi = float(np.nanmax(t_s)) if len(t_s) else 1.0
    return np.linspace(0, max(hi, 1e-3) * 1.000001, TIME_BINS + 1)


MIN_REQUESTS_PER_BIN = 10  # fewer and a bin's ratio is one or two requests' luck


def hit_ratio_over_time(d: ReportData) -> Figure | None:
    """Per endpoint, the prefix hit ratio in time bins of at least ~10 requests: from the
    server's cached_tokens (solid) and from engine counter increases in the same bins (dotted),
    over the time that endpoint was under load."""
    f = d.frame
    fig = go.Figure()
    has = False
    t = _times_rel_s(f)
    ok = (f["ok"] & f["prompt_tokens"].notna()).to_numpy()
    has_cached = f["cached_tokens"].notna().to_numpy()
    eps = f["endpoint"].to_numpy()
    first_ns = f.groupby("endpoint", observed=True)["t_sent_ns"].min()
    eng = d.engine
    adapters = {ep: a for ep, a in E.adapters(eng).items() if a.hit_counters()}
    e = None
    if adapters:
        e = eng.select(["t_ns", "endpoint", "metric", "value"]).to_pandas()
        e = e[e["metric"].isin({n for a in adapters.values() for n in a.hit_counters()})]
    for i, ep in enumerate(d.endpoint_names):
        m = ok & (eps == ep)
        if not m.any():
            continue
        n_bins = int(min(TIME_BINS, max(3, m.sum() // MIN_REQUESTS_PER_BIN)))
        hi = float(np.nanmax(t[m]))
        edges = np.linspace(0, max(hi, 1e-3) * 1.000001, n_bins + 1)
        centre = (edges[1:] + edges[:-1]) / 2
        colour = _colour(i)
        mc = m & has_cached
        if mc.any():
            b = np.clip(np.searchsorted(edges, t[mc], side="right") - 1, 0, n_bins - 1)
            cached = np.bincount(b, f["cached_tokens"].to_numpy()[mc], n_bins)
            prompt = np.bincount(b, f["prompt_tokens"].to_numpy()[mc], n_bins)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.where(prompt > 0, cached / prompt, np.nan)
            fig.add_trace(go.Scatter(x=centre, y=ratio, mode="lines+markers",
                                     name=f"{ep} (cached_tokens)", line=dict(color=colour)))
            has = True
        if e is None or ep not in adapters or ep not in first_ns.index:
            continue
        adapter = adapters[ep]
        hits_name, queries_name = adapter.hit_counters()
        rows_e = e[e["endpoint"] == ep]
        piv = rows_e.pivot_table(index="t_ns", columns="metric", values="value",
                                 aggfunc="sum").sort_index()
        if hits_name not in piv or queries_name not in piv or len(piv) < 2:
            continue
        dh = piv[hits_name].diff().clip(lower=0).to_numpy()[1:]
        dq = piv[queries_name].diff().clip(lower=0).to_numpy()[1:]
        x = (piv.index.to_numpy()[1:] - int(first_ns[ep])) / 1e9
        inside = (x >= edges[0]) & (x <= edges[-1] + (edges[1] - edges[0]))
        if not inside.any():
            continue
        b = np.clip(np.searchsorted(edges, x[inside], side="right") - 1, 0, n_bins - 1)
        hits = np.bincount(b, dh[inside], n_bins)
        queries = np.bincount(b, dq[inside], n_bins)
        ratio = [adapter.hit_ratio(h, q) for h, q in zip(hits, queries)]
        ratio = np.array([math.nan if r is None else r for r in ratio])
        fig.add_trace(go.Scatter(x=centre, y=ratio, mode="lines", line=dict(dash="dot",
                                 color=colour), name=f"{ep} (engine counters)"))
        has = True
    if not has:
        return None
    fig.update_xaxes(title_text="seconds since the endpoint's first request")
    fig.update_yaxes(title_text="prefix hit ratio", range=[0, 1.05])
    return _fig(fig, "hit_ratio_time", "Prefix-cache hit ratio over time",
                f"Ratios per time bin of at least {MIN_REQUESTS_PER_BIN} requests (up to "
                f"{TIME_BINS} bins): cached prompt tokens / prompt tokens.")


def gpu_timelines(d: ReportData) -> Figure | None:
    g = d.gpu
    if g.num_rows == 0:
        return None
    cols = ["t_ns", "endpoint", "role", "host", "gpu", "sm_active", "gpu_util_pct",
            "hbm_used_bytes", "hbm_total_bytes"]
    df = g.select(cols).to_pandas()
    df["sm"] = df["sm_active"].where(df["sm_active"].notna(), df["gpu_util_pct"] / 100)
    df["hbm"] = df["hbm_used_bytes"] / df["hbm_total_bytes"]
    df["role"] = df["role"].fillna("unknown")
    df["endpoint"] = df["endpoint"].fillna("")
    t0 = df.groupby("endpoint")["t_ns"].transform("min")
    df["t_s"] = (df["t_ns"] - t0) / 1e9
    edges = _bin_edges(df["t_s"].to_numpy())
    df["bin"] = np.clip(np.searchsorted(edges, df["t_s"].to_numpy(), side="right") - 1, 0,
                        TIME_BINS - 1)
    centre = (edges[1:] + edges[:-1]) / 2
    agg = df.groupby(["endpoint", "role", "bin"])[["sm", "hbm"]].mean().reset_index()
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("SM active (fraction)", "HBM used (fraction)"))
    palette = plotly.colors.qualitative.Plotly
    roles = agg.groupby("endpoint")["role"].nunique()
    one_ep = len(roles) == 1
    for i, ((ep, role), rows) in enumerate(agg.groupby(["endpoint", "role"])):
        # name what differs: the endpoint where it has one role ("colocated", not
        # "colocated colocated"), the role where there is one endpoint
        name = (str(ep) if roles[ep] == 1 and ep else str(role) if one_ep
                else f"{ep}: {role}" if ep else str(role))
        line = dict(color=palette[i % len(palette)])
        fig.add_trace(go.Scatter(x=centre[rows["bin"]], y=rows["sm"], mode="lines", name=name,
                                 legendgroup=name, line=line), row=1, col=1)
        fig.add_trace(go.Scatter(x=centre[rows["bin"]], y=rows["hbm"], mode="lines", name=name,
                                 legendgroup=name, showlegend=False, line=line), row=2, col=1)
    fig.update_yaxes(range=[0, 1.05])
    fig.update_xaxes(title_text="seconds since the endpoint's first sample", row=2, col=1)
    out = _fig(fig, "gpu_timelines", "GPU SM and HBM utilisation by GPU role")
    out["layout"]["height"] = 520
    return out


def errors_over_time(d: ReportData) -> Figure | None:
    f = d.frame
    bad = M.failed(f)  # errors; requests cancelled at the stop are not
    if not bad.any():
        return None
    t = _times_rel_s(f)
    edges = _bin_edges(t)
    centre = (edges[1:] + edges[:-1]) / 2
    b = np.clip(np.searchsorted(edges, t[bad], side="right") - 1, 0, TIME_BINS - 1)
    key = (f["endpoint"].astype(str).to_numpy()[bad] + " " + f["status"].astype(str).to_numpy()[
        bad])
    fig = go.Figure()
    for k in np.unique(key):
        counts = np.bincount(b[key == k], minlength=TIME_BINS)
        fig.add_trace(go.Bar(x=centre, y=counts, name=str(k)))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="seconds since the endpoint's first request")
    fig.update_yaxes(title_text="failed requests per bin")
    return _fig(fig, "errors_time", "Errors over time, by status")


def pareto_plot(points: pd.DataFrame, endpoints: list[str]) -> Figure | None:
    """Per-user output tokens/s against output tokens/s per GPU, one curve per endpoint over
    its stages (``reports.pareto.stage_points``), the frontier of all points as a staircase
    and each endpoint's knee as a star."""
    if points.empty:
        return None
    pts = points[np.isfinite(points["tps_per_gpu"].to_numpy(dtype=np.float64))
                 & np.isfinite(points["per_user_tps"].to_numpy(dtype=np.float64))]
    if pts.empty:
        return None
    pts = pts.reset_index(drop=True)
    fig = go.Figure()
    order = [ep for ep in endpoints if ep in set(pts["endpoint"])]
    pairs = [(ep, wl) for ep in order for wl in dict.fromkeys(
        pts.loc[pts["endpoint"] == ep, "workload"].astype(str))]
    names = series_names(pairs)
    for i, (ep, wl) in enumerate(pairs):
        label = names[(ep, wl)]
        rows = pts[(pts["endpoint"] == ep) & (pts["workload"].astype(str) == wl)
                   ].sort_values("tps_per_gpu")
        hover = [f"{ep}: {r.workload} stage {int(r.stage) + 1}"
                 + (f", {r.rate_rps:g} req/s planned" if r.rate_rps == r.rate_rps
                    and r.rate_rps is not None else "")
                 + (f", {int(r.users)} users" if r.users == r.users and r.users is not None
                    else "")
                 + f"<br>{r.tps_per_gpu:,.1f} output tok/s per GPU ({r.gpus} GPUs)"
                 + f"<br>{r.per_user_tps:,.1f} tok/s per user"
                 + (f"<br>${r.cost_per_m:,.2f} / M output tokens"
                    + (" (example price)" if r.example_price else "")
                    if r.cost_per_m == r.cost_per_m else "")
                 for r in rows.itertuples()]
        fig.add_trace(go.Scatter(x=rows["tps_per_gpu"].tolist(),
                                 y=rows["per_user_tps"].tolist(),
                                 mode="lines+markers", name=label, text=hover,
                                 hoverinfo="text", line=dict(color=_colour(i))))
        k = P.knee(rows["tps_per_gpu"], rows["per_user_tps"])
        if k is not None:
            r = rows.iloc[k]
            fig.add_trace(go.Scatter(x=[float(r["tps_per_gpu"])], y=[float(r["per_user_tps"])],
                                     mode="markers", name=f"{label} knee",
                                     marker=dict(symbol="star", size=16, color=_colour(i),
                                                 line=dict(color="#1d2330", width=1)),
                                     hovertext=f"{label} knee: {r['tps_per_gpu']:,.1f} tok/s "
                                               f"per GPU at {r['per_user_tps']:,.1f} tok/s "
                                               "per user", hoverinfo="text"))
    front = P.frontier(pts["tps_per_gpu"], pts["per_user_tps"])
    if len(front):
        fr = pts.iloc[front]
        fig.add_trace(go.Scatter(x=fr["tps_per_gpu"].tolist(), y=fr["per_user_tps"].tolist(),
                                 mode="lines",
                                 line=dict(color="#1d2330", dash="dash", shape="vh", width=1),
                                 name="Pareto frontier (all endpoints)", hoverinfo="skip"))
    fig.update_xaxes(title_text="output tokens/s per GPU", rangemode="tozero")
    fig.update_yaxes(title_text="per-user output tokens/s (1000 / TPOT, median)",
                     rangemode="tozero")
    note = (f"One point per load stage. Frontier: the stages no other stage beats on both "
            f"axes. Knee (star): the endpoint's frontier point with the most tokens/s per GPU "
            f"whose per-user speed is at least {P.KNEE_FRACTION:.0%} of its best.")
    unknown = sorted(set(pts.loc[~pts["gpus_known"].astype(bool), "endpoint"]))
    if unknown:
        note += (" GPUs not recorded (counted as 1): " + ", ".join(unknown) + ".")
    return _fig(fig, "pareto", "Latency-throughput trade-off: per-user speed against "
                "throughput per GPU", note)


def all_figures(d: ReportData, stage_table: pd.DataFrame,
                itl_cache: dict[str, np.ndarray],
                points: pd.DataFrame | None = None) -> list[Figure]:
    figs: list[Figure | None] = []
    figs += cdfs(d, itl_cache)
    figs += load_curves(d, stage_table)
    if points is None:
        points = P.stage_points(d.frame, d.endpoints, d.stages)
    figs.append(pareto_plot(points, d.endpoint_names))
    figs.append(ttft_vs_prompt(d))
    figs.append(hit_ratio_over_time(d))
    figs.append(gpu_timelines(d))
    figs.append(errors_over_time(d))
    return [x for x in figs if x is not None]
