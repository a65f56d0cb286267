"""Layout 2 (issue 34): requests compacted, streaming, into a Hive-partitioned dataset that any
engine reads (here pyarrow.dataset in hive flavour: DuckDB is not required), old single-file
runs still read, unfinished starts still become cancelled records."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from kvbench.core import layout, objstore, store
from kvbench.core.checks import records_source
from kvbench.core.shards import ShardWriter
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

KEYS = [("worker", "ascending"), ("request_id", "ascending")]


def _records():
    shape = RunShape(endpoints=[EndpointShape("a"), EndpointShape("b=c/d")],
                     requests_per_stage=1500, stage_rates_rps=(5.0, 20.0), max_chunks=8)
    t, stages = synth_table(shape)
    # two workers, two workloads: four partitions
    n = t.num_rows
    t = t.set_column(t.schema.get_field_index("worker"), "worker",
                     pa.array([f"h:{i % 2}" for i in range(n)]))
    return t.set_column(t.schema.get_field_index("workload"), "workload",
                        pa.array(["chat" if i % 3 else "rag-1.0" for i in range(n)])), shape, stages


def _shards(run, t, lost=0):
    """``t`` as two processes' shards, records and starts, and ``lost`` starts of each
    process with no record (in flight at a kill)."""
    for w in ("h:0", "h:1"):
        mine = t.filter(pc.equal(t.column("worker"), w))
        tag = w.replace(":", "")
        rec = ShardWriter(run, "requests", tag)
        for b in mine.to_batches(max_chunksize=97):
            rec.write(b)
        rec.close()
        st = ShardWriter(run, "starts", tag)
        starts = mine.select(list(store.START_COLUMNS))
        extra = starts.slice(0, lost)
        extra = extra.set_column(extra.schema.get_field_index("request_id"), "request_id",
                                 pa.array([f"lost-{w}-{i}" for i in range(lost)], pa.string()))
        for b in pa.concat_tables([starts, extra]).to_batches(max_chunksize=131):
            st.write(b)
        st.close()


@pytest.fixture
def small_files(monkeypatch):
    """Row groups, spills and files small enough that 6,000 records make several of each."""
    monkeypatch.setattr(layout, "ROW_GROUP_ROWS", 256)
    monkeypatch.setattr(layout, "SPILL_BYTES", 200_000)
    monkeypatch.setattr(layout, "FILE_BYTES", 300_000)


def test_compaction_writes_a_hive_dataset_any_engine_reads(tmp_path, small_files):
    t, _, _ = _records()
    run = tmp_path / "run"
    _shards(run, t)
    assert store.compact(run, "requests") == t.num_rows
    assert not store.shard_files(run) and not (run / "requests.parquet").exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no work folder left
    folders = sorted(str(p.relative_to(run)) for p in run.glob("requests/*/*"))
    assert folders == ["requests/endpoint=a/workload=chat", "requests/endpoint=a/workload=rag-1.0",
                       "requests/endpoint=b%3Dc%2Fd/workload=chat",
                       "requests/endpoint=b%3Dc%2Fd/workload=rag-1.0"]
    files = store.table_files(run, "requests")
    assert len(files) > 4  # rotated at the size limit: several files per partition
    for f in files:
        pf = pq.ParquetFile(f)
        assert "endpoint" not in pf.schema_arrow.names and "workload" not in pf.schema_arrow.names
        assert "run_id" in pf.schema_arrow.names
        sent = pf.read(columns=["t_sent"]).column("t_sent").to_numpy()
        assert (sent[1:] >= sent[:-1]).all()  # sorted by t_sent within the file
        md = pf.metadata
        assert md.num_row_groups >= 1 and all(
            md.row_group(i).num_rows <= 256 for i in range(md.num_row_groups))
        col = pf.schema_arrow.get_field_index("t_sent")
        for i in range(md.num_row_groups):
            s = md.row_group(i).column(col).statistics
            assert s is not None and s.has_min_max
    # files of a partition are in t_sent order: the last of one before the first of the next
    by_part = {}
    for f in files:
        by_part.setdefault(f.parent, []).append(pq.read_table(f, columns=["t_sent"]))
    for parts in by_part.values():
        for x, y in zip(parts, parts[1:]):
            assert pc.max(x.column(0)).as_py() <= pc.min(y.column(0)).as_py()
    # any engine: pyarrow's dataset, hive flavour, no kvbench
    hive = ds.dataset(run / "requests", format="parquet", partitioning=ds.partitioning(
        pa.schema([("endpoint", pa.string()), ("workload", pa.string())]), flavor="hive"))
    got = hive.to_table().select(t.column_names)
    assert got.sort_by(KEYS).equals(t.sort_by(KEYS))
    # and kvbench's own readers
    assert store.read_table(run, "requests").sort_by(KEYS).equals(t.sort_by(KEYS))
    assert store.dataset(run, "requests").to_table().sort_by(KEYS).equals(t.sort_by(KEYS))
    few = store.read_table(run, "requests", columns=["endpoint", "status"])
    assert few.column_names == ["endpoint", "status"]
    assert sorted(set(few.column("endpoint").to_pylist())) == ["a", "b=c/d"]
    # a time filter prunes: DuckDB/Spark read the same statistics
    mid = pc.min(t.column("t_sent")).as_py() + 60 * 10**9
    assert store.dataset(run, "requests").to_table(
        filter=ds.field("t_sent") < mid).num_rows == pc.sum(
        pc.less(t.column("t_sent"), mid)).as_py()


def test_unfinished_starts_become_cancelled_records(tmp_path, small_files):
    t, _, _ = _records()
    run = tmp_path / "run"
    _shards(run, t, lost=3)
    assert store.compact(run, "requests") == t.num_rows + 6
    got = store.read_table(run, "requests")
    lost = got.filter(pc.fill_null(pc.equal(got.column("error"), store.KILLED_IN_FLIGHT), False))
    assert sorted(lost.column("request_id").to_pylist()) == sorted(
        f"lost-h:{w}-{i}" for w in (0, 1) for i in range(3))
    assert set(lost.column("status").to_pylist()) == {"cancelled"}
    kept = got.filter(pc.invert(pc.fill_null(pc.equal(
        got.column("error"), store.KILLED_IN_FLIGHT), False)))
    assert kept.sort_by(KEYS).equals(t.sort_by(KEYS))  # no finished request made cancelled


def test_compaction_folds_new_shards_into_the_dataset(tmp_path, small_files):
    t, _, _ = _records()
    run = tmp_path / "run"
    half = t.num_rows // 2
    _shards(run, t.slice(0, half))
    store.compact(run, "requests")
    _shards(run, t.slice(half))
    assert store.compact(run, "requests") == t.num_rows
    assert store.read_table(run, "requests").sort_by(KEYS).equals(t.sort_by(KEYS))


def test_old_single_file_runs_still_read(tmp_path):
    t, shape, stages = _records()
    old = write_run(tmp_path / "old", t, run_meta(shape, stages), layout=1)
    new = write_run(tmp_path / "new", t, run_meta(shape, stages))
    assert (old / "requests.parquet").exists() and not (old / "requests").exists()
    assert json.loads((old / "run.json").read_text())["layout"] == 1
    assert json.loads((new / "run.json").read_text())["layout"] == layout.LAYOUT == 2
    for run in (old, new):
        assert store.read_table(run, "requests").sort_by(KEYS).equals(t.sort_by(KEYS))
        assert store.dataset(run, "requests").to_table().sort_by(KEYS).equals(t.sort_by(KEYS))
        assert store.load_results(run).requests.num_rows == t.num_rows
    assert records_source(old) == old / "requests.parquet"
    assert store.table_files(old, "requests") == [old / "requests.parquet"]
    # an old run compacted again (new shards beside it) moves to the new layout
    _shards(old, t.slice(0, 10))
    store.compact(old, "requests")
    assert not (old / "requests.parquet").exists()
    assert store.read_table(old, "requests").num_rows == t.num_rows + 10


def test_the_uploader_mirrors_the_dataset_not_the_work_in_progress(tmp_path):
    t, shape, stages = _records()
    run = write_run(tmp_path / "run", t, run_meta(shape, stages))
    (run / ".requests.compacting" / "spill").mkdir(parents=True)
    (run / ".requests.compacting" / "spill" / "0.parquet").write_bytes(b"half")
    files = objstore.local_files(run)
    assert {f"requests/{f.relative_to(run / 'requests').as_posix()}"
            for f in store.table_files(run, "requests")} <= set(files)
    assert not [r for r in files if r.startswith(".")]
