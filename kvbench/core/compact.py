"""Compaction: a run's live shards folded into its layout-2 files (``core.layout``), streamed
in bounded memory, each request start left without a record (its process was killed) made a
``cancelled`` record; and the tables of a finished run read whole (``load_results``), every
worker's clock aligned to the master's."""

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
from kvbench.core.layout import PARTITIONED, ROW_GROUP_ROWS, DatasetWriter
from kvbench.core.shards import STARTS, _conform, _shard_batches, read_table, scan

KILLED_IN_FLIGHT = "in flight when the load process was killed"


def compact(run_dir: Path | str, table: str, remove_shards: bool = True) -> int:
    """Fold ``<table>-*`` shards (``.arrows`` and ``.rows``) and the table's compacted files
    into its layout-2 files (``core.layout``: a Hive-partitioned dataset for requests, one
    ``<table>.parquet`` for the others), streaming, batch by batch: never the whole table in
    memory. For requests, each start with no record (its process was killed) becomes a
    ``cancelled`` record (``KILLED_IN_FLIGHT``) and the start shards go too. The shards are
    removed only once every new file is whole in place: a write that fails (the disk is full)
    removes what it wrote, keeps every shard and raises ``DiskFull``. Returns the rows."""
    run_dir = Path(run_dir)
    shards = shard_files(run_dir, table)
    start_files = shard_files(run_dir, "starts") if table == "requests" else []
    if not shards and not start_files:
        return 0
    single = run_dir / f"{table}.parquet"
    folded_single = table in PARTITIONED and single.exists()
    try:
        if table in PARTITIONED:
            rows = _compact_dataset(run_dir, table, shards, start_files)
        else:
            rows = _compact_single(run_dir, table)
    except OSError as exc:  # pyarrow's IO errors are OSErrors, with the errno
        raise write_failed(run_dir, exc) from None
    if folded_single:
        single.unlink(missing_ok=True)  # its rows are in the dataset now
    if remove_shards:
        for s in shards + start_files:
            s.unlink(missing_ok=True)
    return rows


def _compact_single(run_dir: Path, table: str) -> int:
    """``<table>.parquet`` rewritten from itself and the shards, batch by batch."""
    tmp = run_dir / f"{table}.parquet.tmp"
    rows = 0
    try:
        with pq.ParquetWriter(tmp, TABLES[table], compression="zstd") as writer:
            for batch in scan(run_dir, table):
                writer.write_batch(batch, row_group_size=ROW_GROUP_ROWS)
                rows += batch.num_rows
        os.replace(tmp, run_dir / f"{table}.parquet")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return rows


def _compact_dataset(run_dir: Path, table: str, shards: list[Path],
                     start_files: list[Path]) -> int:
    """The partitioned dataset rewritten from its compacted files and the shards (records
    and starts of one process read side by side: ``_InFlight``)."""
    writer = DatasetWriter(run_dir, table)
    try:
        for batch in _coalesced(b for b in scan(run_dir, table, shards=False)):
            writer.add(batch)
        inflight = _InFlight()
        starts_of = {_stem(f, "starts"): f for f in start_files}
        paired = [f for f in shards if _stem(f, table) in starts_of]
        for shard in paired:
            recs = _coalesced(_conform(b, REQUESTS, None, p, table)
                              for p, b in _shard_batches(run_dir, table, [shard]))
            st = _coalesced(_conform(b, STARTS, None, p, "starts") for p, b in _shard_batches(
                run_dir, "starts", [starts_of.pop(_stem(shard, table))]))
            for kind, batch in _side_by_side(recs, st):
                if kind == "starts":
                    inflight.started(batch)
                else:
                    writer.add(batch)
                    inflight.recorded(batch)
        for p, b in _shard_batches(run_dir, "starts", list(starts_of.values())):
            inflight.started(_conform(b, STARTS, None, p, "starts"))
        for batch in _coalesced(_conform(b, REQUESTS, None, p, table) for p, b in
                                _shard_batches(run_dir, table,
                                               [f for f in shards if f not in paired])):
            writer.add(batch)
            inflight.recorded(batch, keep=False)
        if inflight.starts is not None and inflight.starts.num_rows and writer.rows:
            for batch in scan(run_dir, table, ["worker", "request_id"], shards=False):
                inflight.recorded(batch, keep=False)
        lost = cancelled_records(inflight.unmatched())
        for batch in lost.to_batches():
            writer.add(batch)
        writer.finish()
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return writer.rows


def _stem(path: Path, table: str) -> str:
    return path.name[len(table) + 1:].rsplit(".", 1)[0]


def _coalesced(batches, rows: int = 65_536):
    """``batches`` joined into batches of about ``rows`` rows (the rows shards' batches are
    small: one per flush of a load process)."""
    pending, n = [], 0
    for b in batches:
        pending.append(b)
        n += b.num_rows
        if n >= rows:
            yield from pa.Table.from_batches(pending).combine_chunks().to_batches()
            pending, n = [], 0
    if pending:
        yield from pa.Table.from_batches(pending).combine_chunks().to_batches()


def _side_by_side(records, starts):
    """("requests" | "starts", batch) from a process's records and starts, each side read on
    while its latest ``t_sent`` is not past the other's: a start is read before its record
    (its ``t_sent`` is not later), so both sides' unmatched rows stay about what was in flight."""
    inf = float("inf")
    r, s = next(records, None), next(starts, None)
    r_t = s_t = -inf
    while r is not None or s is not None:
        if s is not None and (r is None or s_t <= r_t):
            yield "starts", s
            s_t = max(s_t, pc.max(s.column("t_sent")).as_py() or s_t)
            s = next(starts, None)
        else:
            yield "requests", r
            r_t = max(r_t, pc.max(r.column("t_sent")).as_py() or r_t)
            r = next(records, None)


_KEYS = ["_w", "request_id"]


def _keyed(t: pa.Table | pa.RecordBatch, columns=None) -> pa.Table:
    """``t`` (its ``columns``) with ``_w``: the worker, a null one (a hand-made shard) as ''."""
    t = t if isinstance(t, pa.Table) else pa.Table.from_batches([t])
    t = t.select(columns) if columns else t
    return t.append_column("_w", pc.fill_null(t.column("worker"), ""))


def _anti(left: pa.Table, right: pa.Table | None) -> pa.Table:
    if right is None or right.num_rows == 0 or left.num_rows == 0:
        return left
    return left.join(right.select(_KEYS), _KEYS, join_type="left anti")


class _InFlight:
    """Starts and records matched as they are read (same worker and request id): what is
    left unmatched on either side is only what was in flight, not the run."""

    def __init__(self) -> None:
        self.starts: pa.Table | None = None  # starts without a record yet
        self.records: pa.Table | None = None  # keys of records without a start yet

    def started(self, batch: pa.RecordBatch) -> None:
        t = _keyed(batch)
        new, self.records = _anti(t, self.records), (
            _anti(self.records, t) if self.records is not None else None)
        self.starts = new if self.starts is None else pa.concat_tables([self.starts, new])

    def recorded(self, batch: pa.RecordBatch, keep: bool = True) -> None:
        """``keep``: a record whose start is not read yet is kept to match it later."""
        k = _keyed(batch, ["worker", "request_id"]).select(_KEYS)
        early = _anti(k, self.starts) if keep else None
        if self.starts is not None:
            self.starts = _anti(self.starts, k)
        if early is not None and early.num_rows:
            self.records = early if self.records is None else pa.concat_tables(
                [self.records, early])

    def unmatched(self) -> pa.Table:
        if self.starts is None:
            return STARTS.empty_table()
        return self.starts.drop_columns(["_w"]).combine_chunks()


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
    done = _keyed(records, ["worker", "request_id"]).select(_KEYS)
    return cancelled_records(_anti(_keyed(starts), done).drop_columns(["_w"]).combine_chunks())


def cancelled_records(starts: pa.Table) -> pa.Table:
    """One ``cancelled`` requests record (``KILLED_IN_FLIGHT``) per start of ``starts``."""
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
