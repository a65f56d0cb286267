"""Results history: key metrics of every run in a Parquet dataset partitioned by suite and date.

``<results_dir>/history/suite=<suite>/date=<YYYY-MM-DD>/<run_id>.parquet`` holds one row per
(endpoint, request class, metric) of a run, with the run's gate verdict once it was gated.
Rewriting a run's file (e.g. after ``kvbench gate``) replaces its rows. ``last-pass`` is the
newest run of a suite whose verdict is ``pass`` or ``accepted``: a run a person accepted as a
baseline (``kvbench history --accept RUN``), which is how a nightly's first baseline is seeded
(an A/A gate of two good runs may well be ``inconclusive``, which never counts as a pass).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.core.errors import DataError
from kvbench.core.store import RunMeta

HISTORY = pa.schema([
    ("run_id", pa.string()),
    ("suite", pa.string()),
    ("started_ns", pa.int64()),
    ("run_path", pa.string()),
    ("endpoint", pa.string()),
    ("request_class", pa.string()),
    ("metric", pa.string()),
    ("value", pa.float64()),
    # pass | fail | inconclusive | missing | accepted (by hand) | null (not gated)
    ("verdict", pa.string()),
])

BASELINE_VERDICTS = ("pass", "accepted")  # what last-pass takes

KEY_METRICS = ("throughput_rps", "goodput_rps", "ttft_p50", "ttft_p99", "tpot_p50", "itl_p99",
               "e2e_p99", "error_rate", "hit_ratio")


def _date(started_ns: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(started_ns / 1e9))


def history_dir(results_dir: Path | str) -> Path:
    return Path(results_dir) / "history"


def record_run(results_dir: Path | str, meta: RunMeta, run_path: Path | str,
               rows: list[dict], verdict: str | None = None) -> Path:
    """Write (or replace) one run's history rows; ``rows`` carry endpoint, request_class,
    metric, value."""
    suite = str(meta.suite or "default")
    started = int(meta.started_ns or time.time_ns())
    run_id = str(meta.run_id or Path(run_path).name)
    part = history_dir(results_dir) / f"suite={suite}" / f"date={_date(started)}"
    part.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "run_id": [run_id] * len(rows),
        "suite": [suite] * len(rows),
        "started_ns": [started] * len(rows),
        "run_path": [str(Path(run_path).resolve())] * len(rows),
        "endpoint": [r["endpoint"] for r in rows],
        "request_class": [r["request_class"] for r in rows],
        "metric": [r["metric"] for r in rows],
        "value": [float(r["value"]) for r in rows],
        "verdict": [verdict] * len(rows),
    }, schema=HISTORY)
    out = part / f"{run_id}.parquet"
    tmp = part / f".{run_id}.parquet.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    return out


def read_history(results_dir: Path | str, suite: str | None = None) -> pd.DataFrame:
    root = history_dir(results_dir)
    files = sorted(root.glob("suite=*/date=*/*.parquet"))
    if suite is not None:
        files = [f for f in files if f.parent.parent.name == f"suite={suite}"]
    if not files:
        return HISTORY.empty_table().to_pandas()
    return pa.concat_tables([_read_one(f) for f in files]).to_pandas()


def _read_one(path: Path) -> pa.Table:
    """One run's history rows; a damaged file is a ``DataError`` naming it."""
    try:
        return pq.read_table(path, schema=HISTORY)
    except (pa.ArrowException, OSError, ValueError) as exc:
        reason = "empty (0 bytes)" if path.stat().st_size == 0 else (
            f"not a readable history file ({str(exc).splitlines()[0][:160]})")
        raise DataError(f"{path}: {reason}; remove it (that run's history row is lost) and "
                        "gate again") from None


def last_pass(results_dir: Path | str, suite: str | None = None,
              exclude_run: str | None = None) -> Path:
    """The results directory of the newest passing or accepted run (of ``suite`` when
    given)."""
    h = read_history(results_dir, suite)
    h = h[h["verdict"].isin(BASELINE_VERDICTS) & (h["run_id"] != (exclude_run or ""))]
    if h.empty:
        where = f" of suite {suite!r}" if suite else ""
        raise DataError(f"no passing or accepted run{where} in {history_dir(results_dir)}; "
                        "accept a good run as the first baseline (kvbench history --accept "
                        "RUN) or give --baseline a results directory")
    row = h.sort_values("started_ns").iloc[-1]
    path = Path(row["run_path"])
    if not (path / "run.json").exists():
        raise DataError(f"the last passing run {row['run_id']} was recorded at {path}, which "
                        "no longer holds its results; give --baseline a results directory")
    return path


def recent_runs(results_dir: Path | str, suite: str | None = None, limit: int = 10,
                metrics: tuple[str, ...] = KEY_METRICS) -> pd.DataFrame:
    """Wide table: one row per (run, endpoint) of the newest ``limit`` runs, pooled classes."""
    h = read_history(results_dir, suite)
    if h.empty:
        return h
    h = h[(h["request_class"] == "*") & h["metric"].isin(metrics)]
    runs = (h.drop_duplicates("run_id").sort_values("started_ns").tail(limit)["run_id"])
    h = h[h["run_id"].isin(runs)].assign(verdict=lambda d: d["verdict"].fillna("-"))
    # groupby, not pivot_table(dropna=False): that crosses every run with every verdict
    wide = (h.groupby(["started_ns", "run_id", "endpoint", "verdict", "metric"], sort=True)
            ["value"].first().unstack("metric").reset_index())
    wide.columns.name = None
    wide.insert(0, "date", pd.to_datetime(wide["started_ns"], unit="ns").dt.strftime(
        "%Y-%m-%d %H:%M"))
    return wide.drop(columns=["started_ns"]).reset_index(drop=True)
