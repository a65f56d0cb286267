"""Out-of-core aggregates of a run's requests on DuckDB (issue 34): per (endpoint, workload,
request_class, stage) and per (endpoint, workload), the request counts (total, ok, errors by
status, cancelled), the goodput counts (SLO judged and met) and EXACT percentiles of TTFT, TPOT,
E2E and ITL, computed where the records lie without a row per request in memory.

Every per-request value is ``reports.measures.definitions``' own ``sql`` evaluation of the same
definition the request frame evaluates in numpy; the percentile is numpy's linear one,
reproduced bit for bit (``tests/test_columnar.py`` holds both paths equal).

Exact percentiles without holding every value (DuckDB's exact quantile aggregates keep them
all and do not spill): a two-pass selection. Pass 1 counts the values per group and log-spaced
bucket (a hash aggregate, which spills to disk under the memory limit); from the cumulative
counts, the buckets holding order statistics k and k+1 of each quantile (numpy's virtual index
``(n - 1) * q``) are known. Pass 2 fetches only those buckets' values, which are sorted here.
The bucket is monotone in the value, so the k-th value of the group is the r-th of its bucket.
A per-workload group's histogram is the sum of its stages' and classes' histograms, so both
levels come from one scan.

ITL is over the integer ns gaps (exact order), then converted as the report stores them
(``definitions.gap_ms32``: float32 ms), so the figures are the report's to the last bit.

Reads the run's compacted requests (the Hive-partitioned ``requests/`` dataset, or an older
run's ``requests.parquet``) with DuckDB's own Parquet reader; live shards (Arrow IPC,
msgpack rows) and a Parquet file of an older schema go through the store's reader
(``core.shards.scan``) into a DuckDB temporary table, which spills as well. DuckDB runs with a
memory limit, a thread count and its own temporary folder, and never installs or loads an
extension (nothing is downloaded at run time).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.core.contract import slo_map
from kvbench.core.schema import REQUESTS, STATUSES
from kvbench.core.store import PARTITIONED, read_meta, scan, shard_files, table_files
from kvbench.reports.measures import definitions as D

STAGE_KEYS = ("endpoint", "workload", "request_class", "stage")
WORKLOAD_KEYS = ("endpoint", "workload")
QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99}
# metric -> the definition giving its per-request values (ITL: the gaps, pooled)
LATENCIES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "itl": "itl_gaps_ns"}
ERROR_STATUSES = tuple(s for s in STATUSES if s not in ("ok", "cancelled"))
COUNTS = ("requests", "ok", "errors", "cancelled", "judged", "met",
          *(f"errors_{s}" for s in ERROR_STATUSES))
# buckets per doubling of |value| + 1: about 0.27% wide, so a bucket holds few values
BUCKETS_PER_OCTAVE = 256
_FLAGS = ("ok", "cancelled", "failed", "judged", "met")


@dataclass(frozen=True)
class Settings:
    """The engine's limits: ``memory_limit`` (DuckDB's syntax: "1GB"), ``threads``, and where
    it spills (None: a temporary folder of its own, removed afterwards)."""

    memory_limit: str = "1GB"
    threads: int = 2
    temp_directory: str | None = None


@dataclass
class Aggregates:
    """One row per group: the keys, ``COUNTS``, and per latency ``<metric>_n`` (its sample
    size) and ``<metric>_<p>`` for each of ``QUANTILES`` (NaN where the sample is empty)."""

    by_stage: pd.DataFrame  # keys STAGE_KEYS
    by_workload: pd.DataFrame  # keys WORKLOAD_KEYS


def _lit(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def connect(settings: Settings, temp_directory: str):
    """A DuckDB connection in memory, bounded by ``settings``, with extensions off."""
    import duckdb

    return duckdb.connect(":memory:", config={
        "threads": int(settings.threads), "memory_limit": settings.memory_limit,
        "temp_directory": temp_directory, "preserve_insertion_order": False,
        "autoinstall_known_extensions": False, "autoload_known_extensions": False})


def _ingest(con, name: str, batches, columns: Sequence[str]) -> None:
    """Record batches (the store's reader) into DuckDB temporary table ``name``."""
    schema = pa.schema([REQUESTS.field(c) for c in columns])
    reader = pa.RecordBatchReader.from_batches(schema, batches)
    con.register("_kvbench_in", reader)
    try:
        con.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM _kvbench_in")
    finally:
        con.unregister("_kvbench_in")


def _records(con, run_dir: Path, columns: Sequence[str]) -> None:
    """View ``records``: the run's requests (``columns``), Parquet and live shards."""
    parts = []
    cols = ", ".join(columns)
    pfile = run_dir / "requests.parquet"  # layout 1: one file
    dataset = [f for f in table_files(run_dir, "requests") if f != pfile]  # layout 2: Hive
    if dataset:
        names = set(pq.read_schema(dataset[0]).names) | set(PARTITIONED["requests"])
        if set(columns) <= names:
            files = "[" + ", ".join(_lit(str(f)) for f in dataset) + "]"
            parts.append(f"SELECT {cols} FROM read_parquet({files}, hive_partitioning = true, "
                         "hive_types_autocast = false, union_by_name = true)")
        else:  # an older schema: the store's reader adds the missing columns as nulls
            # (it reads every compacted file, a layout-1 one beside the dataset too)
            _ingest(con, "_kvbench_dataset", scan(run_dir, "requests", columns, shards=False,
                                                  strict=True), columns)
            parts.append(f"SELECT {cols} FROM _kvbench_dataset")
    if pfile.exists() and not (dataset and len(parts)
                               and "_kvbench_dataset" in parts[-1]):
        if set(columns) <= set(pq.read_schema(pfile).names):
            parts.append(f"SELECT {cols} FROM read_parquet({_lit(str(pfile))})")
        else:  # an older schema: the store's reader adds the missing columns as nulls
            _ingest(con, "_kvbench_parquet", scan(run_dir, "requests", columns, shards=False,
                                                  strict=True), columns)
            parts.append(f"SELECT {cols} FROM _kvbench_parquet")
    if shard_files(run_dir, "requests"):
        _ingest(con, "_kvbench_shards", scan(run_dir, "requests", columns, parquet=False,
                                             strict=True), columns)
        parts.append(f"SELECT {cols} FROM _kvbench_shards")
    if not parts:
        _ingest(con, "_kvbench_none", iter(()), columns)
        parts.append(f"SELECT {cols} FROM _kvbench_none")
    con.execute("CREATE TEMP VIEW records AS " + " UNION ALL ".join(parts))


def _bucket(v: str) -> str:
    """The bucket of value ``v``: monotone (non-decreasing) in the value, signed."""
    return (f"CAST(sign(CAST({v} AS DOUBLE)) * floor(log2(abs(CAST({v} AS DOUBLE)) + 1) * "
            f"{BUCKETS_PER_OCTAVE}) AS BIGINT)")


def _views(con, slo: Mapping[str, object]) -> None:
    """``req`` (the definitions per request), ``scalar_values`` and ``itl_values`` (one row
    per value: keys, metric ``m``, value ``v``, bucket ``b``)."""
    keys = ", ".join(STAGE_KEYS)
    flags = ", ".join(f"{D.sql(f, slo)} AS {f}" for f in _FLAGS)
    lat = ", ".join(f"{D.sql(d, slo)} AS {m}" for m, d in LATENCIES.items())
    con.execute(f"CREATE TEMP VIEW req AS SELECT {keys}, status, {flags}, {lat} FROM records")
    scalars = [m for m in LATENCIES if m != "itl"]
    # UNPIVOT leaves out nulls: a request without the value is not in its sample
    con.execute(f"""CREATE TEMP VIEW scalar_values AS SELECT *, {_bucket('v')} AS b FROM (
        UNPIVOT (SELECT {keys}, {', '.join(scalars)} FROM req)
        ON {', '.join(scalars)} INTO NAME m VALUE v)""")
    con.execute(f"""CREATE TEMP VIEW itl_values AS SELECT *, {_bucket('v')} AS b FROM (
        SELECT {keys}, 'itl' AS m, unnest(itl) AS v FROM req)""")


def _counts(con) -> pd.DataFrame:
    keys = ", ".join(STAGE_KEYS)
    got = con.execute(f"""SELECT {keys}, status, count(*) AS requests,
        {', '.join(f'count_if({f}) AS {f}' for f in _FLAGS)} FROM req
        GROUP BY ALL""").fetch_df()
    got = got.rename(columns={"failed": "errors"})
    for s in ERROR_STATUSES:
        got[f"errors_{s}"] = np.where(got["status"] == s, got["errors"], 0)
    return got.drop(columns="status")


def _sum(frame: pd.DataFrame, keys: Sequence[str], cols: Sequence[str]) -> pd.DataFrame:
    return frame.groupby(list(keys), dropna=False, sort=True)[list(cols)].sum().reset_index()


def linear(lo: np.ndarray, hi: np.ndarray, index: np.ndarray) -> np.ndarray:
    """numpy's 'linear' quantile from order statistics ``floor(index)`` (``lo``) and the next
    (``hi``) at virtual index ``index``: numpy's own arithmetic, in its dtypes."""
    gamma = index - np.floor(index)
    diff = hi - lo
    out = lo + diff * gamma
    return np.where(gamma >= 0.5, hi - diff * (1 - gamma), out)


def _wants(hist: pd.DataFrame, keys: Sequence[str], qs: Sequence[float]) -> list[tuple]:
    """Per group of ``keys`` and metric: (group key, metric, n, [(bucket, rank) of order
    statistic k, of k+1] per quantile) from the bucket counts ``hist``."""
    out = []
    h = _sum(hist, [*keys, "m", "b"], ["n"])
    for key, g in h.groupby([*keys, "m"], dropna=False, sort=True):
        c = np.cumsum(g["n"].to_numpy(np.int64))
        b = g["b"].to_numpy()
        n = int(c[-1])
        picks = []
        for q in qs:
            index = (n - 1) * np.asarray([q], np.float64)
            k = min(int(np.floor(index[0])), n - 1)
            pair = []
            for kk in (k, min(k + 1, n - 1)):
                i = int(np.searchsorted(c, kk, side="right"))
                pair.append((int(b[i]), kk - (int(c[i - 1]) if i else 0)))
            picks.append((index, pair))
        out.append((key[:-1], key[-1], n, picks))
    return out


def _select(con, view: str, hist: pd.DataFrame, levels: Mapping[str, Sequence[str]],
            qs: Sequence[float], convert) -> dict[str, dict]:
    """Pass 2 over ``view``: per level, {(group key, metric): (n, [quantile values])}."""
    wants = {lvl: _wants(hist, keys, qs) for lvl, keys in levels.items()}
    w = pd.DataFrame([(*key[:2], m, bk) for ws in wants.values() for key, m, _, picks in ws
                      for _, pair in picks for bk, _ in pair],
                     columns=["endpoint", "workload", "m", "b"]).drop_duplicates()
    out: dict[str, dict] = {lvl: {} for lvl in levels}
    if w.empty:
        return out
    w = w.astype({"b": np.int64})
    con.register("_kvbench_wanted", w)
    try:
        on = " AND ".join(f"v.{c} IS NOT DISTINCT FROM w.{c}" for c in w.columns)
        vals = con.execute(f"""SELECT {', '.join('v.' + k for k in STAGE_KEYS)}, v.m, v.b, v.v
            FROM {view} v JOIN _kvbench_wanted w ON {on}""").fetch_df()
    finally:
        con.unregister("_kvbench_wanted")
    for lvl, keys in levels.items():
        groups = vals.groupby([*keys, "m", "b"], dropna=False, sort=False).indices
        values = vals["v"].to_numpy()
        cache: dict = {}

        def bucket(key: tuple, m: str, bk: int):
            got = cache.get((key, m, bk))
            if got is None:
                idx = groups[(*key, m, bk)] if keys else groups[(m, bk)]
                got = cache[(key, m, bk)] = convert(np.sort(values[idx]))
            return got

        for key, m, n, picks in wants[lvl]:
            res = []
            for index, ((b0, r0), (b1, r1)) in picks:
                lo, hi = bucket(key, m, b0)[r0:r0 + 1], bucket(key, m, b1)[r1:r1 + 1]
                res.append(float(linear(lo, hi, index)[0]))
            out[lvl][(key, m)] = (n, res)
    return out


def _ms32(v: np.ndarray) -> np.ndarray:
    return D.gap_ms32(v.astype(np.int64)).astype(np.float32)


def _f64(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float64)


def aggregate(run_dir: Path | str, slo: Mapping | None = None, *,
              quantiles: Mapping[str, float] = QUANTILES,
              settings: Settings = Settings()) -> Aggregates:
    """The counts and exact latency percentiles of the run in ``run_dir`` (``Aggregates``).

    ``slo``: {class: SLO or its dict}; None takes the run's own (run.json's config)."""
    run_dir = Path(run_dir)
    if slo is None:
        slo = read_meta(run_dir).slo
    slo = slo_map({c: s.model_dump() if hasattr(s, "model_dump") else s
                   for c, s in (slo or {}).items()})
    tmp = settings.temp_directory or tempfile.mkdtemp(prefix="kvbench-duckdb-")
    con = connect(settings, tmp)
    try:
        columns = list(dict.fromkeys([*STAGE_KEYS, "status", *D.inputs(
            [*_FLAGS, *LATENCIES.values()])]))
        _records(con, run_dir, columns)
        _views(con, slo)
        counts = _counts(con)
        levels = {"by_stage": STAGE_KEYS, "by_workload": WORKLOAD_KEYS}
        qs = list(quantiles.values())
        picked: dict[str, dict] = {lvl: {} for lvl in levels}
        for view, convert in (("scalar_values", _f64), ("itl_values", _ms32)):
            hist = con.execute(f"SELECT {', '.join(STAGE_KEYS)}, m, b, count(*) AS n "
                               f"FROM {view} GROUP BY ALL").fetch_df()
            if len(hist):
                for lvl, got in _select(con, view, hist, levels, qs, convert).items():
                    picked[lvl].update(got)
    finally:
        con.close()
        if settings.temp_directory is None:
            shutil.rmtree(tmp, ignore_errors=True)
    frames = {}
    for lvl, keys in levels.items():
        f = _sum(counts, keys, COUNTS)
        f[list(COUNTS)] = f[list(COUNTS)].astype(np.int64)
        for m in LATENCIES:
            ns, cols = [], {p: [] for p in quantiles}
            for row in f[list(keys)].itertuples(index=False, name=None):
                n, vals = picked[lvl].get((tuple(row), m), (0, [math.nan] * len(quantiles)))
                ns.append(n)
                for p, v in zip(quantiles, vals):
                    cols[p].append(v)
            f[f"{m}_n"] = np.asarray(ns, np.int64)
            for p in quantiles:
                f[f"{m}_{p}"] = np.asarray(cols[p], np.float64)
        frames[lvl] = f
    return Aggregates(**frames)
