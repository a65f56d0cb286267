"""What a load process needs of the results store, without pyarrow (issue 13: pyarrow and its
compute kernels are about 38 MB of a load process's memory; it writes its records with this
module and the readers convert them to Arrow).

A load process writes its records as ``<table>-<host>-<pid>[-<tag>].rows``: a msgpack stream
whose first object is a header, ``{"kvbench_rows": 1, "table": ..., "columns": [...]}``, and each
following object one batch, a list of column lists in the header's column order (values as
Python gives them: ints, floats, strings, None, lists). The file is flushed after each batch,
so a killed process keeps every complete batch; ``kvbench.core.store`` reads it up to the last
one, typed by ``kvbench.core.schema``, the one place with the columns' types.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import msgpack

from kvbench.core.contract import ProcMeta

ROWS_VERSION = 1  # the header's "kvbench_rows"
ROWS_SUFFIX = ".rows"

# The columns of kvbench.core.schema.REQUESTS, in its order (tests/test_rows.py holds them
# equal): the order of a record's values in the load process.
REQUEST_COLUMNS = (
    "run_id", "endpoint", "topology", "workload", "request_class", "stage", "request_id",
    "session_id", "turn", "worker", "prompt_tokens", "prompt_tokens_client",
    "shared_prefix_tokens", "max_tokens", "completion_tokens", "completion_tokens_client",
    "cached_tokens", "t_scheduled", "t_sent", "connect_ns", "ttft_ns", "chunk_offsets_ns",
    "chunk_tokens", "e2e_ns", "status", "http_status", "error", "server_queue_ns",
    "server_prefill_ns", "server_kv_transfer_ns", "server_first_decode_ns", "server_replica",
    "server_region", "retry_after_s", "server_request_id")

# A request's start, written as it is sent (``starts-<host>-<pid>.rows``): the columns of
# REQUESTS known before the response. ``store.compact`` turns a start with no record into a
# ``cancelled`` record, so a killed load process leaves a trace of what it had in flight.
START_COLUMNS = ("run_id", "endpoint", "topology", "workload", "request_class", "stage",
                 "request_id", "session_id", "turn", "worker", "prompt_tokens_client",
                 "shared_prefix_tokens", "max_tokens", "t_scheduled", "t_sent")

COLUMNS = {"requests": REQUEST_COLUMNS, "starts": START_COLUMNS}


def new_run_id(suite: str = "default") -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{suite}-{os.getpid() % 10000:04d}"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def shard_stem(host: str | None = None, pid: int | None = None) -> str:
    """``<host>-<pid>`` with the host made file-name safe: one shard per process and table."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", host or socket.gethostname())
    return f"{host}-{pid or os.getpid()}"


def write_proc_meta(run_dir: Path | str, meta: ProcMeta, stem: str | None = None) -> Path:
    """A load process's sidecar ``proc-<host>-<pid>.json`` (counts, stages, incomplete), read
    by whoever finalizes the run; ``stem``: another process's (a master writing the sidecar a
    worker sent it)."""
    path = Path(run_dir) / f"proc-{stem or shard_stem()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta.to_dict(), indent=1, default=str))
    os.replace(tmp, path)
    return path


SHARD_SUFFIXES = (".arrows", ROWS_SUFFIX)  # collectors and older runs write Arrow IPC shards


def shard_path(run_dir: Path | str, table: str, suffix: str, tag: str | None = None) -> Path:
    """This process's shard of ``table``: ``<run_dir>/<table>-<host>-<pid>[-<tag>]<suffix>``
    (both shard writers name their files here)."""
    stem = f"{table}-{shard_stem()}" + (f"-{tag}" if tag else "")
    return Path(run_dir) / f"{stem}{suffix}"


def shard_files(folder: Path | str, table: str = "*", recursive: bool = False) -> list[Path]:
    """The live shards of ``table`` (every table: ``*``) in ``folder``, of either format."""
    folder = Path(folder)
    find = folder.rglob if recursive else folder.glob
    return sorted(p for suffix in SHARD_SUFFIXES for p in find(f"{table}-*{suffix}"))


def header(table: str, columns: Sequence[str]) -> dict:
    return {"kvbench_rows": ROWS_VERSION, "table": table, "columns": list(columns)}


def _plain(value):
    """msgpack's hook for what it cannot pack: numpy scalars and arrays (a workload's counts
    may be numpy integers) as the Python values they hold."""
    for attr in ("tolist", "item"):
        if hasattr(value, attr):
            return getattr(value, attr)()
    raise TypeError(f"a record value of type {type(value).__name__} cannot be written")


def pack_batch(cols: Sequence[Sequence]) -> bytes:
    """One batch as the stream holds it: its column lists, packed."""
    return msgpack.packb(cols, default=_plain)


def pack(table: str, columns: Sequence[str], cols: Sequence[Sequence]) -> bytes:
    """A whole rows stream of one batch (what a worker sends its master)."""
    return msgpack.packb(header(table, columns)) + pack_batch(cols)


def header_problem(head, table: str | None = None) -> str | None:
    """Why ``head`` is not the header of a rows stream (of ``table``), or None."""
    if not isinstance(head, dict) or head.get("kvbench_rows") is None:
        return "not a kvbench rows stream (it starts with no kvbench_rows header)"
    if head.get("kvbench_rows") != ROWS_VERSION:
        return (f"a kvbench rows stream of version {head.get('kvbench_rows')!r}, this kvbench "
                f"reads version {ROWS_VERSION}")
    cols = head.get("columns")
    if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols) or not cols:
        return "a kvbench rows stream whose header has no list of column names"
    if len(set(cols)) != len(cols):
        return "a kvbench rows stream whose header names a column twice"
    if table is not None and head.get("table") != table:
        return f"a rows stream of table {head.get('table')!r}, not of {table}"
    return None


def batch_problem(batch, ncols: int) -> str | None:
    """Why ``batch`` is not one batch of ``ncols`` columns of equal length, or None."""
    if not isinstance(batch, list) or len(batch) != ncols:
        return f"a batch that is not a list of its {ncols} columns"
    if not all(isinstance(c, list) for c in batch) or len({len(c) for c in batch}) > 1:
        return "a batch whose columns are not lists of one length"
    return None


def starts_with_map(first: bytes) -> bool:
    """Whether a stream's first byte opens a msgpack map, as a rows header does."""
    return bool(first) and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF))


def unpacker(source=None) -> msgpack.Unpacker:
    """A reader of rows streams (a file, or bytes fed to it): batches of any size."""
    return msgpack.Unpacker(source, max_buffer_size=0, read_size=1 << 20)


class RowShardWriter:
    """The load process's writer of table shards, with ``store.ShardWriter``'s contract:
    appends batches (column lists) to ``<run_dir>/<table>-<host>-<pid>[-<tag>].rows``,
    flushed after each batch, so a killed process keeps every complete batch. Thread-safe;
    the file and its header are created with the first batch (or by ``open``)."""

    def __init__(self, run_dir: Path | str, table: str, tag: str | None = None,
                 columns: Sequence[str] | None = None) -> None:
        self.table = table
        self.columns = tuple(columns if columns is not None else COLUMNS[table])
        self.path = shard_path(run_dir, table, ROWS_SUFFIX, tag)
        self._lock = threading.Lock()
        self._fh = None
        self.rows = 0
        self.closed = False

    def open(self) -> None:
        """Create the shard now (a header alone is a valid, readable shard)."""
        with self._lock:
            self._open()

    def _open(self) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "ab")
            if self._fh.tell() == 0:
                self._fh.write(msgpack.packb(header(self.table, self.columns)))
                self._fh.flush()

    def write(self, cols: Sequence[Sequence] | None) -> int:
        """Append one batch (its columns in ``columns`` order); returns the rows written."""
        if not cols or not len(cols[0]):
            return 0
        if len(cols) != len(self.columns):
            raise ValueError(f"{len(cols)} columns given, the {self.table} shard has "
                             f"{len(self.columns)}")
        return self.write_packed(pack_batch(cols), len(cols[0]))

    def write_packed(self, data: bytes, rows: int) -> int:
        """Append a batch already packed (``pack_batch``) of ``rows`` rows."""
        with self._lock:
            if self.closed:
                return 0
            self._open()
            self._fh.write(data)
            self._fh.flush()
            self.rows += rows
        return rows

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self._fh is not None:
                self._fh.close()
                self._fh = None


class RowTail:
    """One ``.rows`` shard read as it grows, without pyarrow: ``batches`` yields the batches
    completed since the last read (column lists in ``columns`` order, the header's); a batch
    cut at the end (a kill, or a write under way) waits for the next read. The store's Arrow
    readers (``core.shards``: ``scan``, ``ShardTail``) and the live view read shards through
    it. A file that is not a rows stream (of ``table``) is a ``DataError`` naming it."""

    def __init__(self, path: Path | str, table: str | None = None) -> None:
        self.path, self.table = Path(path), table
        self.columns: list[str] | None = None  # the header's, once read
        self.offset = 0  # bytes read: the header and every complete batch

    def read(self) -> list[list[list]]:
        return list(self.batches())

    def batches(self) -> Iterator[list[list]]:
        from kvbench.core.errors import DataError

        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            if self.columns is None:
                first = fh.read(1)
                if not first:
                    return  # a process that wrote nothing (yet)
                fh.seek(0)
            reader, base = unpacker(fh), self.offset
            if self.columns is None:
                try:
                    head = next(reader) if starts_with_map(first) else None
                except StopIteration:
                    return  # the header is being written (or a kill cut it): no records yet
                except _UNPACK_ERRORS:
                    head = None
                problem = header_problem(head, self.table)
                if problem:
                    raise DataError(f"{self.path}: {problem}; remove it or restore the run's "
                                    "own file")
                self.columns, self.offset = head["columns"], reader.tell()
            while True:
                try:
                    batch = next(reader)
                except StopIteration:
                    return  # the end, or a batch cut by a kill: everything before it is kept
                except _UNPACK_ERRORS as exc:
                    raise DataError(f"{self.path}: damaged after its first "
                                    f"{base + reader.tell()} bytes ({exc}); restore the run's "
                                    "own file, or remove it") from None
                problem = batch_problem(batch, len(self.columns))
                if problem:
                    raise DataError(f"{self.path}: {problem}; the file is damaged: restore the "
                                    "run's own file, or remove it")
                self.offset = base + reader.tell()
                yield batch

    def dicts(self) -> list[dict[str, list]]:
        """The new batches as ``{column: list}``, as the record sink hands them to its taps."""
        return [dict(zip(self.columns, b)) for b in self.batches()]


_UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException)
