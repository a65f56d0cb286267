"""Synthetic results (schema v1) for the reports' tests and benchmarks: vectorised, seeded.

Not a model of any server: latency shapes are simple random draws with knobs that let a test
plant one symptom (a slow topology, lost prefix hits, late sends) and check the report sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvbench.core.layout import LAYOUT, DatasetWriter
from kvbench.core.schema import ENGINE, GPU, REQUESTS
from kvbench.runs.finalize import finalize

T0_NS = 1_780_000_000 * 10**9  # a fixed epoch (mid 2026) so outputs are reproducible


@dataclass
class EndpointShape:
    """How one synthetic endpoint behaves."""

    name: str
    topology: str = "colocated"
    ttft_base_ms: float = 60.0
    ttft_ms_per_prompt_token: float = 1 / 40  # seeds: 40 prefill tokens/ms per GPU
    itl_ms: float = 20.0
    hit_fraction: float = 0.5  # share of shared_prefix_tokens reported as cached
    error_rate: float = 0.0
    # share of requests cancelled at the stop (in flight when the stage ended: no usage, no
    # end), drawn among those that did not fail
    cancel_rate: float = 0.0
    regions: Sequence[str] = ("us-east",)
    replicas: int = 4
    model: str = "kvbench-llama-3-70b"
    gpus: int = 1
    gpu_hour_cost: float | None = None
    slowdown: float = 1.0  # factor on every latency (like the emulator's `slowdown` option)
    kind: str = "builtin"  # run.json endpoint kind: builtin (declared hardware) | openai


@dataclass
class RunShape:
    endpoints: Sequence[EndpointShape] = field(
        default_factory=lambda: [EndpointShape("colocated")])
    requests_per_stage: int = 200  # per endpoint
    stage_rates_rps: Sequence[float] = (2.0,)
    classes: Sequence[str] = ("chat", "rag", "agent", "longctx")
    prompt_tokens_median: float = 600.0
    output_tokens_median: float = 120.0
    max_chunks: int = 60
    lateness_ms: float = 0.5  # mean client lateness (exponential)
    sessions_turns: int = 1  # turns per session
    workload: str = "mix"
    seed: int = 0


def synth_table(shape: RunShape, run_id: str = "synthetic-run") -> tuple[pa.Table, list[dict]]:
    """A requests table and the run.json stages it covers."""
    rng = np.random.default_rng(shape.seed)
    parts, stages = [], []
    n = shape.requests_per_stage
    for ei, ep in enumerate(shape.endpoints):
        t_stage = T0_NS
        for si, rate in enumerate(shape.stage_rates_rps):
            gaps_s = rng.exponential(1.0 / rate, n)
            t_sched = t_stage + np.cumsum(gaps_s * 1e9).astype(np.int64)
            duration_ns = int(n / rate * 1e9)
            stages.append({"endpoint": ep.name, "workload": shape.workload, "profile": "ladder",
                           "index": si, "pacing": "poisson", "rate_rps": rate, "users": None,
                           "duration_s": n / rate, "t_start_ns": int(t_stage),
                           "t_end_ns": int(t_stage + duration_ns)})
            parts.append(_rows(rng, shape, ep, ei, si, t_sched, run_id))
            t_stage += duration_ns
    table = pa.concat_tables(parts)
    return table, stages


def _rows(rng, shape: RunShape, ep: EndpointShape, ei: int, si: int, t_sched: np.ndarray,
          run_id: str) -> pa.Table:
    n = len(t_sched)
    prompt = np.maximum(8, rng.lognormal(np.log(shape.prompt_tokens_median), 0.9, n)).astype(
        np.int64)
    shared = (prompt * rng.uniform(0.3, 0.9, n)).astype(np.int64)
    out = np.maximum(1, rng.lognormal(np.log(shape.output_tokens_median), 0.6, n)).astype(
        np.int64)
    cached = (shared * ep.hit_fraction).astype(np.int64)
    lateness = rng.exponential(shape.lateness_ms * 1e6, n).astype(np.int64)
    t_sent = t_sched + lateness
    ttft = ((ep.ttft_base_ms + (prompt - cached) * ep.ttft_ms_per_prompt_token)
            * rng.lognormal(0, 0.2, n) * 1e6 * ep.slowdown).astype(np.int64)
    k = np.clip(out // 2, 1, shape.max_chunks)  # chunks per request
    chunk_tok = np.maximum(out // k, 1).astype(np.int32)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(k, out=offsets[1:])
    total = int(offsets[-1])
    step = rng.gamma(4.0, ep.itl_ms * ep.slowdown * 1e6 / 4.0, total)
    starts = offsets[:-1]
    step[starts] = ttft
    csum = np.cumsum(step)
    base = np.repeat(csum[starts] - step[starts], k)
    values = (csum - base).astype(np.int64)
    e2e = values[offsets[1:] - 1] + 200_000
    status = np.full(n, "ok", dtype=object)
    bad = rng.random(n) < ep.error_rate
    status[bad] = "http_error"
    http = np.where(bad, 503, 200).astype(np.int32)
    error = np.where(bad, "503 Service Unavailable", None)
    cut = ~bad & (rng.random(n) < ep.cancel_rate) if ep.cancel_rate else np.zeros(n, bool)
    status[cut] = "cancelled"
    error = np.where(cut, "stopped before the response ended", error)
    classes = np.asarray(shape.classes, dtype=object)[rng.integers(0, len(shape.classes), n)]
    turns = max(1, shape.sessions_turns)
    sess_idx = np.arange(n) // turns
    turn = (np.arange(n) % turns).astype(np.int32)
    session = np.char.add(f"{ep.name}-s{si}-", sess_idx.astype(str)).astype(object)
    region = np.asarray(ep.regions, dtype=object)[rng.integers(0, len(ep.regions), n)]
    replica = np.char.add("r", rng.integers(0, ep.replicas, n).astype(str)).astype(object)
    ttft_nullable = np.where(bad, -1, ttft)
    cols = {
        "run_id": pa.array(np.full(n, run_id, dtype=object), pa.string()),
        "endpoint": pa.array(np.full(n, ep.name, dtype=object), pa.string()),
        "topology": pa.array(np.full(n, ep.topology, dtype=object), pa.string()),
        "workload": pa.array(np.full(n, shape.workload, dtype=object), pa.string()),
        "request_class": pa.array(classes, pa.string()),
        "stage": pa.array(np.full(n, si, np.int32)),
        # one id per request of a run (two shapes of one run differ by their workload)
        "request_id": pa.array(np.char.add(f"{ep.name}-{shape.workload}-{si}-",
                                           np.arange(n).astype(str)), pa.string()),
        "session_id": pa.array(session, pa.string()),
        "turn": pa.array(turn),
        "worker": pa.array(np.full(n, "host:1", dtype=object), pa.string()),
        "prompt_tokens": pa.array(prompt, mask=cut),
        "prompt_tokens_client": pa.array(prompt),
        "shared_prefix_tokens": pa.array(shared),
        "max_tokens": pa.array(out),
        "completion_tokens": pa.array(np.where(bad, 0, out), mask=cut),
        "completion_tokens_client": pa.array(np.where(bad, 0, out)),
        "cached_tokens": pa.array(cached, mask=cut),
        "t_scheduled": pa.array(t_sched),
        "t_sent": pa.array(t_sent),
        "connect_ns": pa.array(np.zeros(n, np.int64)),
        "ttft_ns": pa.array(ttft_nullable, mask=bad),
        "chunk_offsets_ns": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                     pa.array(values)),
        "chunk_tokens": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                 pa.array(np.repeat(chunk_tok, k))),
        "e2e_ns": pa.array(e2e, mask=cut),
        "status": pa.array(status, pa.string()),
        "http_status": pa.array(http),
        "error": pa.array(error, pa.string()),
        "server_queue_ns": pa.array(np.full(n, 1_000_000, np.int64)),
        "server_prefill_ns": pa.array((ttft * 0.8).astype(np.int64)),
        "server_kv_transfer_ns": pa.array(np.zeros(n, np.int64)),
        "server_first_decode_ns": pa.array((ttft * 0.1).astype(np.int64)),
        "server_replica": pa.array(replica, pa.string()),
        "server_region": pa.array(region, pa.string()),
        "retry_after_s": pa.nulls(n, pa.float64()),
        "server_request_id": pa.nulls(n, pa.string()),
        "streamed": pa.nulls(n, pa.bool_()),
        "parent_session_id": pa.nulls(n, pa.string()),
        "subagent_index": pa.nulls(n, pa.int32()),
    }
    return pa.table(cols, schema=REQUESTS)


def run_meta(shape: RunShape, stages: list[dict], run_id: str = "synthetic-run",
             workloads: dict | None = None, config: dict | None = None, **extra) -> dict:
    ends = [s["t_end_ns"] for s in stages] or [T0_NS]
    cfg = config if config is not None else {
        "suite": {"name": "synthetic"},
        "slo": {"chat": {"ttft_ms": 500, "tpot_ms": 50}, "rag": {"ttft_ms": 1000, "tpot_ms": 50},
                "agent": {"ttft_ms": 1500, "tpot_ms": 60},
                "longctx": {"ttft_ms": 5000, "tpot_ms": 80}},
    }
    meta = {
        "run_id": run_id, "suite": "synthetic", "started_ns": T0_NS, "ended_ns": max(ends),
        "config": cfg, "versions": {"kvbench": "test"}, "git_commit": "0" * 40,
        "hosts": ["host"],
        "endpoints": [{"name": e.name, "topology": e.topology, "url": "http://127.0.0.1:1",
                       "model": e.model, "kind": e.kind, "gpus": e.gpus,
                       "gpu_hour_cost": e.gpu_hour_cost} for e in shape.endpoints],
        "stages": stages, "clock_offsets_ns": {}, "telemetry": {}, "incomplete": [],
        "workloads": workloads or {},
        "counts": {},
    }
    meta.update(extra)
    return meta


def gpu_table(stages: list[dict], roles: Sequence[tuple[str, str]], interval_s: float = 1.0,
              seed: int = 0) -> pa.Table:
    """Samples for GPUs given as (endpoint, role), one per ``interval_s`` over the stages."""
    rng = np.random.default_rng(seed)
    t0 = min(s["t_start_ns"] for s in stages)
    t1 = max(s["t_end_ns"] for s in stages)
    t = np.arange(t0, t1, int(interval_s * 1e9), dtype=np.int64)
    parts = []
    for gi, (ep, role) in enumerate(roles):
        m = len(t)
        sm = np.clip(rng.normal(0.6 if role != "decode" else 0.35, 0.1, m), 0, 1)
        cols = {name: pa.nulls(m, typ) for name, typ in zip(GPU.names, GPU.types)}
        cols.update({
            "t_ns": pa.array(t), "host": pa.array(["host"] * m), "gpu": pa.array(
                np.full(m, gi, np.int32)), "role": pa.array([role] * m),
            "source": pa.array(["nvml"] * m), "endpoint": pa.array([ep] * m),
            "gpu_util_pct": pa.array(sm * 100), "sm_active": pa.array(sm),
            "hbm_used_bytes": pa.array(np.full(m, 60 * 2**30, np.int64)
                                       + rng.integers(0, 2**30, m)),
            "hbm_total_bytes": pa.array(np.full(m, 80 * 2**30, np.int64)),
        })
        parts.append(pa.table(cols, schema=GPU))
    return pa.concat_tables(parts)


def engine_table(samples: Sequence[tuple[int, str, str, dict, float]]) -> pa.Table:
    """Rows (t_ns, endpoint, metric, labels, value)."""
    t, ep, metric, labels, value = zip(*samples) if samples else ((), (), (), (), ())
    return pa.table({"t_ns": pa.array(t, pa.int64()), "endpoint": pa.array(ep, pa.string()),
                     "metric": pa.array(metric, pa.string()),
                     "labels": pa.array([list(x.items()) for x in labels],
                                        pa.map_(pa.string(), pa.string())),
                     "value": pa.array(value, pa.float64())}, schema=ENGINE)


def write_run(run_dir: Path, table: pa.Table, meta: dict, gpu: pa.Table | None = None,
              engine: pa.Table | None = None, layout: int = LAYOUT) -> Path:
    """A finished run of these records: ``layout`` 2 (kvbench's) the requests as a
    partitioned dataset, 1 one ``requests.parquet`` (a run of an older kvbench)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if layout == 1 or set(table.column_names) != set(REQUESTS.names):
        # (a table without some columns stands for a file of an older kvbench: layout 1)
        pq.write_table(table, run_dir / "requests.parquet", compression="zstd")
    else:
        writer = DatasetWriter(run_dir, "requests")
        for batch in table.to_batches():
            writer.add(batch)
        writer.finish()
        writer.commit()
    if gpu is not None:
        pq.write_table(gpu, run_dir / "gpu.parquet")
    if engine is not None:
        pq.write_table(engine, run_dir / "engine.parquet")
    # through the one writer of run.json; a meta without workloads_sent stands for a run.json
    # written before kvbench recorded it
    finalize(run_dir, meta={"workloads_sent": None, **meta})
    return run_dir
