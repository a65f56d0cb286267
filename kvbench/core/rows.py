"""What a load process needs of the results store, without pyarrow (issue 13: pyarrow and its
compute kernels are about 38 MB of a load process's memory; it writes its records with this
module and the readers convert them to Arrow).
(Over 400 lines, kept whole: the writer, its rotation into parts and the reader of the rows
stream share one framing, whole batches, which a failed write must leave readable.)

A load process writes its records as ``<table>-<host>-<pid>[-<tag>].rows``: a msgpack stream
whose first object is a header, ``{"kvbench_rows": 1, "table": ..., "columns": [...]}``, and each
following object one batch, a list of column lists in the header's column order (values as
Python gives them: ints, floats, strings, None, lists). The file is flushed after each batch,
so a killed process keeps every complete batch; ``kvbench.core.store`` reads it up to the last
one, typed by ``kvbench.core.schema``, the one place with the columns' types.

A write that fails (the disk is full) is cut back to the last complete batch and ends the
shard: it raises ``DiskFull``, one sentence naming the run's folder, and is noted for the whole
process (``note_write_failure``), so that whoever drives the load stops it at the first failed
write (issue 33).
"""

from __future__ import annotations

import errno
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
from kvbench.core.errors import DiskFull

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
    "server_region", "retry_after_s", "server_request_id", "streamed", "parent_session_id",
    "subagent_index")

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
    worker sent it). A failed write (``DiskFull``) leaves the last sidecar as it was."""
    path = Path(run_dir) / f"proc-{stem or shard_stem()}.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(meta.to_dict(), indent=1, default=str))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_failed(run_dir, exc) from None
    return path


# --------------------------------------------------------------------------- a failed write

_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG)
_failures: dict[Path, DiskFull] = {}  # folder -> this process's first failed write in it
_listeners: list = []
_failure_lock = threading.Lock()


def write_failed(folder: Path | str, exc: OSError) -> DiskFull:
    """The error of a write of a run's results in ``folder`` that failed with ``exc`` (one
    sentence, naming the folder; "disk full" when the disk is), noted for the process."""
    if isinstance(exc, DiskFull):
        return exc
    what = (f"disk full: {folder} has no space left" if exc.errno in _FULL
            else f"cannot write to {folder}")
    why = exc.strerror or str(exc)
    if exc.errno and "[errno" in why:  # pyarrow's wording: "Error writing bytes ... [errno 28]"
        why = os.strerror(exc.errno)
    err = DiskFull(f"{what} ({why}); every record written before the failed write is kept: "
                   f"free space, then run kvbench recover {folder}")
    err.folder, err.errno = Path(folder), exc.errno
    return note_write_failure(err)


def note_write_failure(err: DiskFull) -> DiskFull:
    """Note a failed write in ``err.folder`` for the whole process and tell the listeners
    (``on_write_failure``), once a folder; they run on the thread that failed and must return
    fast. Returns the folder's first failure."""
    key = Path(err.folder).absolute()
    with _failure_lock:
        if key in _failures:
            return _failures[key]
        _failures[key] = err
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(err)
        except Exception:  # noqa: BLE001 - the failure is noted; a listener's bug is not it
            pass
    return err


def write_failure(folder: Path | str | None = None) -> DiskFull | None:
    """This process's first failed write of a run's results (in ``folder`` or below it), or
    None."""
    with _failure_lock:
        noted = list(_failures.items())
    if folder is None:
        return noted[0][1] if noted else None
    top = Path(folder).absolute()
    return next((e for f, e in noted if f == top or top in f.parents), None)


def on_write_failure(listener) -> None:
    """Call ``listener(err)`` at each folder's first failed write in this process (at once
    for those already noted)."""
    with _failure_lock:
        if listener not in _listeners:
            _listeners.append(listener)
        noted = list(_failures.values())
    for err in noted:
        listener(err)


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to the file open at ``fd`` (``O_APPEND``) whole, or not at all: a
    write that fails part way is cut back, so the file ends at its last complete batch."""
    start = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise


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


PART = re.compile(r"^(?P<base>.+)-p(?P<k>[1-9][0-9]*)$")  # a later part of a rotated shard


def part_path(path: Path, k: int) -> Path:
    """Part ``k`` of the shard whose first part is ``path``: ``<stem>-p<k><suffix>`` (part 0
    is ``path`` itself)."""
    return path if k == 0 else path.with_name(f"{path.stem}-p{k}{path.suffix}")


def sealed(path: Path | str) -> bool:
    """Whether a shard part is complete while its process goes on: its writer has moved on to
    the next part (``RowShardWriter.rotate``), so nothing more is appended to it."""
    path = Path(path)
    m = PART.match(path.stem)
    first, k = (path.with_name(m["base"] + path.suffix), int(m["k"])) if m else (path, 0)
    return part_path(first, k + 1).exists()


class RowShardWriter:
    """The load process's writer of table shards, with ``store.ShardWriter``'s contract:
    appends batches (column lists) to ``<run_dir>/<table>-<host>-<pid>[-<tag>].rows``,
    each written whole to the file (no buffer), so a killed process keeps every complete
    batch. A write that fails is cut back to the last complete batch, raises ``DiskFull`` and
    ends the shard (``failed``; later writes are dropped). Thread-safe; the file and its
    header are created with the first batch (or by ``open``). ``rotate`` ends the file and
    goes on in the next part, ``...-p<k>.rows`` (a soak's shard stays a bounded file: the
    store reads every part, and an uploader may copy a part once ``sealed``)."""

    def __init__(self, run_dir: Path | str, table: str, tag: str | None = None,
                 columns: Sequence[str] | None = None) -> None:
        self.table = table
        self.columns = tuple(columns if columns is not None else COLUMNS[table])
        self.first = self.path = shard_path(run_dir, table, ROWS_SUFFIX, tag)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.rows = 0
        self.part = 0  # the part written now (0: ``first``)
        self.bytes = 0  # bytes appended to the part written now (this process's)
        self.closed = False
        self.failed: DiskFull | None = None

    def open(self) -> None:
        """Create the shard now (a header alone is a valid, readable shard)."""
        with self._lock:
            self._guarded(self._open)

    def _open(self) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if os.fstat(self._fd).st_size == 0:
                append_whole(self._fd, msgpack.packb(header(self.table, self.columns)))

    def _guarded(self, step) -> None:
        """``step()``; a failed write ends the shard and raises ``DiskFull``."""
        try:
            step()
        except OSError as exc:
            self.failed = write_failed(self.path.parent, exc)
            self.closed = True
            self._close_fd()
            raise self.failed from None

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

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

            def append() -> None:
                self._open()
                append_whole(self._fd, data)
            self._guarded(append)
            self.rows += rows
            self.bytes += len(data)
        return rows

    def rotate(self) -> Path:
        """End the part being written (it is complete: ``sealed`` once the next part exists)
        and write what follows to the next one, created now with its header. Returns the
        part that ended."""
        with self._lock:
            ended = self.path
            if self.closed or self._fd is None:
                return ended
            self._close_fd()
            self.part += 1
            self.path, self.bytes = part_path(self.first, self.part), 0
            self._guarded(self._open)
            return ended

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._close_fd()


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
