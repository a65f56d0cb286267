"""Results history: the key metrics of every gated or accepted run, kept in the results store
itself (a local folder or ``s3://bucket/prefix``), listed through its manifest.

* ``history/suite=<suite>/date=<YYYY-MM-DD>/<run_id>.parquet``: one file per run, one row per
  (endpoint, workload, request class, metric) with the run's verdict (``*``: pooled). Rewriting
  a run's file (e.g. the gate after ``--accept``) replaces its rows. A Hive-partitioned dataset
  that any engine reads.
* ``history/_manifest/...``: one small JSON object per run and write (``kvbench.core.manifest``)
  with the run's id, suite, start, verdict, where the run and its history file are, and its key
  figures per endpoint x workload (capacity at SLO, TTFT/TPOT p99, goodput), so listing and
  trending runs reads only the manifest, and ``last-pass`` opens one history file.

``last-pass`` is the newest run of a suite whose verdict is ``pass`` or ``accepted``: a run a
person accepted as a baseline (``kvbench history --accept RUN``), which is how a nightly's first
baseline is seeded (an A/A gate of two good runs may well be ``inconclusive``, which never
counts as a pass). A store written by an older kvbench (history files, no manifest) gets its
manifest from those files the first time it is read.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.core import manifest as MF
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
    ("workload", pa.string()),  # "*": every workload pooled (absent in older files: "*")
])

BASELINE_VERDICTS = MF.BASELINE_VERDICTS  # what last-pass takes

KEY_METRICS = ("throughput_rps", "goodput_rps", "ttft_p50", "ttft_p99", "tpot_p50", "itl_p99",
               "e2e_p99", "error_rate", "hit_ratio")
# the manifest's figures per endpoint x workload (capacity_rps: only runs with a search)
FIGURES = ("capacity_rps", "ttft_p99", "tpot_p99", "goodput_rps")


def _date(started_ns: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(started_ns / 1e9))


def history_dir(results_dir) -> str:
    return MF.Store.of(results_dir).where("history")


def row_file(suite: str, started_ns: int, run_id: str) -> str:
    return f"history/suite={suite}/date={_date(started_ns)}/{run_id}.parquet"


def figures(rows: list[dict]) -> list[dict]:
    """The manifest's key figures: per endpoint x workload, ``FIGURES`` of the pooled class."""
    out: dict = {}
    for r in rows:
        if r.get("request_class", "*") != "*" or r["metric"] not in FIGURES:
            continue
        key = (r["endpoint"], r.get("workload", "*"))
        v = float(r["value"])
        out.setdefault(key, {"endpoint": key[0], "workload": key[1]})[r["metric"]] = (
            None if v != v else v)  # NaN: null in JSON
    return [out[k] for k in sorted(out)]


def record_run(results_dir, meta: RunMeta, run_path, rows: list[dict],
               verdict: str | None = None, storage=None) -> str:
    """Write (or replace) one run's history file in the store ``results_dir`` (a path, an
    s3:// URL or a ``manifest.Store``) and add its manifest entry; ``rows`` carry endpoint,
    workload (default ``*``), request_class, metric, value. Returns where the file is."""
    store = MF.Store.of(results_dir, storage)
    suite = str(meta.suite or "default")
    started = int(meta.started_ns or time.time_ns())
    run_id = str(meta.run_id or Path(str(run_path)).name)
    ref = store.run_ref(run_id, run_path)
    n = len(rows)
    table = pa.table({
        "run_id": [run_id] * n, "suite": [suite] * n, "started_ns": [started] * n,
        "run_path": [ref] * n,
        "endpoint": [r["endpoint"] for r in rows],
        "request_class": [r["request_class"] for r in rows],
        "metric": [r["metric"] for r in rows],
        "value": [float(r["value"]) for r in rows],
        "verdict": [verdict] * n,
        "workload": [r.get("workload", "*") for r in rows],
    }, schema=HISTORY)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    rel = row_file(suite, started, run_id)
    store.put(rel, buf.getvalue())
    MF.write_entry(store, {"run_id": run_id, "suite": suite, "started_ns": started,
                           "verdict": verdict, "run": ref, "history": rel,
                           "figures": figures(rows)})
    return store.where(rel)


def _read_one(store: MF.Store, rel: str) -> pa.Table:
    """One run's history rows; a damaged (or vanished) file is a ``DataError`` naming it."""
    data = store.get(rel)
    where = store.where(rel)
    if data is None:
        raise DataError(f"{where}: the history file its manifest entry names is gone; prune "
                        "the history (kvbench history --prune) or gate again")
    try:
        t = pq.read_table(pa.BufferReader(data))
        if "workload" not in t.column_names:  # written before workloads were kept
            t = t.append_column("workload", pa.array(["*"] * t.num_rows, pa.string()))
        return t.select(HISTORY.names).cast(HISTORY)
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        reason = "empty (0 bytes)" if not data else (
            f"not a readable history file ({str(exc).splitlines()[0][:160]})")
        raise DataError(f"{where}: {reason}; remove it (that run's history row is lost) and "
                        "gate again") from None


def _migrate(store: MF.Store) -> None:
    """Manifest entries for the history files of a store written before the manifest."""
    if store.remote or store.list(MF.MANIFEST):
        return
    for rel in store.list("history"):
        if not (rel.startswith("suite=") and rel.endswith(".parquet")) or rel.count("/") != 2:
            continue
        t = _read_one(store, f"history/{rel}").to_pandas()
        if t.empty:
            continue
        first = t.iloc[0]
        MF.write_entry(store, {
            "run_id": first["run_id"], "suite": first["suite"],
            "started_ns": int(first["started_ns"]), "verdict": first["verdict"],
            "run": first["run_path"], "history": f"history/{rel}",
            "figures": figures(t.to_dict("records"))})


def entries(results_dir, suite: str | None = None, limit: int | None = None,
            where=None) -> list[dict]:
    """Manifest entries of the store, oldest first (see ``manifest.read_entries``)."""
    store = MF.Store.of(results_dir)
    _migrate(store)
    return MF.read_entries(store, suite, limit, where)


def read_history(results_dir, suite: str | None = None, limit: int | None = None
                 ) -> pd.DataFrame:
    """The history rows of the newest ``limit`` runs (every run: None)."""
    store = MF.Store.of(results_dir)
    chosen = entries(store, suite, limit)
    if not chosen:
        return HISTORY.empty_table().to_pandas()
    return pa.concat_tables([_read_one(store, e["history"]) for e in chosen]).to_pandas()


def last_passes(results_dir, suite: str | None = None, exclude_run: str | None = None,
                n: int = 1) -> list[dict]:
    """The newest ``n`` passing or accepted runs' entries, newest first; each one's history
    file is read to confirm its verdict (a damaged one is named, not skipped)."""
    store = MF.Store.of(results_dir)
    chosen = entries(store, suite, n, where=lambda e: e.get("verdict") in BASELINE_VERDICTS
                     and e["run_id"] != (exclude_run or ""))
    if not chosen:
        where = f" of suite {suite!r}" if suite else ""
        raise DataError(f"no passing or accepted run{where} in {store.where('history')}; "
                        "accept a good run as the first baseline (kvbench history --accept "
                        "RUN) or give --baseline a results directory")
    for e in chosen:
        rows = _read_one(store, e["history"]).to_pandas()
        if not rows.empty and rows["verdict"].iloc[0] not in BASELINE_VERDICTS:
            e["verdict"] = rows["verdict"].iloc[0]  # an older file rewritten meanwhile
    return chosen[::-1]


def last_pass(results_dir, suite: str | None = None, exclude_run: str | None = None) -> Path:
    """The local results directory of the newest passing or accepted run of a local store."""
    e = last_passes(results_dir, suite, exclude_run)[0]
    path = Path(e["run"])
    if not (path / "run.json").exists():
        raise DataError(f"the last passing run {e['run_id']} was recorded at {path}, which "
                        "no longer holds its results; give --baseline a results directory")
    return path


def _stamp(df: pd.DataFrame) -> pd.Series:
    return pd.to_datetime(df["started_ns"], unit="ns").dt.strftime("%Y-%m-%d %H:%M")


def recent_runs(results_dir, suite: str | None = None, limit: int = 10,
                metrics: tuple[str, ...] = KEY_METRICS) -> pd.DataFrame:
    """Wide table: one row per (run, endpoint) of the newest ``limit`` runs, pooled classes
    and workloads (only those runs' history files are read)."""
    h = read_history(results_dir, suite, limit)
    if h.empty:
        return h
    h = h[(h["request_class"] == "*") & (h["workload"] == "*") & h["metric"].isin(metrics)]
    h = h.assign(verdict=lambda d: d["verdict"].fillna("-"))
    # groupby, not pivot_table(dropna=False): that crosses every run with every verdict
    wide = (h.groupby(["started_ns", "run_id", "endpoint", "verdict", "metric"], sort=True)
            ["value"].first().unstack("metric").reset_index())
    wide.columns.name = None
    wide.insert(0, "date", _stamp(wide))
    return wide.drop(columns=["started_ns"]).reset_index(drop=True)


def trend(results_dir, suite: str | None = None, limit: int = 30) -> pd.DataFrame:
    """The manifest's figures of the newest ``limit`` runs, one row per run x endpoint x
    workload, oldest first: no history file is read."""
    rows = []
    for e in entries(results_dir, suite, limit):
        for f in e.get("figures") or []:
            rows.append({"started_ns": e["started_ns"], "run_id": e["run_id"],
                         "suite": e["suite"], "verdict": e.get("verdict") or "-",
                         **{k: f.get(k) for k in ("endpoint", "workload")},
                         **{k: f.get(k) for k in FIGURES}})
    cols = ["date", "run_id", "suite", "verdict", "endpoint", "workload", *FIGURES]
    if not rows:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(rows)
    df.insert(0, "date", _stamp(df))
    return df[cols].astype({k: "float64" for k in FIGURES})
