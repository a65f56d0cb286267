"""The report's reader: runs read through the store (parquet, then live shards), one pass, the
ITL gaps of each request aligned with its row."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvbench.core.store import RunMeta, ShardWriter
from kvbench.reports.measures import frame as F
from kvbench.reports.measures.data import load
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run


def expected_gaps(table) -> list[list[float]]:
    """Per request, the gaps (ms) between its chunk offsets; none for a failed request."""
    offs = table.column("chunk_offsets_ns").to_pylist()
    ok = [s == "ok" for s in table.column("status").to_pylist()]
    return [[(b - a) / 1e6 for a, b in zip(x, x[1:])] if k and x else []
            for x, k in zip(offs, ok)]


@pytest.fixture
def shape():
    return RunShape(endpoints=[EndpointShape("ep", error_rate=0.2)], requests_per_stage=300,
                    max_chunks=7)


def test_parquet_then_live_shards_in_one_frame(tmp_path, shape, monkeypatch):
    import kvbench.reports.measures.data as data

    monkeypatch.setattr(data, "BATCH_ROWS", 64)  # several batches, gaps computed per batch
    table, stages = synth_table(shape)
    done, live = table.slice(0, 200), table.slice(200)
    run = write_run(tmp_path / "run", done, run_meta(shape, stages))
    writer = ShardWriter(run, "requests")
    for batch in live.to_batches(max_chunksize=40):
        writer.write(batch)
    writer.close()
    d = load([run])
    assert isinstance(d.runs[0], RunMeta) and d.runs[0].run_id == "synthetic-run"
    assert len(d.frame) == table.num_rows
    want = expected_gaps(table)
    got = d.frame.attrs["itl"]
    for row in (0, 63, 64, 199, 200, 240, table.num_rows - 1):
        assert got.gather(np.array([row])).tolist() == pytest.approx(want[row], abs=1e-3), row
    assert F.itl_values(d.frame).tolist() == pytest.approx(
        [g for x in want for g in x], abs=1e-3)


def test_older_files_without_some_columns(tmp_path, shape):
    table, stages = synth_table(shape)
    old = table.drop_columns(["chunk_offsets_ns", "server_queue_ns", "server_region"])
    run = write_run(tmp_path / "run", table, run_meta(shape, stages), layout=1)
    pq.write_table(old, run / "requests.parquet")
    d = load([run])
    assert len(d.frame) == table.num_rows
    assert len(F.itl_values(d.frame)) == 0
    assert d.frame["server_queue_ms"].isna().all()
    assert (d.frame["server_region"].cat.codes == -1).all()


def test_a_run_with_no_requests_yet(tmp_path, shape):
    _, stages = synth_table(shape)
    run = tmp_path / "run"
    write_run(run, synth_table(shape)[0].slice(0, 0), run_meta(shape, stages), layout=1)
    (run / "requests.parquet").unlink()
    d = load([run])
    assert len(d.frame) == 0 and len(d.frame.attrs["itl"]) == 0
