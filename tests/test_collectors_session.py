"""start_collectors / stop end to end: FAKE NVML (tests/fake_nvml.py), a real aiohttp server
with vLLM- and DCGM-style /metrics, a remote agent, and one dead endpoint; results read back
with kvbench.store.load_results."""

from __future__ import annotations

import time

import pynvml

from kvbench.collectors.agent import AgentServer
from kvbench.collectors.session import metrics_url_for, start_collectors
from kvbench.core import store
from kvbench.runs.finalize import finalize
from kvbench.config import CollectConfig
from fake_nvml import FakeGpu, FakeNvml
from metrics_server import MetricsServer


def test_session_writes_aligned_gpu_and_engine_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("KVB_TEST_TOKEN", "session-test-token-0123")
    agent = AgentServer("127.0.0.1", 0, token="session-test-token-0123", interval_s=0.05,
                        nvml=FakeNvml([FakeGpu()]), log=lambda m: None,
                        clock_ns=lambda: time.time_ns() - 3_000_000_000).start()
    logs = []
    try:
        with MetricsServer() as srv:
            cfg = CollectConfig(nvml_interval_s=0.05, scrape_interval_s=0.1,
                                agents=[agent.url], agent_token_env="KVB_TEST_TOKEN",
                                roles=[{"host": "*", "gpus": [0], "role": "colocated"}])
            endpoints = [
                {"name": "emu", "url": srv.url + "/v1", "metrics_url": None,
                 "topology": "disaggregated"},
                {"name": "dead", "url": "http://127.0.0.1:9/v1", "metrics_url": None,
                 "topology": "colocated"},
            ]
            t0 = time.time_ns()
            c0 = time.monotonic()
            handle = start_collectors(tmp_path, cfg, endpoints, nvml=FakeNvml([FakeGpu()]),
                                      log=logs.append)
            assert time.monotonic() - c0 < 0.5  # never blocks the caller
            time.sleep(0.8)
            t_end = time.time_ns()
            out = handle.stop()
            t1 = time.time_ns()
    finally:
        agent.stop()
    assert handle.stop() is out  # idempotent
    tel = out.telemetry
    assert tel["nvml"] == "ok" and tel["engine:emu"] == "ok" and tel["dcgm:emu"] == "ok"
    assert tel[f"agent:{agent.url}"] == "ok"
    assert tel["engine:dead"].startswith("no successful scrape of http://127.0.0.1:9/metrics")
    assert tel["engine_family:emu"] == "vllm" and "engine_family:dead" not in tel
    assert [i.what for i in out.incomplete] == ["scrape of http://127.0.0.1:9/metrics (dead)"]
    (host, off), = out.clock_offsets_ns.items()
    assert abs(off - 3_000_000_000) < 50_000_000
    assert not store.shard_files(tmp_path)  # compacted
    finalize(tmp_path, telemetry=out.telemetry, incomplete=out.incomplete,  # run.json's writer
             clock_offsets_ns=out.clock_offsets_ns, meta={"run_id": "t"})
    res = store.load_results(tmp_path)
    gpu = res.tables["gpu"].to_pandas()
    eng = res.tables["engine"].to_pandas()
    assert set(gpu["source"]) == {"nvml", "dcgm"}
    assert gpu["t_ns"].between(t0, t1 + 50_000_000).all()
    assert eng["t_ns"].between(t0, t1).all() and set(eng["endpoint"]) == {"emu"}
    nv = gpu[gpu.source == "nvml"]
    assert set(nv["role"]) == {"colocated"} and len(nv) >= 10  # local sampler + agent rows
    dc = gpu[gpu.source == "dcgm"]
    assert set(zip(dc["gpu"], dc["role"])) == {(0, "prefill"), (1, "decode")}
    assert (dc["endpoint"] == "emu").all()
    hits = eng[eng.metric == "vllm:prefix_cache_hits_total"].sort_values("t_ns")
    assert len(hits) >= 5 and hits["value"].is_monotonic_increasing
    # after t_end: at most one periodic scrape that raced stop(), plus the final one
    assert eng[eng.t_ns > t_end]["t_ns"].nunique() <= 2


def test_no_gpu_no_endpoints_run_goes_on(tmp_path):
    logs = []
    cfg = CollectConfig()
    h = start_collectors(tmp_path, cfg, [],
                         nvml=FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
                         log=logs.append)
    out = h.stop()
    assert out.telemetry["nvml"].startswith("no NVML library")
    assert out.incomplete == [] and out.clock_offsets_ns == {}
    assert len(logs) == 1 and not list(tmp_path.glob("*.parquet"))
    h2 = start_collectors(tmp_path, CollectConfig(nvml=False), [])
    assert h2.stop().telemetry == {"nvml": "off in bench.toml ([collect] nvml = false)"}


def test_metrics_url_defaults():
    assert metrics_url_for({"url": "http://h:8000/v1/"}) == "http://h:8000/metrics"
    assert metrics_url_for({"url": "http://h:8000"}) == "http://h:8000/metrics"
    assert metrics_url_for({"url": "http://h/v1", "metrics_url": "http://d:9400/metrics"}) \
        == "http://d:9400/metrics"
    assert metrics_url_for({"url": None}) is None
