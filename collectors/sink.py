"""Where collectors put their rows: columnar buffers turned into Arrow record batches, written
by the store's ``ShardWriter`` to ``<table>-<host>-<pid>.arrows`` shards. A write that fails
(the disk is full) is no collector's error: the shard keeps what it had, later samples are
dropped, and the failure is the process's (``kvbench.core.rows.write_failure``), whose driver
stops the run."""

from __future__ import annotations

import pyarrow as pa

from kvbench.core.errors import DiskFull
from kvbench.core.store import ShardWriter


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


class ShardSink(ShardWriter):
    """The store's one shard writer, as collectors' threads call it: a failed write is noted
    (``failed``, and for the process) and returns 0, never an exception in a sampling
    thread."""

    def write(self, batch: pa.RecordBatch | None) -> int:
        try:
            return super().write(batch)
        except DiskFull:
            return 0
