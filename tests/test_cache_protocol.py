"""The cache-state protocol: reset through the engine's own call (the emulator's route,
llama.cpp's per-slot erase against a fake), priming, the fresh-seed fallback, and ``kvbench run``
on a built-in endpoint: a reset run's first request is cold, a warm run's is cached, and the
records' cached tokens equal the engine's hit counter to the token."""

import http.server
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from kvbench import engines
from kvbench.config import BuiltinEndpoint, parse_config
from kvbench.core.errors import UserError
from kvbench.core.schema import SPANS
from kvbench.core.store import ShardWriter, load_results
from kvbench.endpoints.kvcache import HBMCache
from kvbench.reports.analysis.cache_verify import as_findings, cache_rows, verify
from kvbench.reports.measures.data import load
from kvbench.runs import builtin, cache
from kvbench.runs.job import Job, JobEndpoint

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"time_scale": 0.05, "replicas": 1, "kv_capacity_tokens": 65536}


@pytest.fixture(scope="module")
def emulator():
    proc, url = builtin.start(BuiltinEndpoint(name="emu", topology="colocated",
                                              options=OPTIONS))
    yield url
    builtin.stop(proc)


def complete(url, prompt):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "kvbench-llama-3-70b", "prompt": prompt, "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        usage = json.loads(r.read())["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_emulator_reset_empties_the_cache(emulator):
    prompt = "reset check " + " ".join(f"w{i}" for i in range(200))
    complete(emulator, prompt)
    assert complete(emulator, prompt) >= 192  # repeated: cached
    adapter = engines.get("builtin")
    before = cache.read_counters(emulator + "/metrics", adapter, {})
    assert cache.reset(emulator, adapter, {}) == (True, "POST /reset_prefix_cache")
    assert complete(emulator, prompt) == 0  # cold again
    after = cache.read_counters(emulator + "/metrics", adapter, {})
    assert after["block_tokens"] == 16 and after["capacity_tokens"] == 65536
    assert after["queries"] - before["queries"] == 202 and after["hits"] == before["hits"]


def test_reset_refused_while_blocks_are_held():
    c = HBMCache(8)
    assert c.allocate(2)
    c.register([11, 12])
    assert c.reset() is None  # a running sequence holds them
    c.release([11, 12], anon=0)
    assert c.match([11, 12]) == 2 and c.reset() == 2 and c.match([11, 12]) == 0


class _Slots(http.server.BaseHTTPRequestHandler):
    erased: list = []

    def do_GET(self):
        body = json.dumps([{"id": 0}, {"id": 1}]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        ok = self.path.endswith("action=erase")
        if ok:
            _Slots.erased.append(self.path)
        self.send_response(200 if ok else 501)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


def test_llamacpp_reset_erases_every_slot():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slots)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        done, how = cache.reset(url, engines.get("llamacpp"), {})
        assert done and how == "POST /slots/{slot}?action=erase for 2 slots"
        assert _Slots.erased == ["/slots/0?action=erase", "/slots/1?action=erase"]
        done, why = cache.reset(url, engines.get("vllm"), {})  # 501: dev mode off
        assert not done and "HTTP 501" in why and "VLLM_SERVER_DEV_MODE" in why
    finally:
        srv.shutdown()


def _job(url, mode, engine="vllm"):
    cfg = parse_config({"endpoints": [{"name": "x", "kind": "openai", "url": url}],
                        "workloads": {"rag": {"kind": "rag", "requests": 6, "documents": 2}},
                        "profiles": {"p": {"pacing": "closed", "cache": mode,
                                           "stages": [{"users": 1, "duration_s": 1}]}}})
    from kvbench.runs.job import resolve

    return resolve(cfg, workload="rag", endpoint="x", profile="p", model="m",
                   run_id="fresh-test", lookup_model=False)


def test_no_reset_call_falls_back_to_fresh_prefixes():
    job = _job("http://127.0.0.1:9", "reset")
    assert job.cache == "reset"
    wl = job.build_workload()
    out, entry = cache.prepare(job, engines.get("dynamo"), {}, wl)
    assert entry.started_from.startswith("fresh prefixes: not reset (NVIDIA Dynamo")
    assert out.seed == cache.fresh_seed(job) != job.seed and entry.fresh_seed
    first = lambda w: next(iter(w.requests())).messages  # noqa: E731
    assert first(out.build_workload()) != first(wl)
    assert entry.counters_before is None  # nothing listens there: no counters, no failure


def test_cache_mode_is_validated():
    with pytest.raises(UserError, match=r"field profiles\.p\.cache: .*'reset', 'warm' or "
                                        r"'as-is'"):
        _job("http://127.0.0.1:9", "cold")


def test_cut_to_tokens_and_prefixes():
    job = _job("http://127.0.0.1:9", "warm")
    wl = job.build_workload()
    prefixes = cache.shared_prefixes(wl, wl.tokenizer)
    shared = {r.shared_prefix_tokens for r in wl.requests()}
    assert 1 <= len(prefixes) <= 2  # one per document
    assert {wl.tokenizer.count_prompt(p) for p in prefixes} <= shared
    assert cache.cut_to_tokens("a b c d", 2, wl.tokenizer) == "a b"


def test_warm_primes_what_sessions_share_not_what_their_answers_will_be():
    """An agent's later turns hold the server's own answers: only the system prompt and tool
    schemas every session opens with are primed, once."""
    from kvbench.workloads.agent import AgentSpec
    from kvbench.workloads.registry import build_spec
    from kvbench.workloads.tokenizer import get_tokenizer

    tok = get_tokenizer()
    wl = build_spec("agent", AgentSpec(sessions=3, turns=4), tok, 5)
    reqs = list(wl.requests())
    assert [r.prefix_from_responses for r in reqs if r.turn == 0] == [False] * 3
    assert all(r.prefix_from_responses for r in reqs if r.turn > 0)
    prefixes = cache.shared_prefixes(wl, tok)
    assert len(prefixes) == 1  # the system message the three sessions open with
    first = reqs[0]
    assert tok.count_prompt(prefixes[0]) <= first.shared_prefix_tokens
    assert tok.render_prompt(first.messages).startswith(prefixes[0])


CONFIG = """
[suite]
name = "c"
results_dir = "{results}"
workloads = ["rag"]
otlp_listen = "127.0.0.1:0"

[[endpoints]]
name = "emu"
kind = "builtin"
topology = "colocated"
options = {options}

[workloads.rag]
kind = "rag"
requests = 40
documents = 4
top_k = 1
chunk_tokens = {{ dist = "constant", mean = 256 }}
output_tokens = {{ dist = "constant", mean = 2 }}

[profiles.a_reset]
pacing = "closed"
cache = "reset"
stages = [ {{ users = 1, duration_s = 1.5 }} ]

[profiles.b_warm]
pacing = "closed"
cache = "warm"
stages = [ {{ users = 1, duration_s = 1.5 }} ]

[profiles.c_as_is]
pacing = "closed"
cache = "as-is"
stages = [ {{ users = 1, duration_s = 1.5 }} ]
"""


def test_run_reset_then_warm_then_as_is(tmp_path):
    cfg = tmp_path / "bench.toml"
    options = "{ " + ", ".join(f"{k} = {v}" for k, v in OPTIONS.items()) + " }"
    cfg.write_text(CONFIG.format(results=tmp_path / "results", options=options))
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", "r"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr + p.stdout
    assert "cache: empty: reset by POST /reset_prefix_cache" in p.stdout
    res = load_results(tmp_path / "results" / "r")
    states = res.meta.cache_states
    assert [s.mode for s in states] == ["reset", "warm", "as-is"]
    assert states[1].primed_prefixes == 4 and states[2].reset is None
    t = res.requests.to_pandas().sort_values("t_sent")
    firsts = [t[(t.t_sent >= s.t_start_ns) & (t.t_sent <= s.t_end_ns)].iloc[0]
              for s in states]
    block = 16
    assert firsts[0].cached_tokens == 0  # reset: cold
    whole = firsts[1].shared_prefix_tokens // block * block
    assert firsts[1].cached_tokens >= whole > 0  # primed: its shared prefix is cached
    assert firsts[2].cached_tokens >= whole  # as-is after the warm run: still cached
    d = load([tmp_path / "results" / "r"])
    rows = cache_rows(d.runs, d.frame)
    for r in rows:  # records and engine counters agree to the token, and with the theory
        assert r["records_cached"] == r["engine_hits"] and r["records_prompt"] == \
            r["engine_prompt"], r
        assert r["findings"] == [], r
    # the OTLP receiver ran (the emulator exports no spans); spans a server would have sent
    # for two of the records then split their TTFT in the report
    assert "OTLP/HTTP traces received at http://127.0.0.1:" in p.stdout
    assert res.meta.telemetry["otlp"] == "no request spans received"
    ids = t.request_id.tolist()[:2]
    ttft = t.ttft_ns.tolist()[:2]
    w = ShardWriter(tmp_path / "results" / "r", "spans", tag="test")
    w.write(pa.RecordBatch.from_pylist([
        {"trace_request_id": f"cmpl-{i}-0", "queue_ns": 1_000, "prefill_ns": int(x * 0.5),
         "ttft_ns": int(x * 0.75)} for i, x in zip(ids, ttft)], schema=SPANS))
    w.close()
    md = subprocess.run([sys.executable, "-m", "kvbench", "report", str(tmp_path /
                        "results" / "r"), "--format", "md"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120).stdout
    assert "warm: empty, then 4 shared prefixes" in md
    assert "TTFT split by the server's own traces" in md and "| emu | 2 |" in md


def test_verify_diagnoses_disagreement():
    import pandas as pd

    from kvbench.core.contract import CacheState, CacheTheory

    frame = pd.DataFrame({"endpoint": pd.Categorical(["e"] * 50), "workload": ["w"] * 50,
                          "t_sent_ns": [10] * 50, "cancelled": [False] * 50,
                          "prompt_tokens": [100.0] * 50, "cached_tokens": [80.0] * 50})
    entry = CacheState(endpoint="e", workload="w", engine="vllm", t_start_ns=0, t_end_ns=20,
                       started_from="as-is: not reset",
                       counters_before={"hits": 0, "queries": 0, "prompt": 0},
                       counters_after={"hits": 4000, "queries": 5000, "prompt": 5000},
                       theoretical=CacheTheory(hit_ratio_unbounded=0.5, block_tokens=16))
    r = verify(entry, frame)
    assert r["records_ratio"] == r["engine_ratio"] == 0.8 and r["findings"][0].startswith(
        "measured hit ratio 80.0% is 30.0% above the theoretical 50.0%")
    (finding,) = as_findings([r, {**r, "findings": []}])  # one per disagreeing job
    assert finding.rule == "cache_verify" and "30.0% above" in finding.cause
    assert ("theoretical (requests sent)", "50.0%") in finding.evidence
    entry.counters_after["hits"] = 4500
    r = verify(entry, frame)
    assert any("another client" in x for x in r["findings"])
    # prompt and completion tokens against the engine's own counters, to the token
    entry.counters_after.update(hits=4000, generation=400)
    entry.counters_before["generation"] = 0
    frame["completion_tokens"] = 8.0
    r = verify(entry, frame)
    assert (r["records_prompt"], r["records_completion"]) == (5000, 400) == (
        r["engine_prompt"], r["engine_generation"])
    assert not [x for x in r["findings"] if "tokens" in x], r["findings"]
    entry.counters_after.update(prompt=5100, generation=410)
    found = [x for x in verify(entry, frame)["findings"] if "tokens" in x]
    assert found == ["records' prompt tokens 5,000 vs the engine's prompt-token counter 5,100 "
                     "(-100): another client used the endpoint during the job",
                     "records' completion tokens 400 vs the engine's generated-token counter "
                     "410 (-10): another client used the endpoint during the job"]
    frame["cached_tokens"] = float("nan")
    assert "no cached_tokens" in verify(entry, frame)["findings"][0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["alpha", "b", "gamma,", "delta.", "e-f", "ünï", "", "x"]),
                max_size=80), st.integers(0, 120))
def test_cut_to_tokens_is_the_longest_word_prefix_that_fits(words, n):
    from kvbench.workloads.tokenizer import get_tokenizer

    tok = get_tokenizer()
    text = " ".join(words)
    got = cache.cut_to_tokens(text, n, tok)
    if tok.count_prompt(text) <= n:
        assert got == text
        return
    ws = text.split(" ")
    best = max(k for k in range(len(ws) + 1) if tok.count_prompt(" ".join(ws[:k])) <= n
               or k == 0)
    assert got == " ".join(ws[:best])
