"""kvbench gate: compare a run with a baseline under bench.toml's rules; exit code for CI.

Runs on object storage (``s3://BUCKET/PREFIX/RUN_ID``, for --current, --baseline, or a run id
under an s3:// --results-dir) are read from local copies (``commands.recover.local_run``); the
verdict, gate.json, is uploaded beside an s3:// current run. The history (its files and
manifest, ``reports.analysis.history``) is kept in the results store itself, local or s3://, so
``last-pass`` and ``last-pass:N`` resolve on any machine, from an empty cache. After recording,
the config's ``[history]`` retention (``keep_runs``, ``keep_days``) prunes the store's history."""

from __future__ import annotations

import json
from pathlib import Path

from kvbench.core import objstore
from kvbench.core.errors import DataError, UserError

EXIT_DATA = 3


def add_parser(p) -> None:
    p.add_argument("--baseline", required=True,
                   help="a results directory, a run id under --results-dir, 'last-pass' "
                        "(the newest passing or accepted run of the suite in the store's "
                        "history) or 'last-pass:N' (the newest N, pooled)")
    p.add_argument("--current", required=True, help="the results directory to judge")
    p.add_argument("--config", default=None,
                   help="bench.toml whose [gate] rules apply (default: the current run's own)")
    p.add_argument("--results-dir", default=None,
                   help="results store for run ids, last-pass and history (default: the "
                        "config's suite.results_dir, else the parent of --current)")
    p.add_argument("--junit", default=None, help="write JUnit XML here (one case per rule)")
    p.add_argument("--markdown", default=None,
                   help="write a Markdown summary here (e.g. $GITHUB_STEP_SUMMARY)")
    p.add_argument("--json", default=None, help="write the verdicts as JSON here")
    p.add_argument("--strict", action="store_true",
                   help="exit 2 when any rule is inconclusive (default: exit 0)")
    p.add_argument("--allow-missing", action="store_true",
                   help="a rule with no data to judge (no records of its class, its column "
                        "all null) is reported as NO DATA instead of failing the gate with "
                        "exit 3; every output says so")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--no-history", action="store_true",
                   help="do not record the verdict in the results history")


def _resolve_baseline(spec: str, results_dir: Path, suite: str | None, current: Path,
                      store=None) -> list[Path]:
    """The local folders of the baseline: one run, or the newest N passing ones."""
    from kvbench.commands.recover import local_run

    if spec == "last-pass" or spec.startswith("last-pass:"):
        return _last_passes(spec, results_dir, suite, current, store)
    if objstore.is_url(spec):
        return [local_run(spec)]
    if store is not None and not Path(spec).is_dir():  # a run id on the store
        return [_store_run(store, spec)]
    from kvbench.commands.recover import ensure_recovered

    for path in (Path(spec), results_dir / spec):
        ensure_recovered(path)  # a killed baseline named by its run id is rebuilt too
        if (path / "run.json").exists():
            return [path]
    raise DataError(f"baseline {spec!r} is neither a results directory nor a run id under "
                    f"{results_dir}; give a directory holding run.json, a run id or last-pass")


def _store_run(store, run_id: str) -> Path:
    """A run of an s3:// store, copied here (the store's own options, not the environment's)."""
    from kvbench.commands.recover import _store_error

    try:
        if objstore.complete(store, run_id) is None:
            raise DataError(f"{store.url(run_id)} holds no complete run (no {objstore.MARKER}"
                            " marker); run kvbench recover on the machine that ran it")
        return objstore.fetch_run(store, run_id)
    except OSError as exc:
        raise _store_error(store.url(run_id), exc) from None


def _last_passes(spec: str, results_dir: Path, suite, current: Path, store) -> list[Path]:
    from kvbench.reports.analysis.history import last_pass, last_passes

    n_text = spec.partition(":")[2] or "1"
    if not n_text.isdigit() or not 1 <= int(n_text) <= 100:
        raise UserError(f"--baseline {spec!r}: N of last-pass:N is a whole number from 1 to "
                        "100")
    n = int(n_text)
    if store is None and n == 1:
        return [last_pass(results_dir, suite, exclude_run=current.name)]
    where = store if store is not None else results_dir
    out = []
    for e in last_passes(where, suite, exclude_run=current.name, n=n):
        if store is not None:
            out.append(_store_run(store, e["run_id"]))
        elif (Path(e["run"]) / "run.json").exists():
            out.append(Path(e["run"]))
        else:
            raise DataError(f"the passing run {e['run_id']} was recorded at {e['run']}, which "
                            "no longer holds its results; give --baseline a results directory")
    return out


def run(args) -> int:
    try:
        return _run(args)
    except UserError as exc:
        # The gate's contract: usage and data errors exit 3, whatever their kind; CI files
        # asked for say so too (an error case, not an empty passing suite).
        _write_error(args, str(exc))
        raise DataError(str(exc)) from None


def _write_error(args, message: str) -> None:
    from kvbench.reports.analysis import gate

    try:
        if args.junit:
            Path(args.junit).write_text(gate.junit_error(message))
        if args.markdown:
            Path(args.markdown).write_text(f"### kvbench gate: **ERROR**\n\n{message}\n")
    except OSError:
        pass  # the sentence on stderr still says it


def _run(args) -> int:
    from kvbench.reports.analysis import history
    from pydantic import ValidationError

    from kvbench.config import GateConfig, load_config, one_sentence
    from kvbench.reports.analysis import gate
    from kvbench.commands.recover import ensure_recovered, local_run

    current_path = local_run(args.current)  # s3://: a local copy
    ensure_recovered(current_path)  # a killed run: its run.json rebuilt first
    current = gate.load_bounded(current_path)
    if args.config:
        cfg = load_config(args.config)
        gate_cfg, slo = cfg.gate, {k: v.model_dump() for k, v in cfg.slo.items()}
        results_dir = args.results_dir or cfg.suite.results_dir
    else:
        resolved = current.meta.config
        try:
            gate_cfg = GateConfig.model_validate(resolved.get("gate") or {})
        except ValidationError as exc:  # the config's own sentence, on one line
            raise DataError(one_sentence(current_path / "run.json", exc).removesuffix(".")
                            + " (in its recorded config's [gate]); pass --config bench.toml"
                            ) from None
        if not gate_cfg.rules:
            raise DataError(f"{current_path / 'run.json'}: its config has no [gate] rules; "
                            "pass --config bench.toml with [gate] rules")
        slo = resolved.get("slo") or {}
        results_dir = args.results_dir or current_path.parent
    store = None
    if not args.results_dir and not args.config and objstore.is_url(args.current):
        store = objstore.split_run(args.current)[0]  # the run's own store
    if store is None and objstore.is_url(results_dir):  # runs copied to its cache
        try:
            store = objstore.parse(str(results_dir), cfg.storage if args.config else None)
        except ValueError as exc:
            raise UserError(f"--results-dir {exc}") from None
    if store is not None:  # history on the store itself
        results_dir = objstore.cache_root(store)
    results_dir = Path(results_dir)
    suite = current.meta.suite
    base_paths = _resolve_baseline(args.baseline, results_dir, suite, current_path, store)
    base_path = " + ".join(str(p) for p in base_paths)
    baseline = _pooled([gate.load_bounded(p) for p in base_paths])
    results = gate.evaluate(baseline, current, gate_cfg, slo=slo, seed=args.seed,
                            allow_missing=args.allow_missing)
    verdict = gate.overall(results)
    missing = gate.missing_note(results)
    for r in results:
        label = "NO DATA" if r.verdict == "missing" else r.verdict.upper()
        print(f"{label:>12}  {r.name}: {r.describe()}")
    shown = "NO DATA" if verdict == "missing" else verdict.upper()
    print(f"kvbench gate: {shown} ({len(results)} checks; baseline {base_path})"
          + (f"; {missing}" if missing else ""))
    md = gate.markdown(results, str(base_path), str(current_path), gate_cfg.confidence)
    if args.markdown:
        Path(args.markdown).write_text(md)
    if args.junit:
        Path(args.junit).write_text(gate.junit_xml(results))
    verdict_doc = {"verdict": verdict, "baseline": str(base_path), "current": str(current_path),
                   "confidence": gate_cfg.confidence, "missing": missing or None,
                   "rules": gate.to_records(results)}
    if args.json:
        Path(args.json).write_text(json.dumps(verdict_doc, indent=2, default=str))
    # Beside the run, so its report can show the gate section.
    (current_path / "gate.json").write_text(json.dumps(verdict_doc, indent=2, default=str))
    if objstore.is_url(args.current):
        _upload_verdict(args.current, current_path / "gate.json")
    if not args.no_history:
        _record(history, store if store is not None else results_dir, current, current_path,
                _history_rows(current, slo), verdict,
                cfg.history if args.config else current.meta.config.get("history"))
    return gate.exit_code(verdict, args.strict)


def _record(history, where, current, current_path: Path, rows, verdict, retention) -> None:
    """The verdict into the store's history, then its retention applied."""
    from kvbench.core import manifest
    from kvbench.commands.recover import _store_error

    try:
        store = manifest.Store.of(where)
        history.record_run(store, current.meta, current_path, rows, verdict)
        keep = retention if isinstance(retention, dict) else (
            retention.model_dump() if retention is not None else {})
        if keep.get("keep_runs") is not None or keep.get("keep_days") is not None:
            manifest.prune(store, keep.get("keep_runs"), keep.get("keep_days"))
    except OSError as exc:
        raise _store_error(str(where), exc) from None


def _pooled(runs: list):
    """One baseline of several runs of the same suite (``last-pass:N``): their records
    together, with every run's stages, so each figure still describes one load per stage."""
    if len(runs) == 1:
        return runs[0]
    import dataclasses

    import pyarrow as pa

    first = runs[0]
    meta = dataclasses.replace(first.meta, stages=[s for r in runs for s in r.meta.stages])
    requests = pa.concat_tables([r.requests for r in runs], promote_options="default")
    pooled = dataclasses.replace(first, meta=meta, tables=dict(first.tables, requests=requests))
    pooled.sampled = None  # a large run is judged on a sample (gate.load_bounded)
    pooled.parts = runs  # its figures are exact over every run's records (gate._exact)
    if any(getattr(r, "sampled", None) is not None for r in runs):
        from kvbench.reports.analysis.gate import Sampled

        pooled.sampled = Sampled(requests.num_rows, sum(
            r.sampled.n if getattr(r, "sampled", None) else r.requests.num_rows for r in runs))
    return pooled


def _upload_verdict(url: str, path: Path) -> None:
    """gate.json beside the run on the store too, so its report shows the gate anywhere."""
    import sys

    loc, run_id = objstore.split_run(url)
    if run_id == objstore.LATEST:
        run_id = path.parent.name
    try:
        objstore.put_file(loc, path, run_id, path.name)
    except OSError as exc:
        print(f"kvbench gate: could not upload {path.name} to {loc.url(run_id)} "
              f"({str(exc).splitlines()[0][:160]}); it is in {path}", file=sys.stderr)


def _history_rows(results, slo) -> list[dict]:
    from kvbench.reports.analysis.history import KEY_METRICS
    from kvbench.reports.statistics import metrics as M

    from kvbench.reports.analysis.history import FIGURES

    frame = M.request_frame(results.requests, stages=results.meta.stages, slo=slo)
    sampled = getattr(results, "sampled", None)  # a large run: its seeded sample's figures

    def value(part, name: str) -> float:
        v = M.statistic(part, name)
        if sampled is not None and M.METRIC_INFO[M.metric_name(name)].counts_arrivals:
            v = v / sampled.fraction  # a rate over the whole run's arrivals
        return v

    rows = []
    for ep in frame["endpoint"].cat.categories:
        sub = frame[frame["endpoint"] == ep]
        for name in KEY_METRICS:
            rows.append({"endpoint": ep, "request_class": "*", "metric": name,
                         "value": value(sub, name)})
        for wl in sorted(sub["workload"].dropna().unique()):
            part = sub[sub["workload"] == wl]
            for name in FIGURES[1:]:
                rows.append({"endpoint": ep, "workload": wl, "request_class": "*",
                             "metric": name, "value": value(part, name)})
    # a capacity search's probes are short; a sampled run's capacity is not estimated
    if sampled is None and any(s.search is not None for s in results.meta.stages or []):
        from kvbench.reports.analysis.capacity import summarise

        for c in summarise(results.meta.stages, frame, slo):
            if c.capacity_rps is not None and c.unit == "req/s":
                rows.append({"endpoint": c.endpoint, "workload": c.workload,
                             "request_class": "*", "metric": "capacity_rps",
                             "value": c.capacity_rps})
    return rows
