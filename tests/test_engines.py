"""Engine adapters: which family a /metrics page belongs to, the hit-ratio arithmetic of each
family's counters, KV geometry from vLLM's cache_config labels, and each tokenize call."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbench import engines
from kvbench.engines.vllm import VLLM

# What each server's /metrics names look like (vLLM 0.32 and llama-server as seen in
# ../shared/ENGINES.md; SGLang from its metrics collector; Dynamo from its metrics catalog).
VLLM_NAMES = {
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_total", "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:cache_config_info", "python_gc_objects_collected_total", "process_cpu_seconds_total",
}
EMULATOR_NAMES = VLLM_NAMES | {"kvbench:kv_bytes_moved_total", "kvbench:kv_transfer_seconds_sum"}
SGLANG_NAMES = {
    "sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
    "sglang:cache_hit_rate", "sglang:time_to_first_token_seconds_bucket",
    "process_cpu_seconds_total",
}
LLAMACPP_NAMES = {
    "llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total",
    "llamacpp:tokens_predicted_total", "llamacpp:requests_processing",
    "llamacpp:requests_deferred", "llamacpp:prompt_seconds_total",
}
DYNAMO_FRONTEND_NAMES = {
    "dynamo_frontend_requests_total", "dynamo_frontend_active_requests",
    "dynamo_frontend_queued_requests", "dynamo_frontend_input_sequence_tokens_sum",
    "dynamo_frontend_cached_tokens_sum", "dynamo_frontend_output_tokens_total",
}
DYNAMO_VLLM_WORKER = VLLM_NAMES | {"dynamo_component_inflight_requests",
                                   "dynamo_component_gpu_cache_usage_percent",
                                   "dynamo_component_requests_total"}
DCGM_NAMES = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"}


@pytest.mark.parametrize("names, family", [
    (VLLM_NAMES, "vllm"),
    (EMULATOR_NAMES, "builtin"),  # vLLM's names plus kvbench: ones: the emulator wins
    (SGLANG_NAMES, "sglang"),
    (LLAMACPP_NAMES, "llamacpp"),
    (DYNAMO_FRONTEND_NAMES, "dynamo"),
    (DYNAMO_VLLM_WORKER, "vllm"),  # a worker passing vLLM's names through: vLLM's counters
    (DCGM_NAMES | VLLM_NAMES, "vllm"),  # the DCGM exporter beside an engine changes nothing
])
def test_detection(names, family):
    assert engines.detect(names).name == family


def test_detection_of_no_engine():
    assert engines.detect(DCGM_NAMES) is None and engines.detect([]) is None


def test_every_family_is_registered_and_owns_its_names():
    assert {a.name for a in engines.adapters()} >= {"vllm", "sglang", "llamacpp", "dynamo",
                                                    "builtin"}
    fields = ("prefix_hits", "prefix_queries", "prompt_tokens", "generation_tokens", "kv_usage",
              "running", "waiting", "preemptions", "cache_config")
    for a in engines.adapters():
        owner = VLLM if a.name == "builtin" else a  # the emulator publishes vLLM's names
        for f in fields:
            name = getattr(a, f)
            assert name is None or owner.owns(name), (a.name, f, name)


def test_hit_ratio_arithmetic():
    # vLLM counts every queried token; a repeated 4,001-token prompt hits 3,968 (ENGINES.md)
    assert engines.get("vllm").hit_ratio(3968, 4001) == pytest.approx(3968 / 4001)
    assert engines.get("sglang").hit_ratio(3968, 4001) == pytest.approx(3968 / 4001)
    # llama.cpp's prompt_tokens_total counts only what it computed: queries = hits + that
    llama = engines.get("llamacpp")
    assert llama.queries_exclude_hits
    assert llama.hit_ratio(3968, 33) == pytest.approx(3968 / 4001)
    assert llama.hit_ratio(0, 500) == 0.0
    for a in engines.adapters():
        assert a.hit_ratio(0, 0) is None  # no traffic in the window: no ratio
    assert engines.get("llamacpp").hit_counters() == ("llamacpp:prompt_tokens_cached_total",
                                                      "llamacpp:prompt_tokens_total")
    assert engines.get("dynamo").hit_counters() == ("dynamo_frontend_cached_tokens_sum",
                                                    "dynamo_frontend_input_sequence_tokens_sum")


def test_geometry_from_cache_config_labels():
    v = engines.get("vllm")
    labels = {"block_size": "16", "num_gpu_blocks": "2048", "gpu_memory_utilization": "0.9"}
    assert v.geometry(labels) == (16, 32768)
    assert engines.get("builtin").geometry({"block_size": "128", "num_gpu_blocks": "10.0"}) \
        == (128, 1280)
    assert v.geometry({"block_size": "16"}) is None  # a label missing
    assert v.geometry({"block_size": "x", "num_gpu_blocks": "1"}) is None
    assert engines.get("llamacpp").geometry(labels) is None  # no such gauge


def test_tokenize_bodies_and_counts():
    msgs = [{"role": "user", "content": "hi"}]
    for fam in ("vllm", "sglang", "builtin"):
        a = engines.get(fam)
        assert (a.tokenize.method, a.tokenize.path) == ("POST", "/tokenize")
        assert a.tokenize_body("m", "hello", None) == {"model": "m", "prompt": "hello"}
        assert a.tokenize_body("m", None, msgs) == {"model": "m", "messages": msgs}
        assert a.tokenize_count({"tokens": [1, 2, 3], "count": 3, "max_model_len": 8}) == 3
        assert a.tokenize_count({"tokens": [1, 2]}) == 2
        assert a.tokenize_count({}) is None
    llama = engines.get("llamacpp")
    assert llama.tokenize_body("m", "hello", None) == {"content": "hello"}
    assert llama.tokenize_count({"tokens": [5, 6, 7, 8]}) == 4
    assert llama.tokenize_count({"error": "x"}) is None
    assert llama.tokenize_body("m", None, msgs) is None  # no chat template here: fall back
    assert engines.get("dynamo").tokenize is None


def test_cache_reset_calls():
    assert (engines.get("vllm").reset_cache.method, engines.get("vllm").reset_cache.path) == \
        ("POST", "/reset_prefix_cache")
    assert engines.get("sglang").reset_cache.path == "/flush_cache"
    llama = engines.get("llamacpp")
    assert (llama.list_slots.method, llama.list_slots.path) == ("GET", "/slots")
    ids = llama.slot_ids([{"id": 0, "n_ctx": 8192}, {"id": 1, "n_ctx": 8192}])
    assert ids == [0, 1] and llama.slot_ids({"error": "slots disabled"}) == []
    assert [llama.reset_cache.path.format(slot=i) for i in ids] == \
        ["/slots/0?action=erase", "/slots/1?action=erase"]
    assert engines.get("builtin").reset_cache.path == "/reset_prefix_cache"  # the emulator's own


def test_duplicate_registration_is_an_error():
    assert engines.register(VLLM) is VLLM  # the same adapter again: nothing changes
    with pytest.raises(ValueError, match="'vllm' is registered twice"):
        engines.register(replace(VLLM, title="another vLLM"))
    with pytest.raises(KeyError, match="no engine adapter 'nope'"):
        engines.get("nope")
