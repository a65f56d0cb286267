"""A small aiohttp server for collector tests that serves vLLM-, SGLang-, LMCache-, Dynamo-,
llama.cpp- and DCGM-style ``/metrics`` text whose counters grow on every scrape."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


def exposition(n: int) -> str:
    """Prometheus text of scrape number ``n`` (counters grow with n)."""
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {n % 5}',
        "# TYPE vllm:prefix_cache_hits_total counter",
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {3968.0 * n}',
        "# TYPE vllm:prefix_cache_queries_total counter",
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {4001.0 * n}',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {min(1.0, 0.1 * n)}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{le="0.1",model_name="tiny"}} {n}',
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="tiny"}} {2 * n}',
        f'vllm:time_to_first_token_seconds_sum{{model_name="tiny"}} {0.3 * n}',
        f'vllm:time_to_first_token_seconds_count{{model_name="tiny"}} {2 * n}',
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs {n % 3}",
        "# TYPE lmcache:num_hit_tokens counter",
        f"lmcache:num_hit_tokens_total {100 * n}",
        "# TYPE dynamo_frontend_requests counter",
        f'dynamo_frontend_requests_total{{model="tiny"}} {n}',
        "# TYPE llamacpp:prompt_tokens_total counter",
        f"llamacpp:prompt_tokens_total {10 * n}",
    ]
    for gpu, role in ((0, "prefill"), (1, "decode")):
        lab = f'gpu="{gpu}",UUID="GPU-{gpu}",Hostname="node-a",role="{role}"'
        lines += [
            f"DCGM_FI_DEV_GPU_UTIL{{{lab}}} {40 + gpu}",
            f"DCGM_FI_PROF_SM_ACTIVE{{{lab}}} {0.5 + 0.1 * gpu}",
            f"DCGM_FI_PROF_SM_OCCUPANCY{{{lab}}} 0.25",
            f"DCGM_FI_PROF_DRAM_ACTIVE{{{lab}}} 0.75",
            f"DCGM_FI_DEV_FB_USED{{{lab}}} 1000",
            f"DCGM_FI_DEV_FB_FREE{{{lab}}} 3000",
            f"DCGM_FI_DEV_POWER_USAGE{{{lab}}} 412.5",
            f"DCGM_FI_DEV_SM_CLOCK{{{lab}}} 1755",
            f"DCGM_FI_DEV_GPU_TEMP{{{lab}}} 55",
            f"DCGM_FI_PROF_PCIE_RX_BYTES{{{lab}}} 1.5e9",
            f"DCGM_FI_PROF_PCIE_TX_BYTES{{{lab}}} 2.5e9",
        ]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``/metrics`` (good), ``/broken`` (HTTP 500) and ``/garbage`` on 127.0.0.1."""

    def __init__(self):
        self.scrapes = 0
        self.port = None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def _metrics(self, request):
        self.scrapes += 1
        return web.Response(text=exposition(self.scrapes),
                            content_type="text/plain", charset="utf-8")

    async def _broken(self, request):
        return web.Response(status=500, text="boom")

    async def _garbage(self, request):
        return web.Response(text="this is {not prometheus\n")

    def _serve(self):
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/broken", self._broken)
        app.router.add_get("/garbage", self._garbage)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc):
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
