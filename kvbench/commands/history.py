"""kvbench history: the runs of a results store (a folder or ``s3://bucket/prefix``) from its
history manifest: key metrics of the newest runs per endpoint, then the trend per endpoint x
workload (capacity at SLO, TTFT/TPOT p99, goodput) over the nights, ``--plot`` to draw it.
``--accept RUN`` records a run as an accepted baseline, which ``kvbench gate --baseline
last-pass`` then takes (how the first nightly gets a baseline); ``--prune --keep N`` /
``--keep-days D`` applies a retention (``--delete-runs``: the runs' folders too)."""

from __future__ import annotations

from pathlib import Path

from kvbench.core import objstore
from kvbench.core.errors import DataError, UserError


def add_parser(p) -> None:
    p.add_argument("--results-dir", default=None,
                   help="the results store, a folder or s3://BUCKET/PREFIX (default: the "
                        "config's suite.results_dir, else results)")
    p.add_argument("--config", default=None,
                   help="bench.toml: its results_dir, [storage] and [history] retention")
    p.add_argument("--suite", default=None, help="only this suite")
    p.add_argument("--limit", type=int, default=10, help="newest N runs (default 10)")
    p.add_argument("--trend", action="store_true",
                   help="per endpoint x workload over the runs: capacity at SLO, TTFT/TPOT "
                        "p99 and goodput (read from the manifest alone)")
    p.add_argument("--plot", default=None, help="write an HTML plot of the trend here")
    p.add_argument("--accept", default=None, metavar="RUN",
                   help="record RUN (a results directory, or a run id under --results-dir) "
                        "as an accepted baseline: --baseline last-pass takes it until a newer "
                        "run passes (seeds the first nightly)")
    p.add_argument("--prune", action="store_true",
                   help="drop the history of runs beyond --keep / --keep-days (default: the "
                        "config's [history]); a suite's newest passing run always stays")
    p.add_argument("--keep", type=int, default=None, metavar="N",
                   help="with --prune: keep the newest N runs of each suite")
    p.add_argument("--keep-days", type=float, default=None, metavar="D",
                   help="with --prune: keep the runs started in the last D days")
    p.add_argument("--delete-runs", action="store_true",
                   help="with --prune: delete the pruned runs' own folders in the store too")


def _store(args):
    from kvbench.core import manifest

    cfg = None
    if args.config:
        from kvbench.config import load_config

        cfg = load_config(args.config)
    where = args.results_dir or (cfg.suite.results_dir if cfg else "results")
    try:
        store = manifest.Store.of(where, cfg.storage if cfg else None)
    except ValueError as exc:
        raise UserError(f"--results-dir {exc}") from None
    return store, cfg


def run(args) -> int:
    from kvbench.commands.recover import _store_error

    store, cfg = _store(args)
    try:
        if args.accept:
            return _accept(args, store)
        if args.prune:
            return _prune(args, store, cfg)
        return _show(args, store)
    except OSError as exc:
        raise _store_error(store.where(), exc) from None


def _show(args, store) -> int:
    import pandas as pd

    from kvbench.reports.analysis.history import KEY_METRICS, recent_runs, trend

    fmt = {"display.width": 200, "display.max_columns": 20,
           "display.float_format": "{:.4g}".format}
    tr = trend(store, args.suite, args.limit)
    with pd.option_context(*[x for kv in fmt.items() for x in kv]):
        if args.trend:
            table = tr.drop(columns=["suite"])
        else:
            wide = recent_runs(store, args.suite, args.limit)
            cols = ["date", "run_id", "endpoint", "verdict"] + [m for m in KEY_METRICS
                                                                 if m in wide]
            table = wide[cols] if not wide.empty else wide
        if table.empty:
            print(f"no runs recorded in {store.where('history')} yet (kvbench gate records "
                  "each run it judges)")
            return 0
        print(table.to_string(index=False, na_rep="-"))
    if args.plot:
        plot(tr, args.plot)
        print(f"wrote {args.plot}")
    return 0


def figure(tr):
    """The trend as a plotly figure (the report's History section draws the same one); None:
    nothing to draw."""
    from kvbench.reports.rendering.history_section import figure as draw

    return draw(tr)


def plot(tr, path: str) -> None:
    fig = figure(tr)
    if fig is None:
        Path(path).write_text("<html><body><p>kvbench history: no figures recorded yet"
                              "</p></body></html>")
        return
    fig.write_html(path, include_plotlyjs=True, full_html=True)


def _prune(args, store, cfg) -> int:
    from kvbench.core import manifest

    keep_runs, keep_days = args.keep, args.keep_days
    if keep_runs is None and keep_days is None and cfg is not None:
        keep_runs, keep_days = cfg.history.keep_runs, cfg.history.keep_days
    if keep_runs is None and keep_days is None:
        raise UserError("kvbench history --prune needs --keep N or --keep-days D (or a "
                        "--config with [history] keep_runs or keep_days)")
    if (keep_runs is not None and keep_runs < 1) or (keep_days is not None and keep_days <= 0):
        raise UserError("--keep is at least 1 and --keep-days above 0")
    dropped = manifest.prune(store, keep_runs, keep_days, runs_too=args.delete_runs)
    what = " and their run folders" if args.delete_runs else ""
    print(f"kvbench history: pruned {len(dropped)} run(s){what} from {store.where('history')}"
          + (": " + ", ".join(e["run_id"] for e in dropped) if dropped else ""))
    return 0


def _accept(args, store) -> int:
    """Record ``args.accept`` with the verdict ``accepted``: its records are read and checked
    as the gate reads them, so a damaged run is refused (exit 3), not accepted."""
    from kvbench.commands.gate import _history_rows, _store_run
    from kvbench.commands.recover import ensure_recovered, local_run
    from kvbench.core.store import load_results
    from kvbench.reports.analysis.history import record_run

    if objstore.is_url(args.accept):
        path = local_run(args.accept)
    elif store.remote and not Path(args.accept).is_dir():
        path = _store_run(store.loc, args.accept)
    else:
        for path in (Path(args.accept), Path(store.root or ".") / args.accept):
            ensure_recovered(path)
            if (path / "run.json").exists():
                break
        else:
            raise DataError(f"{args.accept!r} is neither a results directory nor a run id "
                            f"under {store.where()}; give the directory holding the run's "
                            "run.json")
    results = load_results(path)
    if not results.requests.num_rows:
        raise DataError(f"{path}: the run has no records, so it cannot be a baseline; accept "
                        "a run that sent requests")
    if args.suite is not None and str(results.meta.suite or "default") != args.suite:
        raise DataError(f"{path}: the run is of suite {results.meta.suite!r}, not "
                        f"{args.suite!r}; accept a run of that suite")
    out = record_run(store, results.meta, path, _history_rows(results, results.meta.slo),
                     "accepted")
    print(f"kvbench history: {results.meta.run_id or path.name} accepted as a baseline of "
          f"suite {results.meta.suite or 'default'!r} ({out}); kvbench gate --baseline "
          "last-pass takes it until a newer run passes")
    return 0
