"""Per-process request records: columnar buffers on the hot path, Arrow IPC shard in the back.

``append`` costs a list append per column (about 2 us a request). About once a second the
buffers are swapped for empty ones and converted + written on gevent's native thread pool, so
the event loop never stalls on a large batch (per-row tuples stalled it 3 s at 100k requests;
issue 4). The shard ``requests-<host>-<pid>.arrows`` is an append-only Arrow IPC stream:
readable up to its last complete batch if the process dies. Each request's start (the columns
known when it is sent) is buffered the same way and written to ``starts-<host>-<pid>.arrows``, and
the sidecar ``proc-<host>-<pid>.json`` is refreshed with each flush (``closed: false`` until the
sink closes): a SIGKILL loses at most the last flush interval, and compaction turns the starts
left without a record into ``cancelled`` ones (``kvbench.core.store.unfinished_starts``).
"""

from __future__ import annotations

import atexit
import copy
import socket
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from kvbench.core.schema import REQUESTS
from kvbench.core.store import START_COLUMNS, STARTS, ShardWriter, worker_name, write_proc_meta

COLUMNS = tuple(REQUESTS.names)
FLUSH_INTERVAL_S = 0.5  # half the loss bound a kill may cost (one second), for a late loop
# Set by kvbench.loadgen.distributed on a Locust worker whose records go to its master
# (issue 15): given the run directory it names this process's local spool (or None: the sink
# works as before), and receives every batch, sidecar and the close.
FORWARD = None


def _warm_conversion() -> None:
    """Convert a one-row batch of each schema once, unwritten, before any load.

    pyarrow's first ``pa.array`` (and ``pa.scalar``) asks whether its input is a pandas
    object, and to know that imports pandas when it is installed: 0.3 s and +40 MB in a process that never uses pandas,
    done on the writer thread in the first second of a run (the GIL it held paused the loop
    4-17 ms at a time). pandas is hidden from that one check (its import fails, so pyarrow
    records "no pandas" for the check); pyarrow tries the import again whenever something
    really converts to pandas, so nothing that needs pandas loses it."""
    hide = _NoPandas() if "pandas" not in sys.modules else None
    if hide is not None:
        sys.meta_path.insert(0, hide)
    try:
        for schema in (REQUESTS, STARTS):
            pa.RecordBatch.from_arrays([pa.array([None], type=f.type) for f in schema],
                                       schema=schema)
        # a Python scalar in a compute call (the live summary's status == "ok") checks too
        pc.equal(pa.array(["ok"]), pa.scalar("ok"))
    finally:
        if hide is not None:
            sys.meta_path.remove(hide)


class _NoPandas:
    """An import finder that makes ``import pandas`` fail while it is installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("pandas is not used by a load process")
        return None


class RecordSink:
    """One per load process. ``meta`` (counts, stages) goes to ``proc-<host>-<pid>.json``
    beside the shard, for whoever writes run.json: refreshed with each flush, final
    (``closed: true``) when the sink closes."""

    def __init__(self, run_dir: Path | str, *, flush_interval_s: float = FLUSH_INTERVAL_S,
                 use_threadpool: bool = True) -> None:
        self.forward = FORWARD if FORWARD is not None and FORWARD.spool(run_dir) else None
        self.run_dir = Path(self.forward.spool(run_dir) if self.forward else run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._shard = ShardWriter(self.run_dir, "requests")
        self._shard.open()
        self.path = self._shard.path
        self._starts_shard = ShardWriter(self.run_dir, "starts")
        self._starts: list[list] = [[] for _ in START_COLUMNS]
        self.flush_interval_s = flush_interval_s
        self.use_threadpool = use_threadpool
        self._cols: list[list] = [[] for _ in COLUMNS]
        self._lock = threading.Lock()  # one batch at a time (thread pool vs final flush)
        self._pending = None  # the thread-pool flush in progress
        self.taps: list = []  # called with each requests batch written (live.py), any thread
        self._loop = None
        self.closed = False
        self.started = 0  # requests started: the caller counts them with ``begin``
        self.written = 0
        self.meta: dict = {"counts": {"dropped_at_cap": 0}, "stages": [], "incomplete": [],
                           "opened_ns": time.time_ns()}
        self._write_meta(self._snapshot(closed=False))
        _warm_conversion()
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

    def _snapshot(self, closed: bool, started: int | None = None) -> dict:
        """The sidecar as of now (copied: the thread pool writes it while the loop goes on);
        ``started``: the count as of the swap whose rows this sidecar goes with."""
        meta = copy.deepcopy(self.meta)
        meta["counts"]["requests_started"] = self.started if started is None else started
        meta.update(worker=worker_name(), host=socket.gethostname(), closed=closed,
                    updated_ns=time.time_ns())
        return meta

    def _write_meta(self, meta: dict) -> None:
        meta["counts"]["records_written"] = self.written
        if meta["closed"]:
            meta["closed_ns"] = meta["updated_ns"]
        self.meta_path = write_proc_meta(self.run_dir, meta)
        if self.forward is not None:
            self.forward.put("meta", meta)

    def _write(self, cols: list[list] | None, starts: list[list] | None = None,
               meta: dict | None = None) -> int:
        n = 0
        with self._lock:
            if starts is not None:
                b = pa.RecordBatch.from_arrays(
                    [pa.array(c, type=f.type) for c, f in zip(starts, STARTS)], schema=STARTS)
                self._starts_shard.write(b)
                if self.forward is not None:
                    self.forward.put("starts", b)
            if cols is not None:
                b = pa.RecordBatch.from_arrays(
                    [pa.array(c, type=f.type) for c, f in zip(cols, REQUESTS)], schema=REQUESTS)
                n = self._shard.write(b)
                for tap in self.taps:
                    tap(b)
                self.written += n
                if self.forward is not None:
                    self.forward.put("requests", b)
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
            while not self.closed:
                gevent.sleep(self.flush_interval_s)
                if not self.closed:
                    self.flush()

        if self._loop is None:
            self._loop = gevent.spawn(loop)

    def close(self) -> None:
        """Write everything synchronously, end the stream and write the sidecar (idempotent)."""
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
            self._write_meta(self._snapshot(closed=True))
        if self.forward is not None:
            self.forward.close()  # the master acknowledges the rest, or the spool stays

