"""Compaction: a run's live shards folded into one Parquet file per table, each request start
left without a record (its process was killed) made a ``cancelled`` record; and the tables of a
finished run read whole (``load_results``), every worker's clock aligned to the master's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbench.core.checks import check_requests, records_source
from kvbench.core.contract import RunMeta
from kvbench.core.rows import START_COLUMNS, shard_files, write_failed
from kvbench.core.runjson import read_meta
from kvbench.core.schema import REQUESTS, TABLES
from kvbench.core.shards import STARTS, _conform, _shard_batches, read_table

KILLED_IN_FLIGHT = "in flight when the load process was killed"


def compact(run_dir: Path | str, table: str, remove_shards: bool = True) -> int:
    """Merge ``<table>-*`` shards (``.arrows`` and ``.rows``, and an existing parquet) into
    ``<table>.parquet``; for requests, each start with no record (its process was killed)
    becomes a ``cancelled`` record (``unfinished_starts``) and the start shards go too. The
    shards are removed only once the parquet file is whole in place: a write that fails (the
    disk is full) removes its partial file, keeps every shard and raises ``DiskFull``."""
    run_dir = Path(run_dir)
    table_files = shard_files(run_dir, table)
    start_files = shard_files(run_dir, "starts") if table == "requests" else []
    if not table_files and not start_files:
        return 0
    t = read_table(run_dir, table)
    if start_files:
        lost = unfinished_starts(run_dir, t)
        if lost.num_rows:
            t = pa.concat_tables([t, lost])
    tmp = run_dir / f"{table}.parquet.tmp"
    try:
        pq.write_table(t, tmp, compression="zstd")
        os.replace(tmp, run_dir / f"{table}.parquet")
    except OSError as exc:  # pyarrow's IO errors are OSErrors, with the errno
        tmp.unlink(missing_ok=True)
        raise write_failed(run_dir, exc) from None
    if remove_shards:
        for s in table_files + start_files:
            s.unlink(missing_ok=True)
    return t.num_rows


def read_starts(run_dir: Path | str) -> pa.Table:
    """Every request start the load processes of a run wrote (complete batches)."""
    batches = [_conform(b, STARTS, None, shard, "starts")
               for shard, b in _shard_batches(Path(run_dir), "starts")]
    return pa.Table.from_batches(batches, schema=STARTS) if batches else STARTS.empty_table()


def unfinished_starts(run_dir: Path | str, records: pa.Table) -> pa.Table:
    """Requests records of the starts that have no record in ``records`` (same worker and
    request id): ``cancelled`` with their send times and ``KILLED_IN_FLIGHT``."""
    starts = read_starts(run_dir)
    if starts.num_rows == 0:
        return REQUESTS.empty_table()
    def keyed(t: pa.Table) -> pa.Table:  # a null worker (a hand-made shard) matches null
        return t.append_column("_w", pc.fill_null(t.column("worker"), ""))

    done = keyed(records.select(["worker", "request_id"])).drop_columns(["worker"])
    starts = keyed(starts).join(done, ["_w", "request_id"], join_type="left anti")
    starts = starts.drop_columns(["_w"])
    starts = starts.combine_chunks()  # one row per start still: (worker, request_id) is unique
    n = starts.num_rows
    cols = []
    for f in REQUESTS:
        if f.name in START_COLUMNS:
            cols.append(starts.column(f.name).cast(f.type))
        elif f.name == "status":
            cols.append(pa.array(["cancelled"] * n, f.type))
        elif f.name == "error":
            cols.append(pa.array([KILLED_IN_FLIGHT] * n, f.type))
        elif pa.types.is_list(f.type):
            cols.append(pa.array([[]] * n, f.type))
        else:
            cols.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(cols, schema=REQUESTS)


@dataclass
class Results:
    path: Path
    meta: RunMeta
    tables: dict[str, pa.Table] = field(default_factory=dict)

    @property
    def requests(self) -> pa.Table:
        return self.tables["requests"]


def load_results(path: Path | str) -> Results:
    """Read one run directory: run.json plus every table (parquet, then live shards); records
    that cannot be true are a ``DataError`` (``core.checks``)."""
    run_dir = Path(path)
    meta = read_meta(run_dir)
    tables = {name: read_table(run_dir, name, strict=True) for name in TABLES}
    check_requests(tables["requests"], records_source(run_dir))  # impossible records: an error
    tables["requests"] = align_worker_clocks(tables["requests"], meta.worker_clock_offsets_ns)
    return Results(run_dir, meta, tables)


ALIGNED = ("t_scheduled", "t_sent")  # epoch ns read on the sending worker's clock


def align_worker_clocks(requests: pa.Table, offsets_ns: dict | None) -> pa.Table:
    """``requests`` with each worker's ``t_scheduled`` and ``t_sent`` moved onto the master's
    clock (run.json ``worker_clock_offsets_ns``: ns to add, by worker name); workers without
    an offset (or of offset 0) are left as written."""
    offsets = {w: int(o) for w, o in (offsets_ns or {}).items() if int(o)}
    if not offsets or requests.num_rows == 0:
        return requests
    workers = requests.column("worker")
    shift = pc.fill_null(pc.cast(pc.index_in(workers, pa.array(list(offsets))), pa.int64()), -1)
    table = pa.array([0] + list(offsets.values()), pa.int64())
    add = pc.take(table, pc.add(shift, 1))
    for name in ALIGNED:
        i = requests.schema.get_field_index(name)
        col = requests.column(i)
        requests = requests.set_column(i, requests.field(i),
                                       pc.add(col, add).cast(col.type))
    return requests
