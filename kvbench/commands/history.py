"""kvbench history: key metrics of recent runs, as a table (and a plot with --plot)."""

from __future__ import annotations

from pathlib import Path


def add_parser(p) -> None:
    p.add_argument("--results-dir", default="results", help="the results store (default: results)")
    p.add_argument("--suite", default=None, help="only this suite")
    p.add_argument("--limit", type=int, default=10, help="newest N runs (default 10)")
    p.add_argument("--plot", default=None, help="write an HTML plot of the history here")


def run(args) -> int:
    import pandas as pd

    from kvbench.reports.analysis.history import KEY_METRICS, recent_runs

    wide = recent_runs(args.results_dir, args.suite, args.limit)
    if wide.empty:
        print(f"no runs recorded in {Path(args.results_dir) / 'history'} yet (kvbench gate "
              "records each run it judges)")
        return 0
    cols = ["date", "run_id", "endpoint", "verdict"] + [m for m in KEY_METRICS if m in wide]
    with pd.option_context("display.width", 200, "display.max_columns", 20,
                           "display.float_format", "{:.4g}".format):
        print(wide[cols].to_string(index=False))
    if args.plot:
        _plot(wide, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _plot(wide, path: str) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    shown = [m for m in ("ttft_p99", "tpot_p50", "goodput_rps", "error_rate") if m in wide]
    fig = make_subplots(rows=len(shown), cols=1, shared_xaxes=True, subplot_titles=shown)
    for i, m in enumerate(shown, start=1):
        for ep, sub in wide.groupby("endpoint", observed=True):
            fig.add_trace(go.Scatter(x=sub["date"], y=sub[m], mode="lines+markers",
                                     name=str(ep), legendgroup=str(ep), showlegend=i == 1),
                          row=i, col=1)
    fig.update_layout(height=250 * len(shown), title="kvbench history")
    fig.write_html(path, include_plotlyjs=True, full_html=True)
