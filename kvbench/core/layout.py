"""The compacted layout of a run's tables (layout 2, run.json ``layout``): what any engine
(DuckDB, Spark, Trino, pyarrow) can query without kvbench.

* ``<run>/requests/endpoint=<e>/workload=<w>/part-<n>.parquet``: a Hive-partitioned Parquet
  dataset; the partition columns are in the folder names only (values percent-encoded, a null
  as ``__HIVE_DEFAULT_PARTITION__``), every other column (``run_id`` too) in the files; rows
  sorted by ``t_sent`` within a file and files numbered in ``t_sent`` order, row groups of
  ``ROW_GROUP_ROWS`` rows, zstd, statistics on, so a time filter skips row groups and files;
* ``<run>/<table>.parquet`` for the small tables (gpu, engine, spans) and for requests of
  layout 1 (older runs), which still read.

``DatasetWriter`` writes a partitioned table from a stream of record batches in bounded memory:
batches are routed to one spill file per partition (row groups sorted by ``t_sent``), then each
partition is cut into ``t_sent`` ranges of about ``FILE_BYTES`` of rows, each read back (row
groups pruned by their statistics), sorted and written as one file. The whole dataset is
written under a temporary folder and renamed into place once every file is whole.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import quote, unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbench.core.schema import TABLES

LAYOUT = 2  # run.json ``layout``: 1 one ``<table>.parquet`` per table; 2 this module's
PARTITIONED = {"requests": ("endpoint", "workload")}  # tables written as a Hive dataset
SORT_KEY = "t_sent"
ROW_GROUP_ROWS = 131_072
FILE_BYTES = 192 << 20  # in-memory Arrow bytes of one output file's rows (sorted whole)
SPILL_BYTES = 128 << 20  # rows buffered before the largest partition's spill is written
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_SAMPLE_EVERY = 64  # one t_sent in this many kept from each spilled row group (file bounds)


def encode(value: str | None) -> str:
    """A partition value as a folder name segment (Hive: percent-encoded, null spelled out)."""
    return HIVE_NULL if value is None else quote(value, safe="")


def decode(segment: str) -> str | None:
    return None if segment == HIVE_NULL else unquote(segment)


def partition_of(path: Path, root: Path) -> dict[str, str | None]:
    """The ``key=value`` folders between ``root`` and ``path``, decoded."""
    out = {}
    for seg in path.relative_to(root).parts[:-1]:
        key, _, value = seg.partition("=")
        out[key] = decode(value)
    return out


def _part_key(path: Path) -> tuple:
    stem = path.stem.rpartition("-")[2]
    return (str(path.parent), int(stem) if stem.isdigit() else -1, path.name)


def table_files(run_dir: Path | str, table: str) -> list[Path]:
    """The compacted files of ``table`` in a run: its dataset's ``part-<n>.parquet`` files
    (partition by partition, in ``t_sent`` order), then a layout-1 ``<table>.parquet``."""
    run_dir = Path(run_dir)
    root = run_dir / table
    files = sorted(root.rglob("part-*.parquet"), key=_part_key) if root.is_dir() else []
    single = run_dir / f"{table}.parquet"
    return files + ([single] if single.exists() else [])


def dataset(run_dir: Path | str, table: str) -> "pyarrow.dataset.Dataset":
    """The compacted ``table`` of a run as one pyarrow dataset of the table's schema (the
    partition columns restored as strings from the folder names), of either layout."""
    # imported here: pyarrow.dataset is about 43 MB of a process's memory, and compaction
    # (which a plain Locust process runs at its end) never needs it
    import pyarrow.dataset as ds

    run_dir = Path(run_dir)
    schema = TABLES[table]
    keys = PARTITIONED.get(table, ())
    parts = []
    files = [str(f) for f in table_files(run_dir, table) if f.parent != run_dir]
    if files:
        hive = ds.partitioning(pa.schema([(k, pa.string()) for k in keys]), flavor="hive")
        parts.append(ds.dataset(files, schema=schema, format="parquet", partitioning=hive,
                                partition_base_dir=str(run_dir / table)))
    single = run_dir / f"{table}.parquet"
    if single.exists():
        parts.append(ds.dataset(str(single), schema=schema, format="parquet"))
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return ds.dataset(schema.empty_table())
    return ds.dataset(parts)


class DatasetWriter:
    """A partitioned table written from batches in bounded memory (module docstring): ``add``
    every batch (the table's schema), then ``finish`` writes the files under the temporary
    folder and ``commit`` renames the dataset into place; ``abort`` removes what was written.
    Any ``OSError`` (a full disk) leaves the run's other files as they were."""

    def __init__(self, run_dir: Path | str, table: str) -> None:
        self.run_dir, self.table = Path(run_dir), table
        self.keys = PARTITIONED[table]
        self.tmp = self.run_dir / f".{table}.compacting"
        shutil.rmtree(self.tmp, ignore_errors=True)  # a killed compaction's leftovers
        (self.tmp / "spill").mkdir(parents=True)
        schema = TABLES[table]
        self.schema = pa.schema([f for f in schema if f.name not in self.keys])
        self.parts: dict[tuple, _Spill] = {}
        self.buffered = 0
        self.rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self.rows += batch.num_rows
        codes, values = _group_codes(batch, self.keys)
        rest = batch.select(self.schema.names)
        for code in np.unique(codes):
            key = values[code]
            part = self.parts.get(key)
            if part is None:
                part = self.parts[key] = _Spill(self.tmp / "spill" / f"{len(self.parts)}.parquet",
                                                self.schema)
            chunk = rest.filter(pa.array(codes == code)) if len(values) > 1 else rest
            self.buffered += part.add(chunk)
        while self.buffered > SPILL_BYTES:
            self.buffered -= max(self.parts.values(), key=lambda p: p.nbytes).flush()

    def finish(self) -> None:
        """Every partition's spill cut into sorted files under the temporary folder; a
        partition still wholly in memory (never spilled: the usual run) is sorted and written
        as its one file at once, without the spill file's round trip (its copies were most of
        a small run's compaction memory: 95 MB more at the end of a plain Locust run)."""
        out = self.tmp / "out"
        out.mkdir()
        for key, part in self.parts.items():
            folder = out.joinpath(*(f"{k}={encode(v)}" for k, v in zip(self.keys, key)))
            folder.mkdir(parents=True)
            if part.writer is None:
                part.write_whole(folder)
                continue
            part.flush()
            part.close()
            part.write_files(folder)
            part.path.unlink()

    def commit(self) -> None:
        """The new dataset in place of the old one (if any), then the temporary folder gone."""
        final, old = self.run_dir / self.table, self.run_dir / f".{self.table}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(self.tmp / "out", final)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def abort(self) -> None:
        for part in self.parts.values():
            part.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _group_codes(batch: pa.RecordBatch, keys) -> tuple[np.ndarray, list[tuple]]:
    """One code per row for its partition (``values[code]``: the partition's key values)."""
    codes = np.zeros(batch.num_rows, dtype=np.int64)
    uniques = []
    for k in keys:
        enc = pc.dictionary_encode(batch.column(k))
        dic = enc.dictionary.to_pylist() + [None]
        idx = pc.fill_null(enc.indices, len(dic) - 1).to_numpy(zero_copy_only=False)
        codes = codes * len(dic) + idx
        uniques.append(dic)
    values = {}
    for code in np.unique(codes):
        key, c = [], int(code)
        for dic in reversed(uniques):
            key.append(dic[c % len(dic)])
            c //= len(dic)
        values[code] = tuple(reversed(key))
    # renumber densely so callers index a list
    order = sorted(values)
    dense = np.searchsorted(np.array(order), codes)
    return dense, [values[c] for c in order]


def _sorted(t: pa.Table | pa.RecordBatch):
    return t.take(pc.sort_indices(t, [(SORT_KEY, "ascending")]))  # nulls last


class _Spill:
    """One partition's rows on their way: buffered batches, written to its spill file as
    row groups each sorted by ``t_sent``; then cut into the partition's files."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path, self.schema = path, schema
        self.batches: list[pa.RecordBatch] = []
        self.nbytes = 0
        self.rows = 0
        self.bytes_total = 0
        self.samples: list[np.ndarray] = []
        self.writer: pq.ParquetWriter | None = None

    def add(self, batch: pa.RecordBatch) -> int:
        self.batches.append(batch)
        self.nbytes += batch.nbytes
        got = batch.nbytes
        if sum(b.num_rows for b in self.batches) >= ROW_GROUP_ROWS:
            got -= self.flush()
        return got

    def flush(self) -> int:
        if not self.batches:
            return 0
        t = _sorted(pa.Table.from_batches(self.batches, self.schema))
        freed, self.batches, self.nbytes = self.nbytes, [], 0
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, self.schema, compression="lz4",
                                           write_statistics=[SORT_KEY])
        self.writer.write_table(t, row_group_size=t.num_rows)
        self.rows += t.num_rows
        self.bytes_total += t.nbytes
        keys = t.column(SORT_KEY).drop_null().to_numpy()
        self.samples.append(keys[::_SAMPLE_EVERY])
        return freed

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def write_whole(self, folder: Path) -> None:
        """The partition's buffered rows (never spilled), sorted, as ``part-0.parquet``."""
        if not self.batches:
            return
        t = _sorted(pa.Table.from_batches(self.batches, self.schema))
        self.batches, self.nbytes = [], 0
        pq.write_table(t, folder / "part-0.parquet", row_group_size=ROW_GROUP_ROWS,
                       compression="zstd", write_statistics=True)

    def ranges(self) -> list[tuple[int | None, int | None]]:
        """``[lo, hi)`` ``t_sent`` ranges of about ``FILE_BYTES`` of rows each (the first
        also takes the rows without a ``t_sent``)."""
        per_row = max(1, self.bytes_total // max(1, self.rows))
        per_file = max(ROW_GROUP_ROWS, FILE_BYTES // per_row)
        n = -(-self.rows // per_file)
        sample = np.sort(np.concatenate(self.samples)) if self.samples else np.array([])
        if n <= 1 or len(sample) < 2:
            return [(None, None)]
        cuts = np.unique(sample[(np.arange(1, n) * len(sample)) // n])
        edges = [None] + [int(c) for c in cuts] + [None]
        return list(zip(edges[:-1], edges[1:]))

    def write_files(self, folder: Path) -> None:
        if self.rows == 0:
            return
        pf = pq.ParquetFile(self.path)
        col = pf.schema_arrow.get_field_index(SORT_KEY)
        stats = []
        for i in range(pf.metadata.num_row_groups):
            s = pf.metadata.row_group(i).column(col).statistics
            has = s is not None and s.has_min_max
            stats.append((s.min if has else None, s.max if has else None,
                          s is None or s.null_count is None or s.null_count > 0))
        for n, (lo, hi) in enumerate(self.ranges()):
            pieces = []
            for i, (mn, mx, nulls) in enumerate(stats):
                if not ((lo is None and nulls) or (mn is not None and (hi is None or mn < hi)
                                                   and (lo is None or mx >= lo))):
                    continue
                t = pf.read_row_group(i)
                key = t.column(SORT_KEY)
                keep = None
                if lo is not None:
                    keep = pc.greater_equal(key, lo)
                if hi is not None:
                    below = pc.less(key, hi)
                    keep = below if keep is None else pc.and_(keep, below)
                if keep is not None:
                    if lo is None:  # the first range takes the nulls
                        keep = pc.or_kleene(keep, pc.is_null(key))
                    t = t.filter(keep)
                if t.num_rows:
                    pieces.append(t)
            if not pieces:
                continue
            t = _sorted(pa.concat_tables(pieces))
            del pieces
            pq.write_table(t, folder / f"part-{n}.parquet", row_group_size=ROW_GROUP_ROWS,
                           compression="zstd", write_statistics=True)
            del t
