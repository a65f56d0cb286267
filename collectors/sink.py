"""Where collectors put their rows: columnar buffers turned into Arrow record batches, and a
thread-safe writer of ``<table>-<host>-<pid>.arrows`` shards (Arrow IPC streams)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from kvbench.core.schema import TABLES


class Columns:
    """Rows of one schema kept as one Python list per column until turned into a batch."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema
        self.names = schema.names
        self.cols: dict[str, list] = {n: [] for n in self.names}

    def __len__(self) -> int:
        return len(self.cols[self.names[0]])

    def append(self, row: dict) -> None:
        for n in self.names:
            self.cols[n].append(row.get(n))

    def take_batch(self) -> pa.RecordBatch | None:
        """The buffered rows as one batch (None when empty); the buffer is emptied."""
        if not len(self):
            return None
        arrays = [pa.array(self.cols[f.name], type=f.type) for f in self.schema]
        self.cols = {n: [] for n in self.names}
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


class ShardSink:
    """Appends batches of one table to ``<run_dir>/<table>-<host>-<pid>.arrows``.

    Each batch is flushed to the file as it is written, so a killed run keeps every complete
    batch (``kvbench.store.read_shards`` reads up to the last one).
    """

    def __init__(self, run_dir: Path, table: str, tag: str | None = None):
        self.schema = TABLES[table]
        name = f"{table}-{socket.gethostname()}-{os.getpid()}"
        self.path = Path(run_dir) / (f"{name}-{tag}.arrows" if tag else f"{name}.arrows")
        self._lock = threading.Lock()
        self._fh = None
        self._writer = None
        self.rows = 0
        self.closed = False

    def write(self, batch: pa.RecordBatch | None) -> None:
        if batch is None or batch.num_rows == 0:
            return
        with self._lock:
            if self.closed:
                return
            if self._writer is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "wb")
                self._writer = ipc.new_stream(self._fh, self.schema)
            self._writer.write_batch(batch.cast(self.schema) if batch.schema != self.schema
                                     else batch)
            self._fh.flush()
            self.rows += batch.num_rows

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self._writer is not None:
                self._writer.close()
                self._fh.close()
                self._writer = self._fh = None
