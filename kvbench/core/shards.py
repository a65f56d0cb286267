"""A run's tables on disk, read and written: the collectors' Arrow shard writer, the one reader
of every table (``scan``: parquet, then live shards, conformed to the schema), and the
incremental reader of growing shards (``ShardTail``).
(Over 400 lines, kept whole: the writer and the readers of the Arrow shards share one framing,
whole batches, which a failed write must leave readable.)
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from kvbench.core import rows
from kvbench.core.errors import DataError, DiskFull
from kvbench.core.layout import partition_of, table_files
from kvbench.core.rows import START_COLUMNS, shard_files
from kvbench.core.schema import REQUESTS, SCHEMA_VERSION, STATUSES, TABLES

STARTS = pa.schema([REQUESTS.field(n) for n in START_COLUMNS])  # rows.START_COLUMNS, typed
SHARD_SCHEMAS = {**TABLES, "starts": STARTS}


# --------------------------------------------------------------------------- writing tables


class _Pending:
    """The file-like sink an Arrow IPC writer writes into: its bytes wait here until the
    writer has written one whole message, then go to the file in one append."""

    closed = False

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data) -> int:
        self.data += data
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


class ShardWriter:
    """The writer of Arrow table shards (collectors, OTLP spans): appends record batches to
    ``<run_dir>/<table>-<host>-<pid>[-<tag>].arrows``, an Arrow IPC stream each of whose
    batches goes to the file whole, so a killed process keeps every complete batch (``scan``
    reads up to the last). A write that fails (the disk is full) is cut back to the last
    complete batch, raises ``DiskFull`` (noted for the process: ``rows.write_failure``) and
    ends the shard (``failed``; later batches are dropped). Thread-safe; the file is created
    with the first batch (or by ``open``)."""

    def __init__(self, run_dir: Path | str, table: str, tag: str | None = None) -> None:
        self.schema = SHARD_SCHEMAS[table]
        self.path = rows.shard_path(run_dir, table, ".arrows", tag)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pending = _Pending()
        self._writer = None
        self.rows = 0
        self.closed = False
        self.failed: DiskFull | None = None

    def open(self) -> None:
        """Create the shard now (an empty stream is a valid, readable shard)."""
        with self._lock:
            if not self.closed:
                self._guarded(self._open)

    def _open(self) -> None:
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._writer = ipc.new_stream(self._pending, self.schema)
            rows.append_whole(self._fd, self._pending.take())

    def _guarded(self, step) -> None:
        """``step()``; a failed write ends the shard and raises ``DiskFull``."""
        try:
            step()
        except OSError as exc:
            self.failed = rows.write_failed(self.path.parent, exc)
            self._end(write_eos=False)
            raise self.failed from None

    def write(self, batch: pa.RecordBatch | None) -> int:
        """Append one batch (cast to the table's schema); returns the rows written."""
        if batch is None or batch.num_rows == 0:
            return 0
        if batch.schema != self.schema:
            batch = batch.cast(self.schema)
        with self._lock:
            if self.closed:
                return 0

            def append() -> None:
                self._open()
                self._writer.write_batch(batch)
                rows.append_whole(self._fd, self._pending.take())
            self._guarded(append)
            self.rows += batch.num_rows
        return batch.num_rows

    def _end(self, write_eos: bool) -> None:
        self.closed = True
        if self._writer is not None:
            try:
                self._writer.close()  # its end-of-stream marker, into the pending bytes
                if write_eos and self._fd is not None:
                    rows.append_whole(self._fd, self._pending.take())
            except OSError:
                pass  # a stream without its end marker reads the same
            self._writer = None
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def close(self) -> None:
        with self._lock:
            if not self.closed or self._fd is not None:
                self._end(write_eos=self.failed is None)


# --------------------------------------------------------------------------- reading tables


# Columns without which a file is not that table at all (older files may lack later columns,
# which read as nulls).
REQUIRED = {"requests": ("endpoint", "status", "t_scheduled", "t_sent"),
            "gpu": ("t_ns",),
            "engine": ("t_ns", "endpoint", "metric", "value")}
# Columns every finished record of a table has (checked by ``scan(strict=True)``).
NOT_NULL = {"requests": ("endpoint", "status"), "gpu": ("t_ns",), "engine": ("t_ns", "metric")}
_IPC_MARKER = b"\xff\xff\xff\xff"  # every Arrow IPC stream message starts with it


def _compatible(have: pa.DataType, want: pa.DataType) -> bool:
    """True when a column written as ``have`` reads as ``want`` without changing meaning: the
    same type, integers of another width, integers or floats as floats, string widths and
    dictionaries of strings, lists of compatible values, or an all-null column."""
    t = pa.types
    if have == want or t.is_null(have):
        return True
    if t.is_dictionary(have):
        return _compatible(have.value_type, want)
    if t.is_integer(want):
        return t.is_integer(have)
    if t.is_floating(want):
        return t.is_integer(have) or t.is_floating(have)
    if t.is_string(want) or t.is_large_string(want):
        return t.is_string(have) or t.is_large_string(have)
    if t.is_list(want) or t.is_large_list(want):
        return (t.is_list(have) or t.is_large_list(have)) and _compatible(
            have.value_type, want.value_type)
    return False


def check_schema(have: pa.Schema, table: str, path: Path) -> None:
    """Raise a ``DataError`` naming ``path`` when a file's schema is not one of ``table``'s:
    a required column missing, or a column of a type that does not read as the schema's."""
    schema = SHARD_SCHEMAS[table]
    missing = [c for c in REQUIRED.get(table, ()) if c not in have.names]
    if missing:
        cols = ", ".join(have.names[:6]) + (", ..." if len(have.names) > 6 else "")
        raise DataError(f"{path}: not a {table} table of schema v{SCHEMA_VERSION} (no column "
                        f"{', '.join(missing)}; it has {cols or 'no columns'}); remove it or "
                        "restore the run's own file")
    for f in have:
        if f.name in schema.names and not _compatible(f.type, schema.field(f.name).type):
            raise DataError(f"{path}: column {f.name} is {f.type}, the {table} schema has "
                            f"{schema.field(f.name).type}; the file was not written by "
                            "kvbench, or is damaged: restore the run's own file")


def _conform(batch: pa.RecordBatch, schema: pa.Schema, columns: Sequence[str] | None,
             path: Path | None = None, table: str = "", strict: bool = False
             ) -> pa.RecordBatch:
    """``batch`` with the schema's types and ``columns`` (missing ones as nulls); a value
    that does not read as its column's type is a ``DataError`` naming ``path``, and so is,
    when ``strict``, a null where every finished record has a value or an unknown status."""
    names = list(columns) if columns is not None else schema.names
    arrays = []
    for name in names:
        typ = schema.field(name).type
        i = batch.schema.get_field_index(name)
        if i < 0:
            arrays.append(pa.nulls(batch.num_rows, typ))
            continue
        try:
            col = batch.column(i).cast(typ)
        except (pa.ArrowException, ValueError) as exc:
            raise DataError(f"{path}: column {name} does not read as {typ} "
                            f"({str(exc).splitlines()[0]}); restore the run's own file") from None
        if strict and name in NOT_NULL.get(table, ()) and col.null_count:
            raise DataError(f"{path}: {col.null_count} record(s) without a {name}, which every "
                            f"{table} record has; the file is damaged: restore the run's own "
                            "file")
        if strict and table == "requests" and name == "status":
            bad = pc.filter(col, pc.invert(pc.is_in(col, pa.array(STATUSES))))
            if len(bad):
                raise DataError(f"{path}: status {bad[0].as_py()!r} is not one of "
                                f"{', '.join(STATUSES)}; the file is damaged or of another "
                                "kvbench version")
        arrays.append(col)
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema([schema.field(n) for n in names]))


def _shard_batches(run_dir: Path, table: str, files: Sequence[Path] | None = None
                   ) -> Iterator[tuple[Path, pa.RecordBatch]]:
    """Every complete batch of every ``<table>-*`` shard (``.arrows``: Arrow IPC, written by
    the collectors and older runs; ``.rows``: a load process's msgpack rows, ``core.rows``),
    with its file (a killed writer loses only its unfinished batch; an empty file is a process
    that wrote nothing). A file that is not a stream of its kind, or one of another table or
    schema, is a ``DataError``. ``files``: these shards only."""
    for shard in shard_files(run_dir, table) if files is None else files:
        try:
            if shard.suffix == rows.ROWS_SUFFIX:
                for batch in _rows_batches(shard, table):
                    yield shard, batch
            else:
                for batch in _arrows_batches(shard, table):
                    yield shard, batch
        except OSError as exc:
            raise DataError(f"{shard}: cannot be read ({exc.strerror or exc}); check its "
                            "permissions or remove it") from None


def _arrows_batches(shard: Path, table: str) -> Iterator[pa.RecordBatch]:
    with open(shard, "rb") as fh:
        head = fh.read(4)
        if not head:
            return
        if head != _IPC_MARKER:
            raise DataError(f"{shard}: not an Arrow IPC stream (a {table} shard starts "
                            "with one); remove it or restore the run's own file")
        fh.seek(0)
        try:
            reader = ipc.open_stream(fh)
        except (pa.ArrowInvalid, OSError):
            return  # killed while writing the schema: no records in it
        check_schema(reader.schema, table, shard)
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError):
                break  # truncated mid-batch: keep what was read
            try:
                batch.validate(full=True)
            except pa.ArrowInvalid:
                break  # a batch cut or damaged at the end: keep what was read
            yield batch


def _rows_batches(shard: Path, table: str) -> Iterator[pa.RecordBatch]:
    """The batches of a ``.rows`` shard as record batches (``_RowsReader``)."""
    yield from _RowsReader(shard, table).read()


class _RowsReader:
    """A ``.rows`` shard's batches (``rows.RowTail``) as record batches of the header's
    columns that the table has, typed by its schema (columns it does not know are left out,
    as in an Arrow shard); a value that does not read as its type is a ``DataError``."""

    def __init__(self, shard: Path, table: str) -> None:
        self.tail = rows.RowTail(shard, table)
        self.shard, self.table = shard, table
        self.known: list | None = None  # (index in the header, field) of the known columns
        self.schema: pa.Schema | None = None

    def read(self) -> Iterator[pa.RecordBatch]:
        for batch in self.tail.batches():
            yield self._arrow(batch)
        self._typed()  # a header alone is still checked

    def _typed(self) -> None:
        if self.known is None and self.tail.columns is not None:
            schema = SHARD_SCHEMAS[self.table]
            self.known = [(i, schema.field(n)) for i, n in enumerate(self.tail.columns)
                          if n in schema.names]
            self.schema = pa.schema([f for _, f in self.known])
            check_schema(self.schema, self.table, self.shard)

    def _arrow(self, batch: list) -> pa.RecordBatch:
        self._typed()
        arrays = []
        for i, f in self.known:
            try:
                arrays.append(pa.array(batch[i], type=f.type))
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                raise DataError(f"{self.shard}: column {f.name} does not read as {f.type} "
                                f"({str(exc).splitlines()[0][:160]}); restore the run's own "
                                "file") from None
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


class _ArrowsTail:
    """An Arrow IPC stream shard read as it grows (message by message from where the last
    read stopped: a partial last message is left for the next read)."""

    def __init__(self, shard: Path, table: str) -> None:
        self.shard, self.table = shard, table
        self.offset = 0
        self.schema: pa.Schema | None = None

    def read(self) -> list[pa.RecordBatch]:
        with open(self.shard, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        if self.offset == 0 and len(data) >= 4 and data[:4] != _IPC_MARKER:
            raise DataError(f"{self.shard}: not an Arrow IPC stream (a {self.table} shard "
                            "starts with one); remove it or restore the run's own file")
        src = pa.BufferReader(data)
        out, pos = [], 0
        while pos < len(data):
            try:
                msg = ipc.read_message(src)
            except (pa.ArrowInvalid, EOFError, OSError, StopIteration):
                break  # cut mid-message: the rest waits for the next read
            if msg is None:
                break
            if msg.type == "schema":
                self.schema = ipc.read_schema(msg)
                check_schema(self.schema, self.table, self.shard)
            elif msg.type == "record batch" and self.schema is not None:
                batch = ipc.read_record_batch(msg, self.schema)
                try:
                    batch.validate(full=True)
                except pa.ArrowInvalid:
                    break  # a batch cut or damaged at the end
                out.append(batch)
            pos = src.tell()
        self.offset += pos
        return out


class ShardTail:
    """One table's live shards, read as they grow: each read parses only the batches
    completed since the last (a running capacity search reads its records every half second;
    reading every shard whole each time made a poll's cost grow with the run: the search's
    own process went from 8% to 36% of a core over 80 s of a ground-truth search), ``.rows``
    shards through ``rows.RowTail``. ``new`` returns what came since the last read (the live
    view's collector figures), ``read`` every record so far (``columns``, conformed as
    ``scan`` does), never a parquet file."""

    def __init__(self, run_dir: Path | str, table: str,
                 columns: Sequence[str] | None = None) -> None:
        self.run_dir, self.table, self.columns = Path(run_dir), table, columns
        self.shards: dict[Path, _RowsReader | _ArrowsTail] = {}  # every shard seen
        self._batches: list[pa.RecordBatch] = []

    def new(self) -> list[pa.RecordBatch]:
        schema = SHARD_SCHEMAS[self.table]
        out = []
        for shard in shard_files(self.run_dir, self.table):
            reader = self.shards.get(shard)
            if reader is None:
                reader = self.shards[shard] = (_RowsReader if shard.suffix == rows.ROWS_SUFFIX
                                               else _ArrowsTail)(shard, self.table)
            try:
                got = list(reader.read())
            except OSError as exc:
                raise DataError(f"{shard}: cannot be read ({exc.strerror or exc}); check its "
                                "permissions or remove it") from None
            out += [_conform(b, schema, self.columns, shard, self.table, False) for b in got]
        self._batches += out
        return out

    def read(self) -> pa.Table:
        self.new()
        if self._batches:
            return pa.Table.from_batches(self._batches)
        empty = SHARD_SCHEMAS[self.table].empty_table()
        return empty.select(list(self.columns)) if self.columns is not None else empty


def _parquet_batches(pfile: Path, table: str, read_cols: Sequence[str] | None,
                     batch_size: int, parts: dict | None = None) -> Iterator[pa.RecordBatch]:
    """Record batches of a table's parquet file (``parts``: the partition columns its folders
    name, added as columns); a file that is not Parquet, is cut short, damaged or of another
    schema is a ``DataError`` naming it."""
    def damaged(exc: Exception) -> DataError:
        size = pfile.stat().st_size if pfile.exists() else 0
        what = ("empty (0 bytes)" if size == 0 else
                f"not a readable Parquet file ({str(exc).splitlines()[0][:160]})")
        return DataError(f"{pfile}: {what}; the run's {table} records cannot be read: restore "
                         "the file or rerun the run")
    parts = parts or {}
    try:
        pf = pq.ParquetFile(pfile)
        have = pf.schema_arrow
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise damaged(exc) from None
    for k in parts:
        if k not in have.names:
            have = have.append(pa.field(k, pa.string()))
    check_schema(have, table, pfile)
    want = list(read_cols or TABLES[table].names)
    read = [c for c in want if c in have.names and c not in parts]
    try:
        for batch in pf.iter_batches(batch_size=batch_size, columns=read):
            for k, v in parts.items():
                if k in want:
                    batch = batch.append_column(k, pa.repeat(pa.scalar(v, pa.string()), batch.num_rows))
            yield batch
    except (pa.ArrowException, OSError, ValueError, IndexError, EOFError) as exc:
        raise damaged(exc) from None


def scan(run_dir: Path | str, table: str, columns: Sequence[str] | None = None,
         batch_size: int = 65_536, parquet: bool = True,
         shards: bool = True, strict: bool = False) -> Iterator[pa.RecordBatch]:
    """The one reader of a run's tables: record batches of its compacted files
    (``layout.table_files``: the partitioned dataset, or a layout-1 ``<table>.parquet``), then
    of its live shards, each conformed to schema v1 (``columns`` only, missing columns of
    older files as nulls). A damaged file is a ``DataError`` naming it; ``strict`` (readers of
    finished runs: reports, the gate) also refuses records without the values every finished
    record has (``NOT_NULL``) and unknown statuses."""
    run_dir = Path(run_dir)
    schema = TABLES[table]
    if columns is not None:
        unknown = [c for c in columns if c not in schema.names]
        if unknown:
            raise ValueError(f"{table} has no column(s) {unknown}")
    for pfile in table_files(run_dir, table) if parquet else ():
        parts = partition_of(pfile, run_dir / table) if pfile.parent != run_dir else None
        for batch in _parquet_batches(pfile, table, columns, batch_size, parts):
            yield _conform(batch, schema, columns, pfile, table, strict)
    if shards:
        for shard, batch in _shard_batches(run_dir, table):
            yield _conform(batch, schema, columns, shard, table, strict)


def read_table(run_dir: Path | str, table: str, columns: Sequence[str] | None = None,
               **kw) -> pa.Table:
    """One table of a run (``scan`` gathered): compacted files plus any live shards."""
    schema = TABLES[table]
    batches = list(scan(run_dir, table, columns, **kw))
    if batches:
        return pa.Table.from_batches(batches)
    empty = schema.empty_table()
    return empty.select(list(columns)) if columns is not None else empty


def read_shards(run_dir: Path | str, table: str) -> pa.Table:
    """The live shards of a table only (not its parquet)."""
    return read_table(run_dir, table, parquet=False)


