"""``kvbench run`` and the retention probe against a real vLLM CPU server and a real
llama-server: every request recorded, the records' prompt and cached tokens equal to the
engine's own counters over each job, reset really empties the cache (the first request is cold
again), priming makes it cached, cached requests are faster than cold ones, the vLLM spans
arrive over OTLP and join the records, and the retention probe sees eviction."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbench.core.store import load_results
from kvbench.reports import retention as retention_report
from kvbench.reports.cache_verify import cache_rows
from kvbench.reports.data import load

import setup_engines as E

SERVED_MODEL = E.SERVED_MODEL
# an engine's start (vLLM CPU: about a minute) counts toward its first test
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
[suite]
name = "engines"
results_dir = "{results}"
tokenizer = "{tokenizer}"
workloads = ["rag"]
{otlp}

[[endpoints]]
name = "{name}"
kind = "openai"
url = "{url}"
model = "{model}"
engine = "{engine}"

[workloads.rag]
kind = "rag"
api = "completions"
requests = 12
documents = 3
top_k = 1
chunk_tokens = {{ dist = "constant", mean = 400 }}
output_tokens = {{ dist = "constant", mean = 4 }}

[profiles.a_reset]
pacing = "closed"
cache = "reset"
stages = [ {{ users = 1, duration_s = 8 }} ]

[profiles.b_warm]
pacing = "closed"
cache = "warm"
stages = [ {{ users = 1, duration_s = 8 }} ]
"""


def run_suite(tmp_path, url, name, engine, otlp_port=None):
    cfg = tmp_path / "bench.toml"
    cfg.write_text(CONFIG.format(
        results=tmp_path / "results", tokenizer=E.MODEL_DIR / "tokenizer.json", name=name,
        url=url, model=SERVED_MODEL, engine=engine,
        otlp=f'otlp_listen = "127.0.0.1:{otlp_port}"' if otlp_port else ""))
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", "r"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    return load_results(tmp_path / "results" / "r"), p


def job_records(res, state):
    t = res.requests.to_pandas().sort_values("t_sent")
    return t[(t.t_sent >= state["t_start_ns"]) & (t.t_sent <= state["t_end_ns"])]


def check_protocol(res, block_tokens):
    meta = res.meta
    assert meta.counts["requests_started"] == meta.counts["records_written"] == \
        res.requests.num_rows
    assert set(res.requests.column("status").to_pylist()) == {"ok"}
    reset, warm = meta.cache_states
    assert reset["reset"]["done"] and warm["reset"]["done"], meta.cache_states
    assert job_records(res, reset).iloc[0].cached_tokens == 0  # reset: cold
    first_warm = job_records(res, warm).iloc[0]
    assert first_warm.cached_tokens >= block_tokens  # primed: cached
    d = load([res.path])
    rows = cache_rows(d.runs, d.frame)
    for r in rows:  # verify agrees with the engine's counters to the token
        assert r["records_cached"] == r["engine_hits"], r
        assert r["records_prompt"] == r["engine_prompt"], r
    t = res.requests.to_pandas()
    cached = t[t.cached_tokens >= 0.5 * t.prompt_tokens].ttft_ns
    cold = t[t.cached_tokens == 0].ttft_ns
    assert len(cold) >= 2 and len(cached) >= 2
    assert np.median(cached) < np.median(cold)  # cached prefixes are faster
    return rows


def test_vllm_reset_prime_verify_and_traces(vllm, tmp_path):
    url, otlp = vllm
    res, p = run_suite(tmp_path, url, "vllm", "vllm", otlp_port=otlp)
    rows = check_protocol(res, block_tokens=128)  # vLLM CPU: 128-token blocks
    print(json.dumps(rows, indent=1, default=str))
    assert res.meta.telemetry["otlp"].endswith("request spans"), res.meta.telemetry
    md = subprocess.run([sys.executable, "-m", "kvbench", "report", str(res.path), "--format",
                         "md"], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert "TTFT split by the server's own traces" in md
    print(md)


def test_vllm_retention_probe_sees_eviction(vllm, tmp_path):
    url, _ = vllm
    out = tmp_path / "ret"
    p = subprocess.run([sys.executable, "-m", "kvbench", "probe", "retention", "--url", url,
                        "--engine", "vllm", "--gaps", "0.5:8", "--working-set", "2",
                        "--probe-tokens", "1024", "--background-tokens", "1024",
                        "--rate-tokens-s", "3000", "-o", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr + p.stdout
    print(p.stdout)
    result = json.loads((out / "retention.json").read_text())
    assert result["spec"]["capacity_tokens"] == 64 * 128  # --num-gpu-blocks-override 64
    pts = result["points"]
    assert pts[0]["hit_fraction"] > 0.5 and pts[-1]["hit_fraction"] == 0  # evicted
    (row,) = retention_report.summary(result)
    assert row["knee_gap_s"] is not None


def test_llama_server_reset_and_counters(llama_server, tmp_path):
    res, p = run_suite(tmp_path, llama_server, "llama", "llamacpp")
    meta = res.meta
    assert meta.counts["requests_started"] == meta.counts["records_written"]
    reset, warm = meta.cache_states
    assert reset["reset"]["done"], reset
    assert job_records(res, reset).iloc[0].cached_tokens == 0
    d = load([res.path])
    for r in cache_rows(d.runs, d.frame):
        assert r["records_cached"] == r["engine_hits"], r
        assert r["records_prompt"] == r["engine_prompt"], r
