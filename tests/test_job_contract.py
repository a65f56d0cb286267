"""The job file and the sidecar are the run contract serialised: a job's stages are
``StagePlan``s and its SLOs ``SLO``s, read back as the same; a stage that ran is its plan plus
what ran (``StageEntry.of``)."""

import json

from kvbench.config import parse_config
from kvbench.core.contract import SLO, ProcMeta, StageEntry, StagePlan
from kvbench.runs.job import Job, resolve

CONFIG = {
    "endpoints": [{"name": "e1", "kind": "openai", "url": "http://127.0.0.1:9", "model": "m"}],
    "workloads": {"chat": {"kind": "chat", "requests": 6}},
    "slo": {"chat": {"ttft_ms": 500, "tpot_ms": 50}},
    "profiles": {"ladder": {"pacing": "poisson", "stages": [
        {"rate_rps": 2.0, "duration_s": 10}, {"rate_rps": 6.0, "duration_s": 10,
                                              "requests": 40}]}},
}


def test_job_file_round_trips_through_the_contract(tmp_path):
    job = resolve(parse_config(CONFIG), workload="chat", endpoint="e1", profile="ladder",
                  run_id="r", results_dir=tmp_path, duration_scale=0.5)
    assert job.stages == [StagePlan(0, 5.0, 2.0), StagePlan(1, 5.0, 6.0, requests=40)]
    assert job.slo["chat"] == SLO(ttft_ms=500, tpot_ms=50)
    loaded = Job.load(job.save(tmp_path / job.file_name()))
    assert loaded == job and isinstance(loaded.slo["chat"], SLO)
    data = json.loads((tmp_path / job.file_name()).read_text())
    # every key of the contract written, null where not set
    assert data["slo"]["chat"] == {"ttft_ms": 500, "tpot_ms": 50, "e2e_ms": None}
    assert data["stages"][1] == {"index": 1, "duration_s": 5.0, "rate_rps": 6.0, "users": None,
                                 "requests": 40, "exact_count": False}


def test_a_job_file_of_the_stage_shape_before_reads(tmp_path):
    """A job file whose stages carry every key, null where unset (as the job's own stage class
    wrote them), reads as the same plan."""
    job = resolve(parse_config(CONFIG), workload="chat", endpoint="e1", profile="ladder",
                  run_id="r", results_dir=tmp_path)
    data = job.to_dict()
    data["stages"] = [{"index": 0, "duration_s": 10.0, "rate_rps": 2.0, "users": None,
                       "requests": None}]
    data["slo"] = {"chat": {"ttft_ms": 500.0, "tpot_ms": None, "e2e_ms": None}}
    back = Job.from_dict(data)
    assert back.stages == [StagePlan(0, 10.0, 2.0)]
    assert back.slo == {"chat": SLO(ttft_ms=500.0)}


def test_a_stage_entry_is_its_plan_and_what_ran():
    plan = StagePlan(2, 3.0, 4.0, requests=5)  # one process's share of the stage's requests
    st = StageEntry.of(plan, endpoint="e", workload="w", pacing="poisson", t_start_ns=10,
                       t_end_ns=2 * 10**9, requests=9)
    assert (st.key, st.rate_rps, st.duration_s, st.requests) == (("e", "w", 2), 4.0, 3.0, 9)
    cut = st.cut(10**9 + 10)
    assert (cut.duration_s, cut.planned_duration_s, cut.partial) == (1.0, 3.0, True)
    meta = ProcMeta(stages=[cut], open_stage=StageEntry.of(StagePlan(3, 1.0), t_start_ns=1))
    assert ProcMeta.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta
