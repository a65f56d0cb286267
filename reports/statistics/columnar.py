"""Out-of-core aggregates of a run's requests (issue 34): per (endpoint, workload,
request_class, stage) and per (endpoint, workload), the request counts (total, ok, errors by
status, cancelled), the goodput counts (SLO judged and met) and EXACT percentiles of TTFT, TPOT,
E2E and ITL, computed where the records lie without a row per request in memory.

Over 400 lines, kept whole: the two evaluations of one two-pass selection (the per-request
values DuckDB evaluates, ITL's pooled gaps numpy derives, both bucketed and selected in numpy
as they stream) share its order-statistic and interpolation code (``columnar_select``), and the
equality test holds both to the request frame at once.

Every per-request value is ``reports.measures.definitions``' own evaluation of the same
definition the request frame evaluates (its ``sql`` in DuckDB; for ITL its numpy ``evaluate``
on each batch); the percentile is numpy's linear one, reproduced bit for bit
(``tests/test_columnar.py`` holds both paths equal).

Exact percentiles without holding every value (DuckDB's exact quantile aggregates keep them
all and do not spill): a two-pass selection. Pass 1 counts the values per group and bucket;
from the cumulative counts, the buckets holding order statistics k and k+1 of each quantile
(numpy's virtual index ``(n - 1) * q``) are known. Pass 2 fetches only those buckets' values,
which are sorted here. The bucket is monotone in the value, so the k-th value of the group is
the r-th of its bucket. A per-workload group's histogram is the sum of its stages' and
classes' histograms, so both levels come from one scan.

TTFT, TPOT, E2E and lateness (one value per request) are evaluated by DuckDB over the scalar
columns only and handed over as Arrow batches (``_scalars``), read twice: bucketed by their
float64 bits and counted into a dense histogram per metric, then kept where wanted (an
aggregate of the values unpivoted in DuckDB, 60M rows at 10M requests, and a join over them
again cost twice as much at 10M). ITL (~47 gaps per request: 470M at 10M requests) is
streamed: the list column is read file by file in batches of ``ITL_BATCH`` requests, the gaps
derived by the definitions' numpy evaluation, bucketed by their float64 bit pattern and
counted by ``bincount`` into a dense (group, bucket) matrix, and spilled to an unlinked
temporary file (4 bytes a gap: 1.9 GB at 10M, in the page cache mostly); pass 2 reads the
spill back, not the Parquet (whose chunk lists cost more to decode than anything done with the
gaps), and keeps those whose (group, bucket) a lookup table marks. Every temporary stays a few
MB: on this host a 376 MB numpy temporary cost ten times its arithmetic in page faults, which
is what unnesting the list in DuckDB (twice) cost before. ITL is over the integer ns gaps
(exact order), then converted as the report stores them (``definitions.gap_ms32``: float32 ms).

Where the run's Parquet lies is ``parquet_files`` alone: a Hive-partitioned ``requests/``
dataset and an older run's single ``requests.parquet``. Live shards (Arrow IPC, msgpack rows) and a Parquet
file of an older schema go through the store's reader (``core.shards.scan``): into a DuckDB
temporary table for the scalars (it spills as well), batch by batch for ITL. DuckDB runs with a
memory limit, a thread count and its own temporary folder, and never installs or loads an
extension (nothing is downloaded at run time).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.core.contract import slo_map
from kvbench.core.schema import REQUESTS, STATUSES
from kvbench.core.store import read_meta, scan, shard_files, table_files
from kvbench.reports.measures import definitions as D
from kvbench.reports.statistics.columnar_select import (
    _CODE, STAGE_KEYS, _gap_bucket, _Groups, _Hist, _norm, _pick, _Spill, _sum, _value_bucket,
    _wanted, linear)

WORKLOAD_KEYS = ("endpoint", "workload")
QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99}
# metric -> the definition giving its per-request values (ITL: the gaps, pooled)
LATENCIES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "lateness": "lateness_ms",
             "ttft_intended": "ttft_intended_ms", "e2e_intended": "e2e_intended_ms",
             "itl": "itl_gaps_ns"}
SCALARS = tuple(m for m in LATENCIES if m != "itl")  # one value per request
ERROR_STATUSES = tuple(s for s in STATUSES if s not in ("ok", "cancelled"))
COUNTS = ("requests", "ok", "errors", "cancelled", "judged", "met",
          *(f"errors_{s}" for s in ERROR_STATUSES))
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

    by_stage: pd.DataFrame | None  # keys STAGE_KEYS (None: ``aggregate(base=False)``)
    by_workload: pd.DataFrame | None  # keys WORKLOAD_KEYS (None likewise)
    # any further level asked of ``aggregate`` (``levels``): name -> its frame, same columns
    extra: dict[str, pd.DataFrame] = field(default_factory=dict)


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


def parquet_files(run_dir: Path) -> list[tuple[Path, dict[str, str]]]:
    """The run's compacted Parquet files of requests, each with its Hive partition keys ({}
    for none). The ONE place that knows the layout: the files of a ``requests/`` dataset
    (``endpoint=<e>/workload=<w>/part-<n>.parquet``, keys from the folder names) and an older
    run's single ``requests.parquet``."""
    from urllib.parse import unquote

    d = run_dir / "requests"
    return [(f, dict(unquote(seg).split("=", 1) for seg in f.relative_to(d).parent.parts
                     if "=" in seg) if f.parent != run_dir else {})
            for f in table_files(run_dir, "requests")]  # the store's own listing


def _read_sql(files: list[tuple[Path, dict[str, str]]], cols: str) -> str:
    """A DuckDB query of ``cols`` over ``files`` (Hive keys as text: no type guessing)."""
    parts = []
    for hive in (True, False):
        some = [_lit(str(f)) for f, keys in files if bool(keys) == hive]
        if some:
            opts = (", hive_partitioning = true, hive_types_autocast = false, "
                    "union_by_name = true") if hive else ""
            parts.append(f"SELECT {cols} FROM read_parquet([{', '.join(some)}]{opts})")
    return " UNION ALL ".join(parts)


def _records(con, run_dir: Path, columns: Sequence[str]) -> None:
    """View ``records``: the run's requests (``columns``), Parquet and live shards."""
    parts = []
    cols = ", ".join(columns)
    files = parquet_files(run_dir)
    if files:
        if _has(files, columns):
            parts.append(_read_sql(files, cols))
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


def _views(con, slo: Mapping[str, object]) -> None:
    """``req``: the definitions per request (flags and latencies). ITL's gaps are not here:
    ``_itl`` streams them."""
    keys = ", ".join(STAGE_KEYS)
    flags = ", ".join(f"{D.sql(f, slo)} AS {f}" for f in _FLAGS)
    lat = ", ".join(f"{D.sql(d, slo)} AS {m}" for m, d in LATENCIES.items() if m in SCALARS)
    con.execute(f"CREATE TEMP VIEW req AS SELECT {keys}, status, {flags}, {lat} FROM records")


def _counts(con) -> pd.DataFrame:
    keys = ", ".join(STAGE_KEYS)
    got = con.execute(f"""SELECT {keys}, status, count(*) AS requests,
        {', '.join(f'count_if({f}) AS {f}' for f in _FLAGS)} FROM req
        GROUP BY ALL""").fetch_df()
    got = got.rename(columns={"failed": "errors"})
    for s in ERROR_STATUSES:
        got[f"errors_{s}"] = np.where(got["status"] == s, got["errors"], 0)
    return got.drop(columns="status")


# --------------------------------------------------------------------------- ITL, streamed

ITL_BATCH = 16_384  # requests per batch: ~800k gaps, every temporary a few MB
def _has(files, columns: Sequence[str]) -> bool:
    """Every file holds ``columns`` (in it or as a partition key): today's schema."""
    return all(set(columns) <= set(pq.read_schema(f).names) | set(keys) for f, keys in files)


def _itl_batches(run_dir: Path, columns: Sequence[str], rows: int = ITL_BATCH):
    """The run's records (``columns``) as Arrow batches of at most ``rows`` rows, in the
    same order whatever ``rows`` (``record_batches``):
    Parquet file by file (``iter_batches`` without pre-buffering: a few MB in flight, where
    the dataset scanner held a row group's pages of every column ahead), a partition key as
    a constant column; an older schema and live shards through the store's reader."""
    files = parquet_files(run_dir)
    parts = []
    if files:
        if _has(files, columns):
            parts.append(parquet_batches(files, columns, rows, coded=True))
        else:
            parts.append(scan(run_dir, "requests", columns, shards=False, strict=True))
    if shard_files(run_dir, "requests"):
        parts.append(scan(run_dir, "requests", columns, parquet=False, strict=True))
    for part in parts:
        for batch in part:
            for s in range(0, batch.num_rows, rows):
                yield batch.slice(s, rows)


def record_batches(run_dir: Path, columns: Sequence[str], rows: int = 131_072):
    """The run's records (``columns``), in the order ``aggregate``'s ITL pass (and its
    ``on_batch``) meets them, in batches of at most ``rows``: a second read of columns that
    pass does not need, row for row."""
    return _itl_batches(Path(run_dir), columns, rows)


_CODED = frozenset({"endpoint", "workload", "request_class", "status"})


def parquet_batches(files, columns: Sequence[str], batch_size: int = ITL_BATCH,
                    coded: bool = False):
    """``columns`` of ``files`` (``parquet_files``) in batches, file by file, a partition key
    as a constant column of its ``REQUESTS`` type; ``coded``: the group keys and the status
    (``_CODED``) as dictionary arrays where a file holds them."""
    for f, keys in files:
        own = [c for c in columns if c not in keys]
        # the group keys and the status as dictionaries, as Parquet holds them (what the
        # group numbering and the definitions encode them into): no string per row
        dicts = [c for c in own if c in _CODED] if coded else []
        for b in pq.ParquetFile(f, pre_buffer=False, read_dictionary=dicts).iter_batches(
                batch_size=batch_size, columns=own):
            yield pa.RecordBatch.from_arrays(
                [b.column(c) if c not in keys else
                 pa.array([keys[c]] * b.num_rows).cast(REQUESTS.field(c).type)
                 for c in columns], names=list(columns))


def _row_gaps(batch, groups: _Groups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group number of each row, gaps of each row, ns gaps) of ``batch``: ``definitions``'
    own gaps, in row order."""
    got = D.evaluate(["itl_gaps_ns"], D.from_arrow(batch, D.inputs(["itl_gaps_ns"])),
                     n=batch.num_rows)["itl_gaps_ns"]
    per_row = np.diff(got.offsets)
    if not len(got.values):
        return np.zeros(0, np.int64), per_row, got.values
    return groups.of(batch), per_row, got.values


def itl_columns() -> list[str]:
    """The record columns ``aggregate``'s ITL passes read (the group keys, the gaps' inputs)."""
    return list(dict.fromkeys([*STAGE_KEYS, *D.inputs(["itl_gaps_ns"])]))


def _itl(run_dir: Path, levels: Mapping[str, Sequence[str]],
         qs: Sequence[float], on_batch=None, batch_columns: Sequence[str] = (),
         temp_directory: str | None = None) -> dict[str, dict]:
    """ITL's exact quantiles per level by two streamed passes over the gaps (numpy on
    small batches: no list is unnested into a table, no temporary outgrows the cache):
    pass 1 decodes the chunk lists, counts gaps per (group, bucket) and spills the gaps
    (``_Spill``, in ``temp_directory``); pass 2 reads the spill back and keeps the gaps of
    the wanted buckets."""
    columns = itl_columns()
    groups, hist = _Groups(), _Hist()
    spill = _Spill(temp_directory)
    try:
        first = list(dict.fromkeys([*columns, *batch_columns])) if on_batch else columns
        for batch in _itl_batches(run_dir, first):
            if on_batch is not None:
                on_batch(batch)
            rows, per_row, v = _row_gaps(batch, groups)
            if len(v):
                hist.add(np.repeat(rows, per_row), _gap_bucket(v))
                spill.write(rows, per_row, v)
        return _itl_select(hist, groups, levels, qs, spill)
    finally:
        spill.close()


def _itl_select(hist: _Hist, groups: _Groups, levels: Mapping[str, Sequence[str]],
                qs: Sequence[float], spill: _Spill) -> dict[str, dict]:
    """ITL's pass 2, over the gaps ``spill`` holds, and the quantiles from its values."""
    h = hist.frame(groups)
    if not len(h):
        return {lvl: {} for lvl in levels}
    wants, w = _wanted(h, levels, qs)
    # the wanted buckets per stage group (a coarser group's buckets are its stages' too)
    wanted = set(zip(w["endpoint"].map(_norm), w["b"].tolist()))
    # (group, bucket - base): a wanted bucket (groups without gaps too: pass 1 numbered them)
    keep = np.zeros((len(groups.keys), hist.counts.shape[1]), bool)
    for i, key in enumerate(groups.keys):
        for e, b in wanted:
            if key[0] == e:
                keep[i, b - hist.base] = True
    got_g, got_b, got_v = [], [], []
    buckets = np.flatnonzero(keep.any(axis=0)) + hist.base
    for g, v in spill.read(_Spill.grains(buckets)):
        b = _gap_bucket(v)
        mask = keep[g, b - hist.base]  # pass 1 met every (group, bucket) of these gaps
        if mask.any():
            got_g.append(g[mask]), got_b.append(b[mask]), got_v.append(v[mask])
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
    g, b, v = cat(got_g), cat(got_b), cat(got_v)
    del got_g, got_b, got_v
    order = np.lexsort((b, g))
    g, b, v = g[order], b[order], v[order]
    code = g * _CODE + b
    starts = np.flatnonzero(np.r_[True, code[1:] != code[:-1]]) if len(code) else code
    ends = np.r_[starts[1:], len(code)] if len(code) else code
    cells = {(int(g[s]), int(b[s])): v[s:e] for s, e in zip(starts, ends)}
    out: dict[str, dict] = {lvl: {} for lvl in levels}
    for lvl, keys in levels.items():
        cache: dict = {}
        pos = [STAGE_KEYS.index(k) for k in keys]
        for key, m, n, picks in wants[lvl]:
            key = tuple(key)
            members = [i for i, k in enumerate(groups.keys)
                       if tuple(k[p] for p in pos) == key]

            def bucket(bk: int):
                if bk not in cache:
                    parts = [cells[(i, bk)] for i in members if (i, bk) in cells]
                    cache[bk] = _ms32(np.sort(np.concatenate(parts)))
                return cache[bk]

            res = []
            for index, ((b0, r0), (b1, r1)) in picks:
                lo, hi = bucket(b0)[r0:r0 + 1], bucket(b1)[r1:r1 + 1]
                res.append(float(linear(lo, hi, index)[0]))
            out[lvl][(key, m)] = (n, res)
            cache.clear()
    return out


SCALAR_BATCH = 131_072  # requests per batch of the per-request values DuckDB hands over
def _scalars(con, levels: Mapping[str, Sequence[str]], qs: Sequence[float]
             ) -> dict[str, dict]:
    """The per-request latencies' quantiles per level (``_select``'s result) by the same
    two-pass selection, DuckDB evaluating the values (view ``req``: the definitions' SQL)
    and numpy bucketing them: pass 1 counts values per (stage group, bucket) into a dense
    histogram per metric as DuckDB's batches stream out, pass 2 streams them again and keeps
    those in the wanted buckets. (A DuckDB aggregate over the values unpivoted, 60M rows
    at 10M requests, and a join over them again cost several times this.)"""
    query = f"SELECT {', '.join(STAGE_KEYS)}, {', '.join(SCALARS)} FROM req"

    def batches():
        reader = con.sql(query).to_arrow_reader(SCALAR_BATCH)
        for batch in reader:
            g = groups.of(batch)
            for m in SCALARS:
                col = batch.column(m)
                v = col.to_numpy(zero_copy_only=False).astype(np.float64)
                ok = ~np.isnan(v)
                if col.null_count:
                    ok &= col.is_valid().to_numpy(zero_copy_only=False)
                if ok.all():
                    yield m, g, v
                elif ok.any():
                    yield m, g[ok], v[ok]

    groups = _Groups()
    hists = {m: _Hist() for m in SCALARS}
    for m, g, v in batches():
        hists[m].add(g, _value_bucket(v))
    frames = [hists[m].frame(groups, m) for m in SCALARS if hists[m].counts.size]
    if not frames:
        return {lvl: {} for lvl in levels}
    wants, w = _wanted(pd.concat(frames, ignore_index=True), levels, qs)
    keep = {}
    for m in SCALARS:
        h = hists[m]
        keep[m] = np.zeros((len(groups.keys), h.counts.shape[1]), bool)
        for e, b in zip(w.loc[w["m"] == m, "endpoint"].map(_norm), w.loc[w["m"] == m, "b"]):
            for i, key in enumerate(groups.keys):
                if key[0] == e and 0 <= b - h.base < h.counts.shape[1]:
                    keep[m][i, b - h.base] = True
    got: list[pd.DataFrame] = []
    for m, g, v in batches():  # the groups met in pass 1, the same buckets
        h = hists[m]
        b = _value_bucket(v)
        mask = keep[m][g, b - h.base]
        if mask.any():
            part = pd.DataFrame({"_g": g[mask], "b": b[mask], "v": v[mask]})
            part["m"] = m
            got.append(part)
    if not got:
        return {lvl: {} for lvl in levels}
    vals = pd.concat(got, ignore_index=True)
    keys = pd.DataFrame(groups.keys, columns=list(STAGE_KEYS)).iloc[vals["_g"].to_numpy()]
    vals = pd.concat([keys.reset_index(drop=True), vals.drop(columns="_g")], axis=1)
    return _pick(vals, wants, levels, _f64)


def _ms32(v: np.ndarray) -> np.ndarray:
    return D.gap_ms32(v.astype(np.int64)).astype(np.float32)


def _f64(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float64)


def aggregate(run_dir: Path | str, slo: Mapping | None = None, *,
              quantiles: Mapping[str, float] = QUANTILES,
              settings: Settings = Settings(),
              levels: Mapping[str, Sequence[str]] | None = None,
              on_batch=None, batch_columns: Sequence[str] = (),
              base: bool = True) -> Aggregates:
    """The counts and exact latency percentiles of the run in ``run_dir`` (``Aggregates``).

    ``slo``: {class: SLO or its dict}; None takes the run's own (run.json's config).
    ``levels``: further groupings, {name: keys} (keys among ``STAGE_KEYS``, the endpoint
    first), returned in ``Aggregates.extra``. ``on_batch``: called with each batch of the
    records (in file order, ``batch_columns`` among its columns) as the first ITL pass reads
    them, so that a caller takes what it needs of every request (a seeded sample: the
    report's ``scale``) without decoding the chunk lists once more. ``base=False``: only
    ``levels``' groups (``by_stage`` and ``by_workload`` None), whose percentiles cost a
    selection of their own (the report's Summary reads neither)."""
    run_dir = Path(run_dir)
    if slo is None:
        slo = read_meta(run_dir).slo
    slo = slo_map({c: s.model_dump() if hasattr(s, "model_dump") else s
                   for c, s in (slo or {}).items()})
    tmp = settings.temp_directory or tempfile.mkdtemp(prefix="kvbench-duckdb-")
    con = connect(settings, tmp)
    try:
        columns = list(dict.fromkeys([*STAGE_KEYS, "status", *D.inputs(
            [*_FLAGS, *(LATENCIES[m] for m in SCALARS)])]))
        _records(con, run_dir, columns)
        _views(con, slo)
        counts = _counts(con)
        levels = {**({"by_stage": STAGE_KEYS, "by_workload": WORKLOAD_KEYS} if base else {}),
                  **{name: tuple(keys) for name, keys in (levels or {}).items()}}
        qs = list(quantiles.values())
        picked: dict[str, dict] = {lvl: {} for lvl in levels}
        for lvl, got in _scalars(con, levels, qs).items():
            picked[lvl].update(got)
        for lvl, got in _itl(run_dir, levels, qs, on_batch, batch_columns, tmp).items():
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
    return Aggregates(by_stage=frames.pop("by_stage", None),
                      by_workload=frames.pop("by_workload", None),
                      extra=frames)


# --------------------------------------------------------------------------- stage figures

# per (STAGE_KEYS) group: the extremes of its times (float64 ns, as the request frame takes
# them: ``frame._stage_walls``) and the sums the rates and means divide
_TIMES = {
    "first_sched": "min(CAST(t_scheduled AS DOUBLE))",
    "last_sched": "max(CAST(t_scheduled AS DOUBLE))",
    "last_end": "max(CAST(t_sent AS DOUBLE) + coalesce(CAST(e2e_ns AS DOUBLE), 0))",
    "first_sent": "min(CAST(t_sent AS DOUBLE)) FILTER (WHERE t_sent > 0)",
    "last_done": "max(CAST(t_sent AS DOUBLE) + coalesce(CAST(e2e_ns AS DOUBLE), 0)) "
                 "FILTER (WHERE t_sent > 0 AND NOT {cancelled})",
    "last_token": "max(CAST(t_sent AS DOUBLE) + CAST(ttft_ns AS DOUBLE)) "
                  "FILTER (WHERE t_sent > 0 AND {ok} AND ttft_ns IS NOT NULL)",
}
_SUMS = ("finished", "has_slo", "hit_counted")  # counted beside aggregate's COUNTS


def stage_figures(run_dir: Path | str, slo: Mapping | None = None, *,
                  settings: Settings = Settings()) -> pd.DataFrame:
    """Per (endpoint, workload, request_class, stage): the times a stage's windows are made of
    (``_TIMES``: float64 ns on the master's clock, NaN where no row has one), the counts of ``_SUMS``, the token sums
    of successful requests (``ok_prompt_tokens``, ``ok_completion_tokens``), those of the
    prefix hit ratio (``hit_cached_tokens``, ``hit_prompt_tokens``), and per latency of
    ``SCALARS`` and lateness its ``<m>_sum`` and ``<m>_count`` (the mean's terms): one DuckDB
    aggregate over the scalar columns, nothing per request kept."""
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    if slo is None:
        slo = meta.slo
    slo = slo_map({c: s.model_dump() if hasattr(s, "model_dump") else s
                   for c, s in (slo or {}).items()})
    # each worker's send times on the master's clock, as the request frame takes them
    # (``core.compact.align_worker_clocks``)
    shifts = {str(w): int(o) for w, o in (meta.worker_clock_offsets_ns or {}).items()
              if int(o)}
    shift = ("" if not shifts else " + CASE worker " + " ".join(
        f"WHEN {_lit(w)} THEN {o}" for w, o in shifts.items()) + " ELSE 0 END")
    defs = ["ok", "cancelled", *_SUMS, "prompt_tokens", "completion_tokens", "cached_tokens",
            *(LATENCIES[m] for m in SCALARS)]
    columns = list(dict.fromkeys([*STAGE_KEYS, "t_scheduled", "t_sent", "ttft_ns", "e2e_ns",
                                  "worker", *D.inputs(defs)]))
    tmp = settings.temp_directory or tempfile.mkdtemp(prefix="kvbench-duckdb-")
    con = connect(settings, tmp)
    try:
        _records(con, run_dir, columns)
        per = {d: D.sql(d, slo) for d in defs}
        con.execute(f"CREATE TEMP VIEW fig AS SELECT {', '.join(STAGE_KEYS)}, "
                    f"t_scheduled{shift} AS t_scheduled, t_sent{shift} AS t_sent, ttft_ns, "
                    "e2e_ns, "
                    + ", ".join(f"{e} AS {d}" for d, e in per.items()) + " FROM records")
        aggs = [f"{e.format(ok='ok', cancelled='cancelled')} AS {k}" for k, e in _TIMES.items()]
        aggs += [f"count_if({f}) AS {f}" for f in _SUMS]
        aggs += ["sum(CASE WHEN ok THEN prompt_tokens END) AS ok_prompt_tokens",
                 "sum(CASE WHEN ok THEN completion_tokens END) AS ok_completion_tokens",
                 "sum(CASE WHEN hit_counted THEN cached_tokens END) AS hit_cached_tokens",
                 "sum(CASE WHEN hit_counted THEN prompt_tokens END) AS hit_prompt_tokens"]
        for m in SCALARS:
            aggs += [f"sum({LATENCIES[m]}) AS {m}_sum", f"count({LATENCIES[m]}) AS {m}_count"]
        got = con.execute(f"SELECT {', '.join(STAGE_KEYS)}, {', '.join(aggs)} FROM fig "
                          "GROUP BY ALL").fetch_df()
    finally:
        con.close()
        if settings.temp_directory is None:
            shutil.rmtree(tmp, ignore_errors=True)
    for c in got.columns:
        if c not in STAGE_KEYS:
            got[c] = got[c].astype(np.float64)
    return got.sort_values(list(STAGE_KEYS)).reset_index(drop=True)
