"""SGLang. Names from its metrics collector (sgl-project/sglang,
python/sglang/srt/metrics/collector.py): the tokenizer manager counts, per finished request,
every prompt token (``prompt_tokens_total``) and the cached ones among them
(``cached_tokens_total``, published once a hit happened), so hits / prompt tokens is the
hit ratio."""

from __future__ import annotations

from kvbench.engines.base import EngineAdapter, HttpCall, register
from kvbench.engines.vllm import tokenize_body, tokenize_count  # the same /tokenize request

SGLANG = register(EngineAdapter(
    name="sglang", title="SGLang", prefixes=("sglang:",),
    prefix_hits="sglang:cached_tokens_total",
    prefix_queries="sglang:prompt_tokens_total",
    prompt_tokens="sglang:prompt_tokens_total",
    generation_tokens="sglang:generation_tokens_total",
    default_block_tokens=1,  # the radix cache's --page-size defaults to 1 token
    kv_usage="sglang:token_usage",  # fraction of the KV token pool in use
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    preemptions="sglang:num_retracted_requests_total",  # retractions: SGLang's preemption
    tokenize=HttpCall("POST", "/tokenize"), tokenize_body=tokenize_body,
    tokenize_count=tokenize_count,  # {"tokens": [...], "count": n}
    reset_cache=HttpCall("POST", "/flush_cache",
                         "not flushed while requests are pending; flush between runs"),
    notes=("metrics need --enable-metrics",),
))
