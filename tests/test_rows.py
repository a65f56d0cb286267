"""The load process's record shards without pyarrow (``kvbench.core.rows``, issue 13): the column
names equal the schema's, rows written by ``RowShardWriter`` read back through the store exactly,
a batch cut by a kill loses only itself, and a damaged or foreign file is a ``DataError`` naming
it; the distributed master checks a batch before it appends it."""

from __future__ import annotations

import msgpack
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbench.core import rows, store
from kvbench.core.errors import DataError
from kvbench.core.schema import REQUESTS
from kvbench.runs import transport as T

INT = {pa.int32(): (-2**31, 2**31 - 1), pa.int64(): (-2**63, 2**63 - 1)}


def test_column_names_are_the_schemas():
    assert rows.REQUEST_COLUMNS == tuple(REQUESTS.names)
    assert rows.START_COLUMNS == tuple(store.STARTS.names)
    assert set(rows.START_COLUMNS) <= set(REQUESTS.names)
    assert store.START_COLUMNS is rows.START_COLUMNS  # kept importable from the store


def _values(typ: pa.DataType):
    if pa.types.is_list(typ):
        return st.lists(_values(typ.value_type).filter(lambda v: v is not None), max_size=5)
    if pa.types.is_integer(typ):
        lo, hi = INT[typ]
        return st.integers(lo, hi) | st.sampled_from([lo, hi, 0])  # big ints at the edges
    if pa.types.is_floating(typ):
        return st.floats(allow_nan=False)
    if pa.types.is_boolean(typ):
        return st.booleans()
    return st.text(max_size=12)  # unicode, surrogates excluded by hypothesis' text


def _rows_of(schema: pa.Schema):
    return st.fixed_dictionaries({f.name: st.none() | _values(f.type) for f in schema})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(_rows_of(REQUESTS), min_size=1, max_size=6), max_size=4))
def test_rows_read_back_exactly(tmp_path_factory, batches):
    """Random records (None, empty lists, unicode, the integer types' edges) written in batches
    read back through the store's one reader as they were written."""
    run_dir = tmp_path_factory.mktemp("rows")
    w = rows.RowShardWriter(run_dir, "requests")
    w.open()
    for batch in batches:
        assert w.write([[r[c] for r in batch] for c in rows.REQUEST_COLUMNS]) == len(batch)
    w.close()
    want = [r for b in batches for r in b]
    assert w.rows == len(want) and w.path.name.endswith(".rows")
    got = store.read_shards(run_dir, "requests")
    assert got.schema == REQUESTS and got.to_pylist() == want


def _write_three(run_dir, n=4):
    w = rows.RowShardWriter(run_dir, "requests")
    ids = []
    sizes = []
    for b in range(3):
        batch = [[f"r{b}-{i}" if c == "request_id" else "ok" if c == "status" else
                  "e" if c == "endpoint" else 10 * b + i if c in ("t_sent", "t_scheduled") else
                  [1, 2, 3] if c == "chunk_offsets_ns" else None for i in range(n)]
                 for c in rows.REQUEST_COLUMNS]
        w.write(batch)
        sizes.append(w.path.stat().st_size)
        ids.append([f"r{b}-{i}" for i in range(n)])
    w.close()
    return w.path, sizes, ids


def test_a_batch_cut_at_the_end_loses_only_itself(tmp_path):
    path, sizes, ids = _write_three(tmp_path)
    full = path.read_bytes()
    header_end = len(msgpack.packb(rows.header("requests", rows.REQUEST_COLUMNS)))
    for cut in sorted({header_end - 1, header_end, sizes[0] + 1, (sizes[0] + sizes[1]) // 2,
                       sizes[1], sizes[1] + 1, sizes[2] - 1, 1}):
        path.write_bytes(full[:cut])
        got = store.read_shards(tmp_path, "requests").column("request_id").to_pylist()
        complete = sum(1 for s in sizes if s <= cut)
        assert got == [i for b in ids[:complete] for i in b], cut
    path.write_bytes(b"")  # a process that wrote nothing
    assert store.read_shards(tmp_path, "requests").num_rows == 0


def _damaged(tmp_path, data: bytes, name="requests-h-1.rows"):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DataError) as exc:
        store.read_table(tmp_path, "requests")
    path.unlink()
    return str(exc.value)


def test_a_damaged_or_foreign_file_is_named(tmp_path):
    head = msgpack.packb(rows.header("requests", rows.REQUEST_COLUMNS))
    ok_batch = [["x"] if c in ("endpoint", "status") else [1] if c in ("t_sent", "t_scheduled")
                else [None] for c in rows.REQUEST_COLUMNS]
    cases = {
        "garbage": b"not msgpack at all, a text file",
        "random bytes": bytes(range(256)) * 4,
        "another table": msgpack.packb(rows.header("gpu", ["t_ns"])),
        "no header": rows.pack_batch(ok_batch),
        "another version": msgpack.packb({**rows.header("requests", ["endpoint"]),
                                          "kvbench_rows": 99}),
        "no required column": msgpack.packb(rows.header("requests", ["run_id"])),
        "a batch of the wrong shape": head + rows.pack_batch(ok_batch[:3]),
        "columns of two lengths": head + rows.pack_batch([[1, 2]] + ok_batch[1:]),
        "a string where an integer is": head + rows.pack_batch(
            [["x"] if c == "t_sent" else col for c, col in zip(rows.REQUEST_COLUMNS, ok_batch)]),
        "bad bytes after a batch": head + rows.pack_batch(ok_batch) + b"\xc1\xc1",
    }
    for what, data in cases.items():
        msg = _damaged(tmp_path, data)
        assert "requests-h-1.rows" in msg and msg.count("\n") == 0, (what, msg)
    # an unknown column (a newer kvbench's) is left out, as in an Arrow shard
    head = msgpack.packb(rows.header("requests", list(rows.REQUEST_COLUMNS) + ["new"]))
    (tmp_path / "requests-h-1.rows").write_bytes(head + rows.pack_batch(ok_batch + [[{"a": 1}]]))
    assert store.read_table(tmp_path, "requests").num_rows == 1


def test_rows_and_arrow_shards_compact_together_with_the_starts(tmp_path):
    """A load process's rows shards beside an Arrow shard of an older run's process: compaction
    reads both, turns a start with no record into a cancelled record and removes every shard."""
    w = rows.RowShardWriter(tmp_path, "requests")
    n = len(rows.REQUEST_COLUMNS)
    rec = dict.fromkeys(rows.REQUEST_COLUMNS)
    rec.update(endpoint="e", status="ok", worker="h:1", request_id="a", t_sent=2, t_scheduled=1)
    w.write([[rec[c]] for c in rows.REQUEST_COLUMNS])
    w.close()
    old = store.ShardWriter(tmp_path, "requests", tag="old")
    old.write(pa.RecordBatch.from_pylist([{**rec, "request_id": "b"}], schema=REQUESTS))
    old.close()
    s = rows.RowShardWriter(tmp_path, "starts")
    start = {c: rec[c] for c in rows.START_COLUMNS}
    s.write([[start[c], start[c]] if c != "request_id" else ["a", "lost"]
             for c in rows.START_COLUMNS])
    s.close()
    assert len(store.shard_files(tmp_path)) == 3 and n == len(REQUESTS)
    assert store.compact(tmp_path, "requests") == 3
    t = store.read_table(tmp_path, "requests")
    got = sorted(zip(t.column("request_id").to_pylist(), t.column("status").to_pylist()))
    assert got == [("a", "ok"), ("b", "ok"), ("lost", "cancelled")]
    assert not store.shard_files(tmp_path)


def test_numpy_values_are_written_as_python_ones(tmp_path):
    w = rows.RowShardWriter(tmp_path, "starts")
    start = {c: None for c in rows.START_COLUMNS}
    start.update(endpoint="e", request_id="a", max_tokens=np.int64(7), turn=np.int32(2),
                 t_sent=2, t_scheduled=1)
    w.write([[start[c]] for c in rows.START_COLUMNS])
    w.close()
    t = store.read_starts(tmp_path)
    assert t.column("max_tokens").to_pylist() == [7] and t.column("turn").to_pylist() == [2]


def test_the_master_checks_a_batch_before_it_appends_it(tmp_path):
    cols = [["x", "y"] if c != "chunk_offsets_ns" else [[1, 2], []]
            for c in rows.REQUEST_COLUMNS]
    data = T.encode("requests", cols)
    names, packed, n = T.decode("requests", data)
    assert names == list(rows.REQUEST_COLUMNS) and n == 2
    assert msgpack.unpackb(packed) == cols
    head = msgpack.packb(rows.header("requests", rows.REQUEST_COLUMNS))
    bad = {
        "not bytes": cols,
        "of the starts": T.encode("starts", [["x"]] * len(rows.START_COLUMNS)),
        "columns of two lengths": head + rows.pack_batch([["x"]] + cols[1:]),
        "too few columns": head + rows.pack_batch(cols[:-1]),
        "cut": data[:-3],
        "bytes after it": data + b"\x00",
        "no header": rows.pack_batch(cols),
    }
    for what, payload in bad.items():
        with pytest.raises(ValueError):
            T.decode("requests", payload)
        inbox = T.Inbox(tmp_path / what.replace(" ", "_"))
        with pytest.raises(ValueError):
            inbox.receive({"w": "h:1", "seq": 1, "kind": "requests", "data": payload})
        assert not store.shard_files(inbox.run_dir), what  # nothing appended


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.integers(0, 1), st.lists(_rows_of(store.STARTS),
                                                           min_size=1, max_size=4),
                                st.integers(0, 3)), max_size=8))
def test_a_shard_tail_reads_what_the_store_reads_as_the_shards_grow(tmp_path_factory, steps):
    """``store.ShardTail`` (a running search's reader) parses only what was appended since its
    last read, yet each read equals the store's whole read: two processes' shards written in
    turn, a batch half-written when the tail reads (it appears once complete), reads at any
    point."""
    run_dir = tmp_path_factory.mktemp("tail")
    writers = [rows.RowShardWriter(run_dir, "starts", tag=f"p{k}") for k in range(2)]
    tail = store.ShardTail(run_dir, "starts")

    def same():
        got = tail.read()
        want = store.read_starts(run_dir)
        key = sorted(map(str, got.to_pylist())), sorted(map(str, want.to_pylist()))
        assert key[0] == key[1] and got.schema == store.STARTS

    same()
    for k, batch, how in steps:
        cols = [[r[c] for r in batch] for c in rows.START_COLUMNS]
        if how == 0:  # a batch caught half-written, then finished
            data = rows.pack_batch(cols)
            w = writers[k]
            w.write_packed(data[: len(data) // 2], 0)
            same()
            w.write_packed(data[len(data) // 2:], len(batch))
        else:
            writers[k].write(cols)
        if how != 3:
            same()
    same()
    for w in writers:
        w.close()
