"""The emulator's HTTP surface on a real socket: SSE and JSON formats, /metrics, routing
headers, faults, bad requests, `kvbench serve`, settings validation."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import orjson
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvbench import engines
from kvbench.model import costmodel as cm
from kvbench.endpoints.config import validate_options
from kvbench.endpoints.faults import parse_fault_header
from kvbench.endpoints.kvcache import HBMCache, block_hashes
from kvbench.endpoints.server import EmulatorServer
from emulator_client import request
from kvbench.workloads.text import TextFactory
from kvbench.workloads.tokenizer import get_tokenizer

TOK = get_tokenizer()
TEXT = TextFactory(TOK, seed=11)


def with_server(topology: str, fn, **options):
    async def go():
        srv = await EmulatorServer(validate_options(topology, {"time_scale": 0.05,
                                                               **options})).start()
        try:
            async with aiohttp.ClientSession() as s:
                return await fn(srv, s)
        finally:
            await srv.stop()
    return asyncio.run(go())


def test_streaming_completion_sse_format_and_usage():
    prompt = TEXT.segment("sse", 100)

    async def fn(srv, s):
        a = await request(s, srv.url, {"prompt": prompt, "max_tokens": 7, "stream": True,
                                       "stream_options": {"include_usage": True}})
        b = await request(s, srv.url, {"prompt": prompt, "max_tokens": 3, "stream": True})
        return a, b

    a, b = with_server("colocated", fn)
    assert a.status == 200 and a.headers["content-type"].startswith("text/event-stream")
    assert a.done and not a.bad_events
    token_events = [e for e in a.events if e["choices"]]
    assert len(token_events) == 7
    assert all(TOK.count(e["choices"][0]["text"]) == 1 for e in token_events)
    assert [e["choices"][0]["finish_reason"] for e in token_events][-2:] == [None, "length"]
    last = a.events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7
    assert last["usage"]["prompt_tokens"] == 100
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert TOK.count(a.text) == 7
    for name in ("queue", "prefill", "kv-transfer", "first-decode"):
        assert a.header_ms(name) >= 0
    assert a.headers["x-kvbench-replica"] in ("r0", "r1")
    assert a.headers["x-kvbench-region"] == "us-east-1"
    # without include_usage: no usage chunk; the repeated prompt hits the prefix cache
    assert b.usage is None and b.done and len(b.chunk_times_s) == 3


def test_chat_streaming_and_non_streaming():
    msgs = [{"role": "system", "content": TEXT.segment("sys", 40)},
            {"role": "user", "content": TEXT.segment("user", 20)}]

    async def fn(srv, s):
        a = await request(s, srv.url, {"messages": msgs, "max_tokens": 5, "stream": True,
                                       "stream_options": {"include_usage": True}}, chat=True)
        b = await request(s, srv.url, {"messages": msgs, "max_completion_tokens": 4}, chat=True)
        c = await request(s, srv.url, {"prompt": "hello there", "max_tokens": 2})
        return a, b, c

    a, b, c = with_server("colocated", fn, replicas=1)
    assert a.events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert a.events[0]["object"] == "chat.completion.chunk"
    assert a.usage["prompt_tokens"] == TOK.count_chat(msgs)
    assert TOK.count(a.text) == 5
    assert b.status == 200 and b.body["object"] == "chat.completion"
    assert b.body["choices"][0]["finish_reason"] == "length"
    assert b.usage["completion_tokens"] == 4 and TOK.count(b.text) == 4
    # the same conversation again: its full blocks are cached
    assert b.cached_tokens == (TOK.count_chat(msgs) - 1) // 16 * 16
    assert c.body["object"] == "text_completion" and c.usage["prompt_tokens"] == 2


def test_models_tokenize_health():
    async def fn(srv, s):
        async with s.get(srv.url + "/v1/models") as r:
            models = await r.json()
        async with s.post(srv.url + "/tokenize", json={"prompt": "alpha beta."}) as r:
            tok = await r.json()
        async with s.post(srv.url + "/tokenize",
                          json={"messages": [{"role": "user", "content": "hi"}]}) as r:
            tok_chat = await r.json()
        async with s.get(srv.url + "/health") as r:
            health = r.status
        return models, tok, tok_chat, health

    models, tok, tok_chat, health = with_server("offloaded", fn)
    m = models["data"][0]
    assert m["id"] == "kvbench-llama-3-70b" and m["max_model_len"] == 131072
    assert tok["count"] == 3 and len(tok["tokens"]) == 3
    assert tok_chat["count"] == TOK.count_chat([{"role": "user", "content": "hi"}])
    assert health == 200


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_parse_with_vllm_kvbench_and_dcgm_names():
    prompt = TEXT.segment("met", 600)

    async def fn(srv, s):
        await request(s, srv.url, {"prompt": prompt, "max_tokens": 4})
        await request(s, srv.url, {"prompt": prompt, "max_tokens": 4})
        async with s.get(srv.url + "/metrics") as r:
            return r.headers["content-type"], await r.text()

    ctype, text = with_server("disaggregated", fn)
    assert ctype.startswith("text/plain")
    fams = _families(text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "kvbench:kv_bytes_moved",
                 "kvbench:kv_transfer_seconds", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_SM_ACTIVE",
                 "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_DEV_FB_USED"):
        assert name in fams, name
    roles = {s.labels["role"] for s in fams["DCGM_FI_DEV_FB_USED"].samples}
    assert roles == {"prefill", "decode"}
    assert all("Hostname" in s.labels and "gpu" in s.labels
               for s in fams["DCGM_FI_PROF_SM_ACTIVE"].samples)
    hits = sum(s.value for s in fams["vllm:prefix_cache_hits"].samples)
    assert hits == 592  # the second request reused 37 full blocks on the prefill GPU
    moved = [s for s in fams["kvbench:kv_bytes_moved"].samples
             if s.labels["tier"] == "rdma" and s.labels["direction"] == "send"]
    assert sum(s.value for s in moved) == 2 * 600 * 125_000
    ttft = [s for s in fams["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_count")]
    assert sum(s.value for s in ttft) == 2


def test_metrics_carry_every_name_the_builtin_adapter_reads():
    """The emulator publishes what the built-in engine adapter reads, and the adapter finds the
    KV geometry the emulator was configured with."""
    async def fn(srv, s):
        await request(s, srv.url, {"prompt": TEXT.segment("adapter", 64), "max_tokens": 3})
        async with s.get(srv.url + "/metrics") as r:
            return await r.text()

    fams = _families(with_server("colocated", fn, replicas=1, kv_capacity_tokens=4096))
    samples = {smp.name: smp for f in fams.values() for smp in f.samples}
    a = engines.get("builtin")
    assert engines.detect(samples) is a
    for field in ("prefix_hits", "prefix_queries", "prompt_tokens", "generation_tokens",
                  "kv_usage", "running", "waiting", "preemptions", "cache_config"):
        assert getattr(a, field) in samples, field
    assert samples[a.prompt_tokens].value == 64 and samples[a.generation_tokens].value == 3
    assert a.geometry(samples[a.cache_config].labels) == (16, 4096)


def test_routed_residency_and_cross_region():
    prompt = TEXT.segment("route", 64)

    async def fn(srv, s):
        body = {"prompt": prompt, "max_tokens": 2, "stream": True}
        a = await request(s, srv.url, body, headers={"x-kvbench-region": "eu-west-1"})
        b = await request(s, srv.url, body, headers={"x-kvbench-region": "eu-west-1",
                                                     "x-kvbench-residency": "us-east-1"})
        c = await request(s, srv.url, body, headers={"x-kvbench-region": "mars-1"})
        return a, b, c

    a, b, c = with_server("routed", fn, router="GLOBAL")
    assert a.headers["x-kvbench-region"] == "eu-west-1"
    assert float(a.headers["x-kvbench-network-ms"]) == 0.0
    assert b.headers["x-kvbench-region"] == "us-east-1"  # residency wins over the cache
    assert float(b.headers["x-kvbench-network-ms"]) == pytest.approx(440 * 0.05)
    assert b.ttft_s >= 0.440 * 0.05
    assert c.status == 400 and "mars-1" in c.body["error"]["message"]


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (orjson.dumps({"max_tokens": 3}), 400, "prompt"),
    (orjson.dumps({"prompt": "hi", "max_tokens": -1}), 400, "max_tokens"),
    (orjson.dumps({"prompt": "hi", "max_tokens": "many"}), 400, "max_tokens"),
    (orjson.dumps({"prompt": "hi", "n": 2}), 400, "n"),
    (orjson.dumps({"prompt": "hi", "stream": "yes"}), 400, "stream"),
    (orjson.dumps({"prompt": "hi", "model": "gpt-9"}), 404, "model"),
    (orjson.dumps({"prompt": "word " * 200, "max_tokens": 10}), 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors_and_server_survives(body, status, param):
    async def fn(srv, s):
        async with s.post(srv.url + "/v1/completions", data=body,
                          headers={"Content-Type": "application/json"}) as r:
            out = (r.status, await r.json())
        async with s.get(srv.url + "/v1/nothing") as r:
            missing = (r.status, await r.json())
        ok = await request(s, srv.url, {"prompt": "still alive", "max_tokens": 2})
        return out, missing, ok

    (st_, err), missing, ok = with_server("colocated", fn, max_model_len=128)
    assert st_ == status
    assert set(err["error"]) >= {"message", "type", "code"} and err["error"]["code"] == status
    assert err["error"]["param"] == param
    assert missing[0] == 404 and missing[1]["error"]["code"] == 404
    assert ok.status == 200


def test_prompt_larger_than_kv_capacity_is_rejected():
    async def fn(srv, s):
        return await request(s, srv.url, {"prompt": TEXT.segment("big", 400), "max_tokens": 2})

    rep = with_server("colocated", fn, kv_capacity_tokens=256)
    assert rep.status == 400 and "KV cache" in rep.body["error"]["message"]


def test_faults_by_header():
    prompt = TEXT.segment("fault", 32)
    body = {"prompt": prompt, "max_tokens": 8, "stream": True}

    async def fn(srv, s):
        out = {}
        for f in ("error=503", "rate_limit", "stall_before=300", "stall_mid=300", "reset",
                  "malformed", "slow_headers=300", "bogus"):
            out[f] = await request(s, srv.url, body, headers={"x-kvbench-fault": f})
        out["none"] = await request(s, srv.url, body)
        return out

    out = with_server("colocated", fn)
    assert out["error=503"].status == 503 and out["error=503"].body["error"]["code"] == 503
    assert out["rate_limit"].status == 429 and out["rate_limit"].headers["retry-after"] == "1"
    assert out["stall_before=300"].ttft_s >= 0.3 > out["none"].ttft_s
    gaps = [b - a for a, b in zip(out["stall_mid=300"].chunk_times_s,
                                  out["stall_mid=300"].chunk_times_s[1:])]
    assert max(gaps) >= 0.29 and out["stall_mid=300"].done
    assert out["reset"].error is not None and not out["reset"].done
    assert 0 < len(out["reset"].chunk_times_s) < 8
    assert len(out["malformed"].bad_events) == 1 and out["malformed"].done
    assert out["slow_headers=300"].ttft_s >= 0.3
    assert out["bogus"].status == 400
    assert out["none"].status == 200 and out["none"].done


def test_faults_by_config_rate():
    async def fn(srv, s):
        return [await request(s, srv.url, {"prompt": "x y", "max_tokens": 2})
                for _ in range(5)]

    reps = with_server("colocated", fn, faults={"error_rate": 1.0, "error_statuses": [502]})
    assert [r.status for r in reps] == [502] * 5


def test_client_disconnect_frees_the_sequence():
    async def fn(srv, s):
        async with s.post(srv.url + "/v1/completions",
                          json={"prompt": "a b c", "max_tokens": 10_000, "stream": True}) as r:
            await r.content.readline()
        for _ in range(100):
            eng = srv.cluster.engines
            if all(e.num_running == 0 for e in eng):
                return True
            await asyncio.sleep(0.01)
        return False

    assert with_server("colocated", fn, time_scale=0.01)


def test_queued_request_whose_client_left_leaves_the_queue():
    """A request still waiting for a slot is dropped when its client disconnects, as vLLM
    aborts it, instead of being prefilled later for nobody (a cut probe's backlog)."""
    async def fn(srv, s):
        eng = srv.cluster.engines[0]
        # a long answer holds the only slot for far longer than the test waits
        hold = asyncio.create_task(request(s, srv.url, {"prompt": "a b c",
                                                        "max_tokens": 20_000}))
        for _ in range(500):
            if eng.num_running == 1:
                break
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(request(s, srv.url, {"prompt": "d e f", "max_tokens": 5,
                                                          "stream": True}))
        for _ in range(500):
            if eng.num_waiting == 1:
                break
            await asyncio.sleep(0.01)
        waited = eng.num_waiting
        queued.cancel()  # the client goes away: its connection closes
        for _ in range(500):
            if eng.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        left = eng.num_waiting, eng.num_running, hold.done()
        hold.cancel()
        return waited, left

    waited, (waiting, running, hold_done) = with_server(
        "colocated", fn, max_num_seqs=1, replicas=1, time_scale=0.2)
    assert waited == 1
    assert (waiting, running, hold_done) == (0, 1, False)  # gone while the slot was still busy


def test_kvbench_serve_prints_listening_line_and_stops_on_sigterm():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "serve", "--topology", "routed",
                             "--port", "0", "--options-json", '{"time_scale": 0.05}'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("kvbench serve: listening on http://127.0.0.1:")
        assert line.endswith("(topology routed)")
        url = line.split(" on ")[1].split(" ")[0]

        async def ping():
            async with aiohttp.ClientSession() as s:
                return await request(s, url, {"prompt": "ping", "max_tokens": 2})
        assert asyncio.run(ping()).status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kvbench_serve_bad_options_one_sentence():
    out = subprocess.run([sys.executable, "-m", "kvbench", "serve", "--options-json",
                          '{"slowdown": -1}'], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "field slowdown" in out.stderr and "Traceback" not in out.stderr


def test_validate_options():
    cfg = validate_options("offloaded", {"slowdown": 1.2, "time_scale": 0.5,
                                         "offload": "CPU_OFFLOAD"})
    assert cfg.topology == "offloaded" and cfg.slowdown == 1.2
    res = cfg.resolved()
    assert res.prefill_tok_per_ms == 40.0 and res.kv_bytes_per_token == 125_000
    assert validate_options("colocated", {"model": "llama-3-8b"}).resolved() \
        .kv_bytes_per_token == 2 * 32 * 8 * 128 * 1
    for bad in ({"slowdwn": 1}, {"slowdown": 0}, {"router": "RANDOM"},
                {"topology": "routed"}, {"hardware": "h100", "weight_dtype": "bf16"},
                {"faults": {"error_statuses": [200]}}):
        with pytest.raises(pydantic.ValidationError):
            validate_options("colocated", bad)


def test_slowdown_stretches_steps():
    prompt = TEXT.segment("slow", 64)

    async def fn(srv, s):
        rep = await request(s, srv.url, {"prompt": prompt, "max_tokens": 20, "stream": True})
        return rep, [x for e in srv.cluster.engines for x in e.done_log]

    (base, blog), (slow, slog) = (with_server("colocated", fn, time_scale=0.2),
                                  with_server("colocated", fn, time_scale=0.2, slowdown=1.5))
    assert base.status == slow.status == 200 and len(blog) == len(slog) == 1
    # the server's modelled decode time (the steps as planned, not a busy host's wake-ups)
    ratio = slog[0][2] / blog[0][2]
    assert abs(ratio - 1.5) < 0.01, ratio


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["ab", "cd", "ef", ".", "gh"]), min_size=0, max_size=80),
       st.integers(min_value=0, max_value=80))
def test_block_hashes_are_prefix_consistent(tokens, cut):
    full = block_hashes(tokens, 16)
    part = block_hashes(tokens[:cut], 16)
    assert full[:len(part)] == part and len(full) == len(tokens) // 16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), max_size=40))
def test_hbm_cache_never_exceeds_capacity(ops):
    cache = HBMCache(12)
    held: list[tuple[list[int], int]] = []
    for kind, n in ops:
        if kind == 0 and cache.allocate(n):
            held.append(([], n))
        elif kind == 1 and held:
            hashes, anon = held.pop(0)
            cache.release(hashes, anon)
        elif kind == 2 and cache.allocate(n):
            hs = [hash(("b", len(held), i)) for i in range(n)]
            cache.register(hs)
            held.append((hs, 0))
        assert 0 <= cache.used_blocks <= cache.capacity_blocks
        assert cache.active_blocks <= cache.used_blocks


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200_000), st.integers(1, 200_000))
def test_costmodel_monotone(a, b):
    lo, hi = sorted((a, b))
    assert cm.kv_transfer_ms(lo) <= cm.kv_transfer_ms(hi)
    assert cm.kv_transfer_ms(lo, True) < cm.kv_transfer_ms(lo, False)
    assert cm.ms_disaggregated(lo, 64, True) <= cm.ms_disaggregated(lo, 64, False)
    assert cm.ttft_ms(hi, lo) <= cm.ttft_ms(hi, 0) + 1e-9


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10_000), st.floats(0, 1), st.integers(0, 50), st.integers(1, 64))
def test_expected_speedup_bounded_by_workers(t, p, c, n):
    assert 0 < cm.expected_speedup(t, p, c, n, 1) <= n + 1e-9


def test_crossover_and_break_even():
    x = cm.pd_crossover_prompt_tokens(200)
    assert 0.85 * 512 <= x <= 1.15 * 512
    assert cm.pd_crossover_prompt_tokens(200, use_rdma=False) > x
    assert cm.ms_disaggregated(x - 50, 200) > cm.ms_colocated(x - 50, 200)
    assert cm.ms_disaggregated(4 * x, 200) < cm.ms_colocated(4 * x, 200)
    be = cm.offload_break_even(4096, "dram")
    assert be["offload_wins"] and be["load_ms"] < be["recompute_ms"]
    assert cm.kv_bytes("llama-3-70b", 4096, "bf16") == 80 * 8 * 128 * 4096 * 2 * 2
    r = {s: cm.simulate_routing(s)["hit_rate"] for s in cm.ROUTER_STRATEGIES}
    assert r["ROUND_ROBIN"] < 0.15 and r["ROUND_ROBIN"] < r["REGIONAL"] < r["GLOBAL"]
    assert cm.router_ttft_ms(False, True) == 800 + 440
    assert cm.cross_region_worth_it()


def test_kvbench_plan_prints_the_comparisons():
    out = subprocess.run([sys.executable, "-m", "kvbench", "plan"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for word in ("ROUND_ROBIN", "REGIONAL", "GLOBAL", "NATIVE_ONLY", "CPU_OFFLOAD", "LMCACHE",
                 "crossover", "disagg TCP", "Hogwild!", "1.80x"):
        assert word in out.stdout, word
    js = subprocess.run([sys.executable, "-m", "kvbench", "plan", "--json"],
                        capture_output=True, text=True, timeout=60)
    d = orjson.loads(js.stdout)
    assert [r["coordination_weight"] for r in d["hogwild_sweep"]] == [0.0, 0.2, 0.5, 0.8, 1.0]


def test_fault_header_parser():
    cfg = validate_options("colocated", {})
    f = parse_fault_header("error=502, stall_mid=10,reset", cfg)
    assert f.error == 502 and f.stall_mid_ms == 10 and f.reset
    assert parse_fault_header("error", cfg).error == 500
