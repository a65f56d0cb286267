"""vLLM (V1 engine). Names as served by vLLM 0.32 (``../shared/ENGINES.md``)."""

from __future__ import annotations

from kvbench.engines.base import EngineAdapter, HttpCall, register


def _geometry(labels) -> tuple[int, int] | None:
    block = int(float(labels["block_size"]))
    return block, int(float(labels["num_gpu_blocks"])) * block


def tokenize_body(model: str, prompt: str | None, messages: list | None) -> dict:
    body: dict = {"model": model}
    if messages is not None:
        body["messages"] = list(messages)
    else:
        body["prompt"] = prompt
    return body


def tokenize_count(reply: dict) -> int | None:
    n = reply.get("count")
    if n is None and isinstance(reply.get("tokens"), list):
        n = len(reply["tokens"])
    return int(n) if n is not None else None


VLLM = register(EngineAdapter(
    name="vllm", title="vLLM", prefixes=("vllm:",),
    prefix_hits="vllm:prefix_cache_hits_total",
    prefix_queries="vllm:prefix_cache_queries_total",
    # Hits from a KV connector's tiers (CPU offload, LMCache), beyond the HBM prefix cache:
    # vLLM's own connector counters first (its scheduler counts, per request, the tokens the
    # connector supplied after the local hits); else LMCache's, which it exports on the same
    # /metrics (counter "lmcache:num_hit_tokens", sampled with _total, beside
    # "lmcache:num_requested_tokens": LMCache's lmcache/observability.py and its
    # "Metrics Reference" page). Both name the same hits where both are present.
    tier_hits=("vllm:external_prefix_cache_hits_total", "lmcache:num_hit_tokens_total"),
    prompt_tokens="vllm:prompt_tokens_total",
    generation_tokens="vllm:generation_tokens_total",
    kv_usage="vllm:kv_cache_usage_perc",  # a fraction despite its name
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    preemptions="vllm:num_preemptions_total",
    cache_config="vllm:cache_config_info", cache_config_geometry=_geometry,
    tokenize=HttpCall("POST", "/tokenize"), tokenize_body=tokenize_body,
    tokenize_count=tokenize_count,
    reset_cache=HttpCall("POST", "/reset_prefix_cache",
                         "served only in vLLM's dev mode (VLLM_SERVER_DEV_MODE=1)"),
))
