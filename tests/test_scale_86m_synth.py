"""``bench/scale_86m.py``'s fast synthesis (issue 34): one chunk written again and again must
still make a run ``kvbench`` reads as one day: every request id and session unique, each
partition's files in ``t_sent`` order one after the other, exactly the requests asked for, and
run.json's stage per endpoint spanning all the copies."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("scale_86m", ROOT / "bench" / "scale_86m.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("scale_86m", mod)
    spec.loader.exec_module(mod)
    return mod


def test_repeated_chunks_make_one_unique_ordered_run(tmp_path):
    bench = _bench()
    run = tmp_path / "day"
    got = bench.synthesise(run, 100_001, 30_000)  # 3 whole copies and a partial one
    assert got["requests"] == 100_001 and got["copies"] == 4
    t = ds.dataset(run / "requests", partitioning="hive").to_table(
        columns=["endpoint", "request_id", "session_id", "turn", "t_sent", "chunk_offsets_ns"])
    assert t.num_rows == 100_001
    assert pc.count_distinct(t.column("request_id")).as_py() == t.num_rows
    assert got["offsets"] == pc.sum(pc.list_value_length(t.column("chunk_offsets_ns"))).as_py()
    # a session's turns stay within one copy: each session has turns 0.. once each
    per = t.group_by("session_id").aggregate([("turn", "count"), ("turn", "count_distinct")])
    assert per.column("turn_count").equals(per.column("turn_count_distinct"))
    meta = json.loads((run / "run.json").read_text())
    for folder in sorted((run / "requests").glob("endpoint=*/workload=*")):
        files = sorted(folder.glob("part-*.parquet"), key=lambda f: int(f.stem.split("-")[1]))
        sent = np.concatenate([pq.read_table(f, columns=["t_sent"]).column(0).to_numpy()
                               for f in files])
        assert (np.diff(sent) >= 0).all(), folder  # copies follow one another in time
        name = folder.parent.name.split("=", 1)[1]
        stage = next(s for s in meta["stages"] if s["endpoint"] == name)
        assert stage["t_start_ns"] <= sent[0] and sent[-1] <= stage["t_end_ns"]
    # the copies repeat one chunk: the same values, shifted
    ids = t.column("request_id").to_pylist()
    assert any(i.endswith("#c0") for i in ids) and any(i.endswith("#c3") for i in ids)
