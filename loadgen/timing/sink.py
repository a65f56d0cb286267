"""Per-process request records: columnar buffers on the hot path, a msgpack rows shard in the
back (no pyarrow in a load process: issue 13).

``append`` costs a list append per column (about 2 us a request). About once a second the
buffers are swapped for empty ones and written on gevent's native thread pool, so the event
loop never stalls on a large batch (per-row tuples stalled it 3 s at 100k requests; issue 4).
The shard ``requests-<host>-<pid>.rows`` (``kvbench.core.rows``) is append-only, each batch its
column lists packed and flushed: readable up to its last complete batch if the process dies.
Each request's start (the columns known when it is sent) is buffered the same way and written
to ``starts-<host>-<pid>.rows``, and the sidecar ``proc-<host>-<pid>.json`` is refreshed with
each flush (``closed: false`` until the sink closes): a SIGKILL loses at most the last flush
interval, and compaction turns the starts left without a record into ``cancelled`` ones
(``kvbench.core.store.unfinished_starts``), converting the rows to Parquet.

A write that fails (the disk is full: issue 33) ends the sink's writing: the shards keep every
complete batch, nothing more is written, and the flush loop hands the ``DiskFull`` error to
``ON_WRITE_FAILURE`` (the Locust hooks stop the load) on the event loop's own greenlet.
"""

from __future__ import annotations

import atexit
import copy
import socket
import threading
import time
from pathlib import Path

from kvbench.core.contract import ProcMeta
from kvbench.core.errors import DiskFull
from kvbench.core.rows import (REQUEST_COLUMNS, START_COLUMNS, RowShardWriter, worker_name,
                               write_proc_meta)

COLUMNS = REQUEST_COLUMNS
FLUSH_INTERVAL_S = 0.5  # half the loss bound a kill may cost (one second), for a late loop
# A requests shard past this size ends and the process goes on in the next part, its starts
# shard with it (``RowShardWriter.rotate``): a soak's shards stay bounded files, each complete
# part can be uploaded while the run goes on (``objstore.Uploader``), and a record's start is
# always in its part or an earlier one, as compaction reads them side by side (issue 34).
ROTATE_BYTES = 256 << 20
# Set by kvbench.loadgen.fleet.distributed on a Locust worker whose records go to its master
# (issue 15): given the run directory it names this process's local spool (or None: the sink
# works as before), and receives every batch (``put(kind, columns)``: the column lists in
# ``kvbench.core.rows.COLUMNS[kind]`` order), sidecar and the close.
FORWARD = None
# Set by kvbench.loadgen.wiring.hooks: called once, on the event loop, with the ``DiskFull``
# error of the sink's first failed write (the load stops); None: the failure is only kept.
ON_WRITE_FAILURE = None


class RecordSink:
    """One per load process. ``meta`` (the sidecar: counts, stages) goes to
    ``proc-<host>-<pid>.json`` beside the shard, for whoever writes run.json: refreshed with
    each flush, final (``closed: true``) when the sink closes."""

    def __init__(self, run_dir: Path | str, *, flush_interval_s: float = FLUSH_INTERVAL_S,
                 use_threadpool: bool = True, rotate_bytes: int = ROTATE_BYTES) -> None:
        self.rotate_bytes = rotate_bytes
        self.forward = FORWARD if FORWARD is not None and FORWARD.spool(run_dir) else None
        self.run_dir = Path(self.forward.spool(run_dir) if self.forward else run_dir)
        self.failure: DiskFull | None = None  # the first failed write: nothing more is written
        self._told = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._shard = RowShardWriter(self.run_dir, "requests")
        self._shard.open()
        self.path = self._shard.path
        self._starts_shard = RowShardWriter(self.run_dir, "starts")
        self._starts: list[list] = [[] for _ in START_COLUMNS]
        self.flush_interval_s = flush_interval_s
        self.use_threadpool = use_threadpool
        self._cols: list[list] = [[] for _ in COLUMNS]
        self._lock = threading.Lock()  # one batch at a time (thread pool vs final flush)
        self._pending = None  # the thread-pool flush in progress
        # called with each requests batch written, as {column name: list of values}
        # (live.py), on any thread
        self.taps: list = []
        self._loop = None
        self.closed = False
        self.started = 0  # requests started: the caller counts them with ``begin``
        self.written = 0
        self.meta = ProcMeta(counts={"dropped_at_cap": 0}, opened_ns=time.time_ns())
        self._write_meta(self._snapshot(closed=False))
        atexit.register(self.close)

    def begin(self, start: tuple | None = None) -> None:
        """A request is being sent; ``start``: its values in ``START_COLUMNS`` order."""
        self.started += 1
        if start is not None:
            for col, v in zip(self._starts, start):
                col.append(v)

    def append(self, row: tuple) -> None:
        """One record, values in ``COLUMNS`` order."""
        for col, v in zip(self._cols, row):
            col.append(v)

    def __len__(self) -> int:
        return len(self._cols[0])

    def _swap(self) -> tuple[list[list] | None, list[list] | None]:
        cols = starts = None
        if self._cols[0]:
            cols, self._cols = self._cols, [[] for _ in COLUMNS]
        if self._starts[0]:
            starts, self._starts = self._starts, [[] for _ in START_COLUMNS]
        return cols, starts

    def _snapshot(self, closed: bool, started: int | None = None) -> ProcMeta:
        """The sidecar as of now (copied: the thread pool writes it while the loop goes on);
        ``started``: the count as of the swap whose rows this sidecar goes with."""
        meta = copy.deepcopy(self.meta)
        meta.counts["requests_started"] = self.started if started is None else started
        meta.worker, meta.host = worker_name(), socket.gethostname()
        meta.closed, meta.updated_ns = closed, time.time_ns()
        return meta

    def _write_meta(self, meta: ProcMeta) -> None:
        meta.counts["records_written"] = self.written
        if meta.closed:
            meta.closed_ns = meta.updated_ns
        self.meta_path = write_proc_meta(self.run_dir, meta)
        if self.forward is not None:
            self.forward.put("meta", meta.to_dict())

    def _write(self, cols: list[list] | None, starts: list[list] | None = None,
               meta: ProcMeta | None = None) -> int:
        """Write one batch of each kind and the sidecar; after a failed write (``failure``),
        nothing: the shards end at their last complete batch."""
        with self._lock:
            if self.failure is not None:
                return 0
            try:
                return self._write_locked(cols, starts, meta)
            except DiskFull as exc:
                self.failure = exc
                return 0

    def _write_locked(self, cols, starts, meta) -> int:
        n = 0
        if starts is not None:
            self._starts_shard.write(starts)
            if self.forward is not None:
                self.forward.put("starts", starts)
        if cols is not None:
            n = self._shard.write(cols)
            if self.taps:
                batch = dict(zip(COLUMNS, cols))
                for tap in self.taps:
                    tap(batch)
            self.written += n
            if self.forward is not None:
                self.forward.put("requests", cols)
            if self._shard.bytes >= self.rotate_bytes:  # between two flushes' batches
                self._shard.rotate()
                self._starts_shard.rotate()
        if meta is not None:
            self._write_meta(meta)
        return n

    def flush(self) -> None:
        """Write what is buffered, and the live sidecar, in the background (gevent thread
        pool) and return at once."""
        if self.closed:
            return
        cols, starts = self._swap()
        started = self.started  # as of the swap: requests begun while we wait are not in it
        if self._pending is not None:
            self._pending.get()  # keep batches in order
        if self.failure is not None:
            self._tell()
            return
        meta = self._snapshot(closed=False, started=started)
        if self.use_threadpool:
            import gevent

            self._pending = gevent.get_hub().threadpool.spawn(self._write, cols, starts, meta)
        else:
            self._write(cols, starts, meta)

    def start(self) -> None:
        """Flush about every ``flush_interval_s`` in a greenlet until closed."""
        import gevent

        def loop():
            while not self.closed and self.failure is None:
                gevent.sleep(self.flush_interval_s)
                if not self.closed:
                    self.flush()

        if self._loop is None:
            self._loop = gevent.spawn(loop)

    def _tell(self) -> None:
        """Hand the first failed write to ``ON_WRITE_FAILURE`` (once, on the event loop)."""
        if self._told or self.failure is None:
            return
        self._told = True
        if ON_WRITE_FAILURE is not None:
            ON_WRITE_FAILURE(self.failure)

    def close(self) -> None:
        """Write everything synchronously, end the stream and write the sidecar (idempotent;
        after a failed write the shards are only closed, as they are on disk)."""
        if self.closed:
            return
        self.closed = True
        if self._loop is not None:
            self._loop.kill(block=False)
        if self._pending is not None:
            try:
                self._pending.get()
            except Exception:  # noqa: BLE001 - the final write below still runs
                pass
            self._pending = None
        cols, starts = self._swap()
        self._write(cols, starts)
        with self._lock:
            self._shard.close()
            self._starts_shard.close()
            if self.failure is None:
                try:
                    self._write_meta(self._snapshot(closed=True))
                except DiskFull as exc:
                    self.failure = exc
        if self.forward is not None:
            self.forward.close()  # the master acknowledges the rest, or the spool stays

