"""NVIDIA Dynamo, in front of TensorRT-LLM (or vLLM, SGLang) workers. Only names the Dynamo docs
list: the frontend's histograms count prompt and cached tokens per request, so their ``_sum``
samples are token counters (hits / prompt tokens is the hit ratio); the worker port adds the
``dynamo_component_*`` gauges.

Frontend and component names: https://docs.nvidia.com/dynamo/dev/observability/metrics-catalog
(ai-dynamo/dynamo docs/reference/observability/metrics-catalog.mdx). Worker KV usage and the
TensorRT-LLM ``trtllm_`` prefix: ai-dynamo/dynamo docs/observability/metrics-comparison.md.
A worker that also passes vLLM's or SGLang's own names through is detected as that engine (it
publishes more of them), which has the richer counters."""

from __future__ import annotations

from kvbench.engines.base import EngineAdapter, register

DYNAMO = register(EngineAdapter(
    name="dynamo", title="NVIDIA Dynamo / TensorRT-LLM",
    prefixes=("dynamo_frontend_", "dynamo_component_", "trtllm_"),
    prefix_hits="dynamo_frontend_cached_tokens_sum",  # histogram of cached tokens per request
    prefix_queries="dynamo_frontend_input_sequence_tokens_sum",  # input tokens per request
    prompt_tokens="dynamo_frontend_input_sequence_tokens_sum",
    generation_tokens="dynamo_frontend_output_tokens_total",
    kv_usage="dynamo_component_gpu_cache_usage_percent",  # worker port; a fraction 0..1
    running="dynamo_component_inflight_requests",  # worker port: requests being processed
    waiting="dynamo_frontend_queued_requests",  # deprecated in the catalog, still served
    notes=("worker metrics need DYN_SYSTEM_PORT; the frontend serves /metrics on its HTTP port",),
))
