"""Chunks that carry several tokens (speculative decoding, vLLM's stream interval, SGLang):
usage gives the count, the tokenizer spreads it over the chunks, and TPOT uses usage."""

import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
from hypothesis import given, settings
from hypothesis import strategies as st

import stream_server as testing
from kvbench.loadgen.timing.openai import StreamState, apportion
from kvbench.reports.statistics.metrics import request_frame
from kvbench.workloads.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
WORDS = get_tokenizer().single_token_words()[:50]


def ev(obj):
    return (None, orjson.dumps(obj))


def piece(text, chat_api, finish=None):
    if chat_api:
        return ev({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})
    return ev({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def end(n):
    return [ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}),
            (None, b"[DONE]")]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(0, 200))
def test_apportion_sums_exactly_and_every_chunk_gets_one(weights, extra):
    total = len(weights) + extra
    alloc = apportion(weights, total)
    assert sum(alloc) == total and min(alloc) >= 1 and len(alloc) == len(weights)
    w = [x or 1 for x in weights]
    quotas = [total * x / sum(w) for x in w]
    if min(quotas) >= 1:  # nothing raised to the floor: plain largest remainder
        assert all(abs(a - q) < 1 for a, q in zip(alloc, quotas))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=40), st.booleans(), st.data())
def test_multi_token_chunks_are_ok_and_sum_to_usage(per_chunk, chat_api, data):
    texts = ["".join(" " + data.draw(st.sampled_from(WORDS)) for _ in range(k))
             for k in per_chunk]
    n = sum(per_chunk)
    s = StreamState(0)
    for i, t in enumerate(texts):
        s.on_events([piece(t, chat_api)], 10 * (i + 1))
    s.on_events([piece("", chat_api, "length")] + end(n), 10 * len(texts) + 5)
    assert s.settle(True) == ("ok", None)
    assert s.tokens == per_chunk  # the words are single tokens: the estimate is exact
    assert s.completion_tokens == n == s.completion_tokens_client
    assert s.offsets_ns == [10 * (i + 1) for i in range(len(texts))]  # one gap per chunk


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=" ab.,\u00e9", max_size=12), min_size=1, max_size=25),
       st.integers(0, 60))
def test_any_text_any_usage_above_the_chunk_count(texts, extra):
    """Server tokenization may differ from ours (or text may be empty): still exact sums."""
    s = StreamState(0, keep_text=True)
    for i, t in enumerate(texts):
        s.on_events([piece(t, False)], i)
    n = len(texts) + extra
    s.on_events([piece("", False, "stop")] + end(n), 99)
    assert s.settle(True) == ("ok", None)
    assert sum(s.tokens) == n and min(s.tokens) >= 1 and len(s.tokens) == len(s.offsets_ns)
    assert s.text == "".join(texts)
    if len(s.tokens) < n:  # tokens estimated: the client's check is the tokenizer's count
        assert s.completion_tokens_client == get_tokenizer().count("".join(texts))
    else:  # one token a chunk (the EOS chunk counted when usage is one more)
        assert s.completion_tokens_client == n and s.tokens == [1] * n


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 30), st.data())
def test_more_chunks_than_tokens_stays_an_error(k, data):
    n = data.draw(st.integers(1, k - 1))
    s = StreamState(0)
    s.on_events([piece(" tok tok", True) for _ in range(k)] + end(n), 5)
    assert s.settle(True) == ("protocol_error", f"usage reports {n} tokens but {k} "
                              "token-carrying chunks arrived")
    assert s.tokens == [1] * k


def test_no_usage_keeps_the_client_count():
    s = StreamState(0)
    s.on_events([piece(" a b c", True), piece(" d e", True, "stop"), (None, b"[DONE]")], 5)
    assert s.settle(True) == ("ok", None)
    assert s.tokens == [1, 1] and s.completion_tokens_client == 2


def test_eos_finish_chunk_still_counted_when_usage_says_so():
    s = StreamState(0)
    s.on_events([piece(" a", True), piece(" b", True)], 5)
    s.on_events([piece("", True, "stop")] + end(3), 9)
    assert s.settle(True) == ("ok", None)
    assert s.tokens == [1, 1, 1] and s.offsets_ns == [5, 5, 9]


def test_explicit_tokenizer_is_used():
    class Chars:
        def count(self, text):
            return len(text)

    s = StreamState(0, tokenizer=Chars())
    s.on_events([piece("abc", False), piece("d", False, "stop")] + end(8), 5)
    assert s.settle(True) == ("ok", None)
    assert s.tokens == [6, 2] and s.completion_tokens_client == 4


# ---- against the test server, through the client and a headless Locust run

SCRIPT = textwrap.dedent("""
    from gevent import monkey; monkey.patch_all()
    import sys, orjson
    from kvbench.loadgen.timing.client import ConnectionPool, StreamingClient, Target
    url = sys.argv[1]
    c = StreamingClient(ConnectionPool(Target.parse(url)), deadline_s=10)
    out = {}
    for name, path, body, hdr in [
        ("chat3", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
         {"x-test-chunk-tokens": "3"}),
        ("text4", "/v1/completions", {"prompt": "a b c"}, {"x-test-chunk-tokens": "4"}),
        ("fewer", "/v1/completions", {"prompt": "a b c"}, {"x-test-fault": "mismatch"}),
    ]:
        body.update(model="test-model", max_tokens=10, stream=True,
                    stream_options={"include_usage": True})
        r = c.post_stream(path, orjson.dumps(body), headers=hdr)
        out[name] = [r.status, r.error, r.tokens, r.completion_tokens,
                     r.completion_tokens_client, len(r.offsets_ns)]
    sys.stdout.write(orjson.dumps(out).decode())
""")


def test_client_against_a_server_sending_k_tokens_a_chunk():
    proc, url = testing.start(ttft_ms=10, itl_ms=5)
    try:
        p = subprocess.run([sys.executable, "-c", SCRIPT, url], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    finally:
        testing.stop(proc)
    assert p.returncode == 0, p.stderr
    out = orjson.loads(p.stdout)
    assert out["chat3"] == ["ok", None, [3, 3, 3, 1], 10, 10, 4]
    assert out["text4"] == ["ok", None, [4, 4, 2], 10, 10, 3]
    assert out["fewer"][0] == "protocol_error"
    assert out["fewer"][1] == "usage reports 9 tokens but 10 token-carrying chunks arrived"


CONFIG = """
[suite]
name = "t"
seed = 1

[[endpoints]]
name = "test"
kind = "openai"
url = "{url}"
model = "test-model"
topology = "colocated"
headers = {{ x-test-chunk-tokens = "3" }}

[workloads.rag]
kind = "rag"
requests = 30
documents = 6
chunk_tokens = {{ dist = "constant", mean = 40 }}
output_tokens = {{ dist = "constant", mean = 9 }}

[profiles.closed]
pacing = "closed"
stages = [ {{ users = 2, duration_s = 2 }} ]
"""


def test_locust_records_multi_token_chunks_and_tpot_uses_usage(tmp_path):
    proc, url = testing.start(ttft_ms=10, itl_ms=20)
    try:
        cfg = tmp_path / "bench.toml"
        cfg.write_text(CONFIG.format(url=url))
        p = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadgen/rag.py", "--headless", "--host", url,
             "-u", "2", "-r", "2", "-t", "2s", "--only-summary", "--kvbench-config", str(cfg),
             "--kvbench-results", str(tmp_path), "--kvbench-run-id", "mt",
             "--kvbench-endpoint", "test"],
            cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        testing.stop(proc)
    assert p.returncode == 0, p.stdout + p.stderr
    t = read_run_table(tmp_path / "mt", "requests")
    rows = [r for r in t.to_pylist() if r["status"] != "cancelled"]
    assert rows and all(r["status"] == "ok" for r in rows), rows[:3]
    for r in rows:
        assert r["chunk_tokens"] == [3, 3, 3] and r["completion_tokens"] == 9
        assert r["completion_tokens_client"] == 9 and len(r["chunk_offsets_ns"]) == 3
    frame = request_frame(t)
    ok = frame[frame["status"] == "ok"]
    span_ms = (ok["e2e_ms"] - ok["ttft_ms"]).to_numpy()
    assert abs(ok["tpot_ms"].to_numpy() - span_ms / 8).max() < 1e-9  # 9 tokens: 8 intervals
    # the server's first tick comes 0-20 ms after the first chunk, the next 20 ms later: TPOT
    # is 2.5-5 ms; counting chunks as tokens would say 10-20 ms
    tpot = sorted(ok["tpot_ms"])
    assert 2.0 < tpot[len(tpot) // 2] < 6.0, tpot
