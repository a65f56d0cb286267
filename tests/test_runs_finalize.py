"""Finalize without Locust: shards already written plus the job (or given metadata) make one
run.json; KV geometry comes through the engine adapters; sidecars are merged."""

import json

import pyarrow as pa

from kvbench.config import parse_config
from kvbench.core import store
from kvbench.core.contract import Incomplete, ProcMeta, StageEntry
from kvbench.core.errors import DataError
from kvbench.core.schema import ENGINE, REQUESTS
from kvbench.runs import finalize as F
from kvbench.runs.job import resolve

CONFIG = {
    "suite": {"name": "fin"},
    "endpoints": [{"name": "e1", "kind": "openai", "url": "http://127.0.0.1:9", "model": "m",
                   "topology": "colocated"}],
    "workloads": {"chat": {"kind": "chat", "requests": 6}},
    "profiles": {"p": {"pacing": "closed", "stages": [{"users": 1, "duration_s": 1}]}},
}


def requests_batch(n: int) -> pa.RecordBatch:
    cols = {f.name: pa.nulls(n, f.type) for f in REQUESTS}
    cols.update({"endpoint": pa.array(["e1"] * n), "workload": pa.array(["chat"] * n),
                 "request_id": pa.array([f"chat-{i}" for i in range(n)]),
                 "t_sent": pa.array(range(1, n + 1), pa.int64()),
                 "status": pa.array(["ok"] * n), "ttft_ns": pa.array([5] * n, pa.int64())})
    return pa.RecordBatch.from_pydict(cols, schema=REQUESTS)


def write_shards(run_dir, n=4, labels=(("block_size", "16"), ("num_gpu_blocks", "100"))):
    w = store.ShardWriter(run_dir, "requests")
    w.write(requests_batch(n))
    w.close()
    e = store.ShardWriter(run_dir, "engine")
    e.write(pa.RecordBatch.from_pydict({
        "t_ns": [1, 1], "endpoint": ["e1", "e1"],
        "metric": ["vllm:cache_config_info", "vllm:num_requests_running"],
        "labels": [list(labels), []], "value": [1.0, 0.0]}, schema=ENGINE))
    e.close()
    store.write_proc_meta(run_dir, ProcMeta.from_dict({
        "counts": {"requests_started": n, "records_written": n, "dropped_at_cap": 0},
        "stages": [{"endpoint": "e1", "workload": "chat", "index": 0, "t_start_ns": 1,
                    "t_end_ns": 9}], "incomplete": [], "host": "h1"}))


def test_finalize_a_job_from_written_shards(tmp_path):
    cfg = parse_config(CONFIG)
    job = resolve(cfg, workload="chat", endpoint="e1", profile="p", run_id="r1",
                  results_dir=tmp_path)
    write_shards(job.run_dir)
    meta = F.finalize(job.run_dir, [job], workloads={"chat": job.build_workload()},
                      started_ns=1)
    assert meta == store.read_meta(job.run_dir)
    assert meta.run_id == "r1" and meta.suite == "fin" and meta.hosts == ["h1"]
    assert meta.counts["records_written"] == 4 and not meta.incomplete
    assert meta.endpoints == [job.endpoint.record()]
    assert meta.config == cfg.public_dump() and meta.workloads["chat"]["requests"] == 6
    assert meta.workloads_sent["e1"]["chat"]
    assert meta.git_commit == F.source_commit() and meta.git_commit  # tests run in a checkout
    assert not store.shard_files(job.run_dir)  # every table compacted


def test_kv_geometry_through_the_engine_adapter(tmp_path):
    write_shards(tmp_path)
    assert F.endpoint_caches(tmp_path) == {"e1": {"block_tokens": 16,
                                                  "capacity_tokens": 1600}}
    other = tmp_path / "bad"
    write_shards(other, labels=(("block_size", "x"),))
    assert F.endpoint_caches(other) == {}


def test_given_metadata_wins_and_missing_sidecars_are_noted(tmp_path):
    write_shards(tmp_path)
    stages = [{"endpoint": "e1", "workload": "chat", "index": 0, "t_start_ns": 5,
               "t_end_ns": 6}]
    meta = F.finalize(tmp_path, meta={"run_id": "syn", "suite": "synthetic", "stages": stages},
                      expected_procs=2)
    assert meta.run_id == "syn" and meta.stages == [StageEntry.from_dict(s) for s in stages]
    assert meta.endpoints == []  # the sidecar recorded no endpoint
    assert any("1 load process" in i.what for i in meta.incomplete)
    assert json.loads((tmp_path / "run.json").read_text())["suite"] == "synthetic"


def test_merge_proc_meta_sums_counts_and_spans_stages():
    a = {"counts": {"requests_started": 2, "records_written": 2},
         "stages": [{"endpoint": "e", "workload": "w", "index": 0, "t_start_ns": 5,
                     "t_end_ns": 9}], "incomplete": [{"what": "x", "why": "y"}]}
    b = {"counts": {"requests_started": 3, "records_written": 1, "dropped_at_cap": 4},
         "stages": [{"endpoint": "e", "workload": "w", "index": 0, "t_start_ns": 3,
                     "t_end_ns": 7}], "incomplete": [{"what": "x", "why": "y"}]}
    m = F.merge_proc_meta([ProcMeta.from_dict(a), ProcMeta.from_dict(b)])
    assert m.counts == {"requests_started": 5, "records_written": 3, "dropped_at_cap": 4}
    assert [(s.t_start_ns, s.t_end_ns) for s in m.stages] == [(3, 9)]
    assert m.incomplete == [Incomplete("x", "y")]


def starts_batch(ids, worker="h:1") -> pa.RecordBatch:
    n = len(ids)
    cols = {f.name: pa.nulls(n, f.type) for f in store.STARTS}
    cols.update({"endpoint": pa.array(["e1"] * n), "workload": pa.array(["chat"] * n),
                 "worker": pa.array([worker] * n), "request_id": pa.array(ids),
                 "t_scheduled": pa.array([100 + i for i in range(n)], pa.int64()),
                 "t_sent": pa.array([200 + i for i in range(n)], pa.int64())})
    return pa.RecordBatch.from_pydict(cols, schema=store.STARTS)


def test_compaction_turns_starts_without_a_record_into_cancelled(tmp_path):
    w = store.ShardWriter(tmp_path, "requests")
    batch = requests_batch(3)
    w.write(batch.set_column(batch.schema.get_field_index("worker"), "worker",
                             pa.array(["h:1"] * 3)))
    w.close()
    s = store.ShardWriter(tmp_path, "starts")
    s.write(starts_batch(["chat-0", "chat-1", "chat-2", "chat-3", "chat-4"]))
    s.write(starts_batch(["chat-0"], worker="h:2"))  # another process's id: no record either
    s.close()
    assert store.compact(tmp_path, "requests") == 6
    t = store.read_table(tmp_path, "requests").to_pydict()
    lost = [(w, r, st, e, ts) for w, r, st, e, ts in zip(
        t["worker"], t["request_id"], t["status"], t["error"], t["t_sent"]) if st != "ok"]
    assert sorted(lost) == [("h:1", "chat-3", "cancelled", store.KILLED_IN_FLIGHT, 203),
                            ("h:1", "chat-4", "cancelled", store.KILLED_IN_FLIGHT, 204),
                            ("h:2", "chat-0", "cancelled", store.KILLED_IN_FLIGHT, 200)]
    assert not store.shard_files(tmp_path)


def test_recover_a_killed_run_from_its_job_file_and_live_sidecar(tmp_path):
    cfg = parse_config(CONFIG)
    job = resolve(cfg, workload="chat", endpoint="e1", profile="p", run_id="k1",
                  results_dir=tmp_path)
    run_dir = job.run_dir
    job.save(run_dir / job.file_name())
    w = store.ShardWriter(run_dir, "requests")
    w.write(requests_batch(2))
    s = store.ShardWriter(run_dir, "starts")
    s.write(starts_batch(["chat-0", "chat-1", "chat-2"], worker=None))
    stage = {"endpoint": "e1", "workload": "chat", "index": 0, "pacing": "closed",
             "duration_s": 1.0, "t_start_ns": 10 ** 9, "t_end_ns": None}
    store.write_proc_meta(run_dir, ProcMeta.from_dict({  # SIGKILLed: its sidecar never closed
        "counts": {"requests_started": 3, "records_written": 2, "dropped_at_cap": 0},
        "stages": [], "open_stage": stage, "incomplete": [], "closed": False,
        "worker": "elsewhere:1", "host": "elsewhere", "opened_ns": 10 ** 9,
        "updated_ns": 10 ** 9 + 4 * 10 ** 8}))
    assert F.recover(run_dir).interrupted
    assert F.recover(run_dir) is None  # run.json there now: nothing more to do
    meta = store.read_meta(run_dir)
    assert meta.run_id == "k1" and meta.suite == "fin" and meta.interrupted
    assert "killed" in meta.interruption and meta.incomplete[0].what == "the run"
    assert meta.counts["in_flight_at_kill"] == 1 and meta.workloads["chat"]["requests"] == 6
    (st,) = meta.stages
    assert st.partial and st.duration_s == 0.4 and st.planned_duration_s == 1.0
    t = store.read_table(run_dir, "requests")
    assert t.num_rows == 3 and t.column("status").to_pylist().count("cancelled") == 1


def test_recover_refuses_a_run_still_going(tmp_path):
    import os
    import socket

    live = tmp_path / "load"
    live.mkdir()
    store.write_proc_meta(live, ProcMeta(closed=False,
                                         worker=f"{socket.gethostname()}:{os.getpid()}"))
    driven = tmp_path / "driven"  # between two Locust runs of kvbench run: no load process
    write_shards(driven)
    F.mark_running(driven)
    for run_dir, why in ((live, "still going"), (driven, "still driving it")):
        try:
            F.recover(run_dir)
        except DataError as exc:
            assert why in str(exc)
        else:
            raise AssertionError("recovered a live run")
        assert not (run_dir / "run.json").exists()


def test_merged_stage_keeps_the_largest_pause_with_its_own_off_cpu_part():
    """Two load processes ran one stage: the stage's pause is the larger one, with that
    pause's off-CPU split (not the other process's); an older process without the split
    leaves it unknown rather than borrowed."""
    def meta(pause, off=None, over=1):
        st = {"endpoint": "e1", "workload": "chat", "index": 0, "t_start_ns": 1,
              "t_end_ns": 2, "loop_pause_max_ms": pause, "loop_pauses_over_5ms": over}
        if off is not None:
            st["loop_pause_max_offcpu_ms"] = off
        return ProcMeta.from_dict({"counts": {}, "stages": [st]})

    (st,) = F.merge_proc_meta([meta(12.0, 1.0), meta(30.0, 25.0, 2)]).stages
    assert (st.loop_pause_max_ms, st.loop_pause_max_offcpu_ms) == (30.0, 25.0)
    assert st.loop_pauses_over_5ms == 3
    (st,) = F.merge_proc_meta([meta(30.0, 25.0), meta(12.0, 1.0)]).stages
    assert (st.loop_pause_max_ms, st.loop_pause_max_offcpu_ms) == (30.0, 25.0)
    (st,) = F.merge_proc_meta([meta(12.0, 1.0), meta(30.0)]).stages
    assert st.loop_pause_max_ms == 30.0 and st.loop_pause_max_offcpu_ms is None
