"""Collectors end to end against the built-in disaggregated endpoint (``kvbench serve``): its
vLLM-style and DCGM-style /metrics land in the engine and gpu tables, inside the run window."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pynvml

from kvbench.collectors.session import start_collectors
from kvbench.core import store
from kvbench.runs.finalize import finalize
from kvbench.config import CollectConfig
from fake_nvml import FakeNvml


def _complete(url: str, n: int) -> None:
    for i in range(n):
        body = json.dumps({"model": "kvbench-llama-3-70b", "max_tokens": 8,
                           "prompt": "the same long shared prefix of a contract " * 40
                           + f"question {i}"}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            json.loads(resp.read())


def test_builtin_disaggregated_endpoint_metrics_land_in_results(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "serve", "--topology",
                             "disaggregated", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("kvbench serve: listening on http://"), line
        url = line.split(" on ")[1].split(" ")[0]
        cfg = CollectConfig(scrape_interval_s=0.2)
        t0 = time.time_ns()
        handle = start_collectors(
            tmp_path, cfg, [{"name": "disagg", "url": url, "metrics_url": None,
                             "topology": "disaggregated"}],
            nvml=FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
            log=lambda m: None)
        load = threading.Thread(target=_complete, args=(url, 6))
        load.start()
        load.join(60)
        time.sleep(0.5)
        out = handle.stop()
        t1 = time.time_ns()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    tel = out.telemetry
    assert tel["engine:disagg"] == "ok" and tel["dcgm:disagg"] == "ok"
    assert tel["engine_family:disagg"] == "builtin"  # vLLM's names plus the emulator's own
    assert tel["nvml"].startswith("no NVML library") and out.incomplete == []
    finalize(tmp_path, meta={"run_id": "e2e", "telemetry": tel,  # the one run.json writer
                             "clock_offsets_ns": out.clock_offsets_ns})
    res = store.load_results(tmp_path)
    eng = res.tables["engine"].to_pandas()
    gpu = res.tables["gpu"].to_pandas()
    assert eng["t_ns"].between(t0, t1).all() and gpu["t_ns"].between(t0, t1).all()
    metrics = set(eng["metric"])
    assert {"vllm:num_requests_running", "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total", "kvbench:kv_bytes_moved_total"} <= metrics
    q = eng[eng.metric == "vllm:prefix_cache_queries_total"].groupby("t_ns")["value"].sum()
    assert q.is_monotonic_increasing and q.iloc[-1] > q.iloc[0]  # raw counter grew under load
    assert set(gpu["source"]) == {"dcgm"} and {"prefill", "decode"} <= set(gpu["role"])
    assert gpu["gpu_util_pct"].notna().all() and gpu["hbm_used_bytes"].gt(0).all()
    assert gpu["hbm_total_bytes"].ge(gpu["hbm_used_bytes"]).all()
    assert gpu["sm_active"].between(0, 1).all()
