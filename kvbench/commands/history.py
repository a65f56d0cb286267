"""kvbench history: key metrics of recent runs, as a table (and a plot with --plot); with
--accept RUN, record a run as an accepted baseline, which ``kvbench gate --baseline last-pass``
then takes (how the first nightly gets a baseline)."""

from __future__ import annotations

from pathlib import Path


def add_parser(p) -> None:
    p.add_argument("--results-dir", default="results", help="the results store (default: results)")
    p.add_argument("--suite", default=None, help="only this suite")
    p.add_argument("--limit", type=int, default=10, help="newest N runs (default 10)")
    p.add_argument("--plot", default=None, help="write an HTML plot of the history here")
    p.add_argument("--accept", default=None, metavar="RUN",
                   help="record RUN (a results directory, or a run id under --results-dir) "
                        "as an accepted baseline: --baseline last-pass takes it until a newer "
                        "run passes (seeds the first nightly)")


def run(args) -> int:
    import pandas as pd

    from kvbench.reports.analysis.history import KEY_METRICS, recent_runs

    if args.accept:
        return _accept(args)
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


def _accept(args) -> int:
    """Record ``args.accept`` with the verdict ``accepted``: its records are read and checked
    as the gate reads them, so a damaged run is refused (exit 3), not accepted."""
    from kvbench.commands.gate import _history_rows
    from kvbench.commands.recover import ensure_recovered
    from kvbench.core.errors import DataError
    from kvbench.core.store import load_results
    from kvbench.reports.analysis.history import record_run

    results_dir = Path(args.results_dir)
    for path in (Path(args.accept), results_dir / args.accept):
        ensure_recovered(path)
        if (path / "run.json").exists():
            break
    else:
        raise DataError(f"{args.accept!r} is neither a results directory nor a run id under "
                        f"{results_dir}; give the directory holding the run's run.json")
    results = load_results(path)
    if not results.requests.num_rows:
        raise DataError(f"{path}: the run has no records, so it cannot be a baseline; accept "
                        "a run that sent requests")
    if args.suite is not None and str(results.meta.suite or "default") != args.suite:
        raise DataError(f"{path}: the run is of suite {results.meta.suite!r}, not "
                        f"{args.suite!r}; accept a run of that suite")
    out = record_run(results_dir, results.meta, path,
                     _history_rows(results, results.meta.slo), "accepted")
    print(f"kvbench history: {results.meta.run_id or path.name} accepted as a baseline of "
          f"suite {results.meta.suite or 'default'!r} ({out}); kvbench gate --baseline "
          "last-pass takes it until a newer run passes")
    return 0
