"""The llama.cpp adapter against what a real llama-server sent (tests/data/llamacpp: a build of
vendor/llama.cpp 0c1e570 serving a tiny local model): its /metrics is recognised, its counters
give the hit ratio its responses' cached_tokens give, /tokenize and /slots read right, and the
client accounts its SSE streams (usage riding on the finish_reason chunk) without error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbench import engines
from kvbench.loadgen.timing.openai import StreamState
from kvbench.loadgen.timing.sse import SSEParser

DATA = Path(__file__).resolve().parent / "data" / "llamacpp"
LLAMA = engines.get("llamacpp")


def samples(name: str) -> dict[str, float]:
    text = (DATA / name).read_text()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def body(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_real_metrics_are_recognised_as_llamacpp():
    names = samples("01_start.metrics.txt")
    assert engines.detect(names).name == "llamacpp"
    for metric in (LLAMA.prefix_hits, LLAMA.prefix_queries, LLAMA.running, LLAMA.waiting,
                   LLAMA.generation_tokens):
        assert metric in names, metric


@pytest.mark.parametrize("first,last,replies", [
    ("02_after_cold_A", "03_after_repeat_A", ["03_repeat_A.body"]),
    ("02_after_cold_A", "04_after_prefix_C", ["03_repeat_A.body", "04_prefix_C.body"]),
    ("01_start", "04_after_prefix_C", ["02_cold_A.body", "03_repeat_A.body",
                                       "04_prefix_C.body"]),
])
def test_counter_hit_ratio_equals_the_responses_cached_share(first, last, replies):
    a, b = samples(f"{first}.metrics.txt"), samples(f"{last}.metrics.txt")
    hits, queries = LLAMA.hit_counters()
    ratio = LLAMA.hit_ratio(b[hits] - a[hits], b[queries] - a[queries])
    usage = [body(r)["usage"] for r in replies]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    prompt = sum(u["prompt_tokens"] for u in usage)
    assert ratio == pytest.approx(cached / prompt, abs=1e-12)
    # the other reading (prompt_tokens_total as every prompt token) would be wrong here
    assert (b[hits] - a[hits]) / (b[queries] - a[queries]) != pytest.approx(cached / prompt)


def test_tokenize_reply_counts_what_usage_counts():
    req = json.loads((DATA / "08g_tokenize_prompt_A.request.json").read_text())
    assert LLAMA.tokenize_body("tiny-llama", req["content"], None) == {"content": req["content"]}
    n = LLAMA.tokenize_count(body("08g_tokenize_prompt_A.body"))
    assert n == body("02_cold_A.body")["usage"]["prompt_tokens"] == 562


def test_slots_and_erase_replies():
    assert LLAMA.slot_ids(body("09b_slots.body")) == [0, 1]
    assert body("12_erase_slot0.body")["id_slot"] == 0
    assert LLAMA.reset_cache.path.format(slot=1) == "/slots/1?action=erase"
    models = body("14_v1_models.body")
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]


@pytest.mark.parametrize("name,cut", [("05_stream_completions.sse", 1),
                                      ("07_stream_chat.sse", 7), ("07_stream_chat.sse", 1000)])
def test_client_accounts_real_sse_streams(name, cut):
    raw = (DATA / name).read_bytes()
    parser, state = SSEParser(), StreamState(0)
    for i in range(0, len(raw), cut):  # any split of the bytes into socket reads
        state.on_events(parser.feed(raw[i:i + cut]), i)
    state.on_events(parser.finish(), len(raw))
    status, error = state.settle(body_complete=True)
    assert (status, error) == ("ok", None)
    assert state.completion_tokens == len(state.offsets_ns) > 0
    assert state.prompt_tokens > 0 and state.cached_tokens is not None
