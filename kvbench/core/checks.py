"""Checks that a run's request records could be true, before any figure is drawn from them.

A record that cannot be true (a time before its own start, chunks out of order, an end before
its first token, a streamed answer with tokens but no time to first token, the same request
twice) is a data error, not a sample: a report or a gate built on it would state something
false (a negated TTFT "passes"; every row written twice "passes" on half the noise). The
readers of finished runs (``core.compact.load_results``: the gate; ``reports.measures.data``:
the report) call ``check_requests`` on each run's records, and the report's chunk stream calls
``chunk_problems`` per batch, so the checks cost one vectorised pass (pyarrow and numpy; no
loop over rows).

What is *not* a problem: a null TTFT on a request that carried no token-carrying chunk (an
``ok`` answer of zero tokens, a failed request), or on one sent without streaming (``streamed``
false: a trace's non-streaming request, whose answer is one JSON body with no first token to
time), and a request id that repeats on another worker (each load process numbers its own
requests, with a ``#pass`` suffix). A TTFT or chunks on a request sent without streaming, and an
``ok`` streamed answer of tokens without a TTFT, are problems (``streamed`` null, in runs written
before the column, is left to the chunk check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.core.errors import DataError
from kvbench.core.layout import table_files

# Offsets from t_sent (monotonic) and epoch times: none can be negative.
NON_NEGATIVE = ("t_scheduled", "t_sent", "connect_ns", "ttft_ns", "e2e_ns", "server_queue_ns",
                "server_prefill_ns", "server_kv_transfer_ns", "server_first_decode_ns")

Problems = dict[tuple[str, str], int]  # (column, what is wrong) -> rows


def _count(mask) -> int:
    n = pc.sum(mask).as_py() if not isinstance(mask, np.ndarray) else int(mask.sum())
    return int(n or 0)


def _has(t, name: str) -> bool:
    return name in t.schema.names


def scalar_problems(t: pa.Table | pa.RecordBatch) -> Problems:
    """Impossible values among the scalar columns ``t`` holds (absent columns are skipped)."""
    out: Problems = {}
    for name in NON_NEGATIVE:
        if _has(t, name):
            col = t.column(name)
            if col.null_count < len(col):
                n = _count(pc.less(col, 0))
                if n:
                    out[(name, "negative")] = n
    if _has(t, "ttft_ns") and _has(t, "e2e_ns"):
        n = _count(pc.less(t.column("e2e_ns"), t.column("ttft_ns")))
        if n:
            out[("e2e_ns", "shorter than its ttft_ns")] = n
    if _has(t, "streamed"):
        out.update(_stream_problems(t))
    if _has(t, "request_id") and _has(t, "worker") and t.num_rows > 1:
        n = _duplicates(t)
        if n:
            out[("request_id", "repeated on the same worker")] = n
    return out


def _stream_problems(t) -> Problems:
    """What ``streamed`` rules out: a TTFT (or chunks) on a request sent without streaming,
    and no TTFT on an ``ok`` streamed answer whose server counted tokens."""
    out: Problems = {}
    streamed = t.column("streamed")
    if streamed.null_count == len(streamed):
        return out
    plain = pc.fill_null(pc.invert(streamed), False)
    if _has(t, "ttft_ns"):
        n = _count(pc.and_(plain, pc.is_valid(t.column("ttft_ns"))))
        if n:
            out[("ttft_ns", "set on a request sent without streaming")] = n
    if _has(t, "chunk_offsets_ns"):
        chunks = pc.fill_null(pc.list_value_length(t.column("chunk_offsets_ns")), 0)
        n = _count(pc.and_(plain, pc.greater(chunks, 0)))
        if n:
            out[("chunk_offsets_ns", "set on a request sent without streaming")] = n
    if _has(t, "ttft_ns") and _has(t, "status") and _has(t, "completion_tokens"):
        ok = pc.fill_null(pc.equal(t.column("status"), "ok"), False)
        tokens = pc.fill_null(pc.greater(t.column("completion_tokens"), 0), False)
        n = _count(pc.and_(pc.and_(pc.fill_null(streamed, False), ok),
                           pc.and_(tokens, pc.is_null(t.column("ttft_ns")))))
        if n:
            out[("ttft_ns", "null on an ok streamed answer that has tokens")] = n
    return out


def _duplicates(t) -> int:
    """Rows whose (worker, request_id) an earlier row already had (null ids are skipped)."""
    ids = t.column("request_id")
    keep = pc.is_valid(ids)
    sub = pa.table({"w": pc.fill_null(t.column("worker"), ""), "r": ids})
    if ids.null_count:
        sub = sub.filter(keep)
    groups = sub.group_by(["w", "r"]).aggregate([])
    return sub.num_rows - groups.num_rows


def chunk_problems(offsets: pa.Array | pa.ChunkedArray, status=None, ttft=None) -> Problems:
    """Impossible chunk offsets (negative, or out of order within a request), and, given the
    records' ``status`` and ``ttft_ns``, an ``ok`` request with chunks but no TTFT."""
    out: Problems = {}
    if isinstance(offsets, pa.ChunkedArray):
        offsets = offsets.combine_chunks() if offsets.num_chunks != 1 else offsets.chunk(0)
    n_rows = len(offsets)
    if n_rows == 0:
        return out
    lengths = pc.fill_null(pc.list_value_length(offsets), 0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(offsets)
    if len(flat):
        values = flat.to_numpy(zero_copy_only=False)
        if flat.null_count:
            values = pc.fill_null(flat, 0).to_numpy(zero_copy_only=False)
        parent = pc.list_parent_indices(offsets).to_numpy(zero_copy_only=False)
        neg = values < 0
        if neg.any():
            out[("chunk_offsets_ns", "negative")] = len(np.unique(parent[neg]))
        back = np.flatnonzero(values[1:] < values[:-1]) + 1
        if len(back):
            same = parent[back] == parent[back - 1]  # not across two requests
            if same.any():
                out[("chunk_offsets_ns", "out of order")] = len(np.unique(parent[back[same]]))
    if status is not None and ttft is not None:
        streamed = lengths > 0
        if streamed.any():
            ok = pc.fill_null(pc.equal(status, "ok"), False).to_numpy(zero_copy_only=False)
            no_ttft = pc.is_null(ttft).to_numpy(zero_copy_only=False)
            n = int((streamed & ok & no_ttft).sum())
            if n:
                out[("ttft_ns", "null on an ok streamed request")] = n
    return out


def merge(parts: Iterable[Problems]) -> Problems:
    out: Problems = {}
    for p in parts:
        for k, n in p.items():
            out[k] = out.get(k, 0) + n
    return out


def raise_problems(problems: Problems, source: Path | str) -> None:
    """One sentence naming ``source``, the first problem's column and its rows (and how many
    other problems there are)."""
    if not problems:
        return
    (col, what), n = next(iter(problems.items()))
    more = len(problems) - 1
    rows = f"{n} record{'s' * (n != 1)}"
    raise DataError(f"{source}: {rows} whose {col} is {what}, which no measured request can "
                    f"have{f' ({more} more kind(s) of impossible record)' if more else ''}; the "
                    "records are damaged or were edited: restore the run's own files or rerun "
                    "the run")


def check_requests(t: pa.Table, source: Path | str) -> None:
    """Raise a ``DataError`` naming ``source`` when any record of ``t`` cannot be true."""
    problems = scalar_problems(t)
    if _has(t, "chunk_offsets_ns"):
        problems = merge([problems, chunk_problems(
            t.column("chunk_offsets_ns"), t.column("status") if _has(t, "status") else None,
            t.column("ttft_ns") if _has(t, "ttft_ns") else None)])
    raise_problems(problems, source)


def records_source(run_dir: Path | str) -> Path:
    """What to name for a run's records: its one compacted file when that is all there is
    (a layout-1 ``requests.parquet``, or a dataset of one file), its ``requests`` dataset
    folder when only that is, else the results directory (compacted files and live shards
    read together)."""
    run_dir = Path(run_dir)
    files = table_files(run_dir, "requests")
    if any(run_dir.glob("requests-*")) or not files:
        return run_dir
    if len(files) == 1:
        return files[0]
    return run_dir / "requests" if all(f.parent != run_dir for f in files) else run_dir
