"""``kvbench run`` and the retention probe against a real vLLM CPU server and a real
llama-server. What a user relies on, each checked on token counts the engines report:

- every request sent is recorded, and the records' prompt, cached and completion tokens equal
  the engine's own counters over each job, to the token (the report's cache-verify table);
- ``cache = "reset"`` really empties the cache: the same prompt that an ``as-is`` job found
  cached is cold (0 cached tokens) right after a reset;
- ``cache = "warm"`` (reset, then prime) makes the first measured request cached;
- cached requests are much faster than cold ones (medians, with a wide margin: the machines
  running these tests are small and busy);
- vLLM's per-request spans arrive over OTLP and join every record;
- the retention probe sees the probe prefix evicted once the background outgrows the cache.

The jobs run in name order: a_reset (cold start), b_asis (no reset: its first prompt, the same
as a_reset's first, is cached), c_reset (the same prompt again, cold after the reset),
d_warm (reset and prime: cached from its first request)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbench.core.store import load_results, read_table
from kvbench.reports.analysis import retention as retention_report
from kvbench.reports.analysis import server_traces
from kvbench.reports.analysis.cache_verify import cache_rows
from kvbench.reports.measures.data import load

import setup_engines as E

SERVED_MODEL = E.SERVED_MODEL
# an engine's start (vLLM CPU: about a minute) counts toward its first test
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 12  # per job: the whole workload, once
# prompts of about 2,550 tokens (128 system + 2,400 document + question): long enough that a
# cold prefill costs several times a cached one even for the tiny model; two documents (about
# 5,100 tokens of prefixes) fit vLLM's 64 x 128-token blocks and llama-server's two slots
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
requests = {requests}
documents = 2
chunks_per_document = 1
top_k = 1
chunk_tokens = {{ dist = "constant", mean = 2400 }}
output_tokens = {{ dist = "constant", mean = 4 }}

[profiles.a_reset]
pacing = "closed"
cache = "reset"
stages = [ {{ users = 1, duration_s = 300, requests = {requests} }} ]

[profiles.b_asis]
pacing = "closed"
cache = "as-is"
stages = [ {{ users = 1, duration_s = 300, requests = {requests} }} ]

[profiles.c_reset]
pacing = "closed"
cache = "reset"
stages = [ {{ users = 1, duration_s = 300, requests = {requests} }} ]

[profiles.d_warm]
pacing = "closed"
cache = "warm"
stages = [ {{ users = 1, duration_s = 300, requests = {requests} }} ]
"""


def run_suite(tmp_path, url, name, engine, otlp_port=None):
    cfg = tmp_path / "bench.toml"
    cfg.write_text(CONFIG.format(
        results=tmp_path / "results", tokenizer=E.MODEL_DIR / "tokenizer.json", name=name,
        url=url, model=SERVED_MODEL, engine=engine, requests=REQUESTS,
        otlp=f'otlp_listen = "127.0.0.1:{otlp_port}"' if otlp_port else ""))
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", "r"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    return load_results(tmp_path / "results" / "r"), p


def job_records(res, state):
    t = res.requests.to_pandas().sort_values("t_sent")
    return t[(t.t_sent >= state.t_start_ns) & (t.t_sent <= state.t_end_ns)]


def check_protocol(res, block_tokens):
    """The checks both engines pass; returns the cache-verify rows (printed by the tests)."""
    meta = res.meta
    # every request recorded, every one answered
    assert meta.counts["requests_started"] == meta.counts["records_written"] == \
        res.requests.num_rows == 4 * REQUESTS, meta.counts
    assert set(res.requests.column("status").to_pylist()) == {"ok"}
    states = meta.cache_states
    assert [s.mode for s in states] == ["reset", "as-is", "reset", "warm"], states
    a, b, c, d = states
    assert a.reset["done"] and c.reset["done"] and d.reset["done"], states
    assert d.primed_prefixes == 2 and d.primed_tokens > 0, d
    firsts = [job_records(res, s).iloc[0] for s in states]
    # the same workload (same seed) in every job: the same first prompt each time
    assert len({f.request_id for f in firsts}) == 1 and len({f.prompt_tokens for f in firsts}) == 1
    assert firsts[0].cached_tokens == 0  # reset: cold
    # as-is: the prefix a_reset sent is still cached (whole blocks of it); after a reset the
    # same prompt is cold again; warm (reset, then primed): cached as in the as-is job
    whole = firsts[0].shared_prefix_tokens // block_tokens * block_tokens - block_tokens
    assert whole > 0
    assert firsts[1].cached_tokens >= whole
    assert firsts[2].cached_tokens == 0
    assert firsts[3].cached_tokens >= whole
    d_frame = load([res.path])
    rows = cache_rows(d_frame.runs, d_frame.frame)
    assert len(rows) == 4
    for r in rows:  # verify agrees with the engine's counters to the token
        assert r["requests"] == REQUESTS, r
        assert r["records_prompt"] == r["engine_prompt"], r
        assert r["records_cached"] == r["engine_hits"], r
        assert r["records_completion"] == r["engine_generation"], r
        assert not [f for f in r["findings"] if "tokens" in f], r
    # cached requests are faster at the client too (the server's own prefill times, checked
    # per engine, show by how much; the client's TTFT adds HTTP and Locust on a busy host)
    cached, cold = split(res.requests.to_pandas())
    assert len(cold) >= 2 and len(cached) >= 10, (len(cold), len(cached))
    assert np.median(cached.ttft_ns) < np.median(cold.ttft_ns)
    return rows


def split(t):
    """(mostly cached, cold) records: at least 80% / at most 10% of the prompt cached."""
    return (t[t.cached_tokens >= 0.8 * t.prompt_tokens],
            t[t.cached_tokens <= 0.1 * t.prompt_tokens])


def summary(rows) -> str:
    keys = ("profile", "mode", "requests", "records_prompt", "engine_prompt", "records_cached",
            "engine_hits", "records_completion", "engine_generation", "findings")
    return json.dumps([{k: r[k] for k in keys} for r in rows], indent=1, default=str)


def test_vllm_reset_prime_verify_and_traces(vllm, tmp_path):
    url, otlp = vllm
    res, p = run_suite(tmp_path, url, "vllm", "vllm", otlp_port=otlp)
    rows = check_protocol(res, block_tokens=128)  # vLLM CPU: 128-token blocks
    print(summary(rows))
    # vLLM's spans over OTLP: one per request it served (the measured ones, the two priming
    # requests, and whatever else the server had not yet exported), every record joined to
    # its own span (each job resends the same ids: a span joins the record sent nearest it)
    spans = read_table(res.path, "spans")
    assert res.meta.telemetry["otlp"] == f"{spans.num_rows} request spans"
    sp = spans.to_pandas()
    by_start = sp[sp.trace_request_id.str.startswith("cmpl-rag-")].sort_values("t_ns")
    assert len(by_start) == 4 * REQUESTS and spans.num_rows >= 4 * REQUESTS + 2
    joined = server_traces.join(res.requests, spans)
    assert len(joined) == 4 * REQUESTS
    t = res.requests.to_pandas().sort_values("t_sent").reset_index(drop=True)
    assert [f"cmpl-{i}-0" for i in t.request_id] == by_start.trace_request_id.tolist()
    assert (by_start.prompt_tokens.to_numpy() == t.prompt_tokens.to_numpy()).all()
    assert (joined.ttft_ns >= joined.server_ttft_ns).all()  # the server's part of the TTFT
    # much faster, by the server's own clock: a cached request's prefill (scheduled to first
    # token) under half a cold one's (measured about 5x apart)
    t["server_prefill_ns"] = by_start.prefill_ns.to_numpy()  # in send order, as asserted
    cached, cold = split(t)
    assert np.median(cached.server_prefill_ns) < 0.5 * np.median(cold.server_prefill_ns), \
        (np.median(cached.server_prefill_ns), np.median(cold.server_prefill_ns))
    md = subprocess.run([sys.executable, "-m", "kvbench", "report", str(res.path), "--format",
                         "md"], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert "TTFT split by the server's own traces" in md
    assert "Prefix cache: start state" in md
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


PROMPT_EVAL = re.compile(r"prompt eval time =\s*([0-9.]+) ms /\s*([0-9]+) tokens")


def test_llama_server_reset_prime_verify(llama_server, tmp_path):
    url, log = llama_server
    res, p = run_suite(tmp_path, url, "llama", "llamacpp")
    # llama.cpp reuses a slot's cached prompt token by token: block 1
    rows = check_protocol(res, block_tokens=1)
    print(summary(rows))
    # much faster, by the server's own log: each request's prompt evaluation ("prompt eval
    # time = X ms / N tokens", N the tokens it computed) in send order, priming between jobs
    evals = [(float(ms), int(n)) for ms, n in PROMPT_EVAL.findall(log.read_text())]
    t = res.requests.to_pandas().sort_values("t_sent").reset_index(drop=True)
    computed = (t.prompt_tokens - t.cached_tokens).astype(int).tolist()
    it, ms = iter(evals), []
    for n in computed:  # each record's computed tokens, in order, among the log's lines
        ms.append(next((x for x, m in it if m == n), None))
    assert None not in ms, (computed, evals)
    t["server_prompt_ms"] = ms
    cached, cold = split(t)
    assert np.median(cached.server_prompt_ms) < 0.5 * np.median(cold.server_prompt_ms), \
        (np.median(cached.server_prompt_ms), np.median(cold.server_prompt_ms))
