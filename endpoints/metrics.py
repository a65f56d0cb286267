"""``/metrics`` in Prometheus text format: vLLM's engine names per simulated engine, kvbench's
KV-movement series, and DCGM-exporter names per simulated GPU (with a role label).

The names the engine adapters read (prefix cache, tokens, KV usage, queue, preemptions, cache
config) come from the built-in adapter, so the emulator and its readers cannot drift."""

from __future__ import annotations

import asyncio

from kvbench import engines
from kvbench.endpoints.cluster import Cluster
from kvbench.endpoints.engine import Engine
from kvbench.endpoints.histogram import Histogram
from kvbench.model.profiles import HARDWARE

MIB = 1024 * 1024
# the offload tiers' sizes: what the cache check's theoretical hit ratio models below HBM
TIER_CAPACITY = "kvbench:kv_tier_capacity_tokens"
ADAPTER = engines.get("builtin")


_PCIE_LAST: dict[int, tuple[float, float]] = {}  # engine -> (loop time s, bytes moved)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: dict) -> str:
    return "{" + ",".join(f'{k}="{_esc(str(v))}"' for k, v in d.items()) + "}"


def _num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if isinstance(v, int) or float(v).is_integer():
        return repr(float(v))
    return repr(float(v))


class _Out:
    def __init__(self):
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: dict, value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {_num(value)}")

    def hist(self, name: str, labels: dict, h: Histogram) -> None:
        acc = 0
        for edge, c in zip(h.edges, h.counts):
            acc += c
            self.sample(f"{name}_bucket", {**labels, "le": _num(edge)}, acc)
        self.sample(f"{name}_bucket", {**labels, "le": "+Inf"}, h.count)
        self.sample(f"{name}_sum", labels, h.sum)
        self.sample(f"{name}_count", labels, h.count)


def render(cluster: Cluster) -> str:
    res = cluster.res
    cfg = res.cfg
    engines = cluster.engines
    out = _Out()

    def lab(e: Engine) -> dict:
        return {"model_name": cfg.model_name, "engine": e.name, "role": e.role,
                "region": e.region}

    a = ADAPTER
    gauges = [
        (a.running, "Number of requests in model execution batches.", lambda e: e.num_running),
        (a.waiting, "Number of requests waiting to be processed.", lambda e: e.num_waiting),
        (a.kv_usage, "KV-cache usage. 1 means 100 percent usage.", lambda e: e.kv_usage()),
    ]
    for name, help_text, fn in gauges:
        out.family(name, "gauge", help_text)
        for e in engines:
            out.sample(name, lab(e), fn(e))
    # Counter sample names end in _total; prometheus_client's 0.0.4 exposition (vLLM's) writes
    # the HELP and TYPE lines with the same suffixed name, so the adapter's names serve as is.
    counters = [
        (a.prefix_queries, "Prefix cache queries, in number of queried tokens.",
         lambda e: e.prefix_queries),
        (a.prefix_hits, "Prefix cache hits, in number of cached tokens.",
         lambda e: e.prefix_hits),
        ("vllm:external_prefix_cache_queries_total",
         "External (offloaded tier) prefix cache queries, in tokens.",
         lambda e: e.external_queries),
        ("vllm:external_prefix_cache_hits_total",
         "External (offloaded tier) prefix cache hits, in tokens.",
         lambda e: e.external_hits),
        (a.preemptions, "Cumulative number of preemptions from the engine.",
         lambda e: e.preemptions),
        (a.prompt_tokens, "Number of prefill tokens processed.", lambda e: e.prompt_tokens),
        (a.generation_tokens, "Number of generation tokens processed.",
         lambda e: e.generation_tokens),
    ]
    for name, help_text, fn in counters:
        out.family(name, "counter", help_text)
        for e in engines:
            out.sample(name, lab(e), fn(e))
    out.family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
    for e in engines:
        out.sample("vllm:request_success_total", {**lab(e), "finished_reason": "length"},
                   e.finished_ok)
    for name, help_text, attr in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             "ttft"),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             "itl"),
            ("vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", "e2e"),
            ("vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", "queue_time")):
        out.family(name, "histogram", help_text)
        for e in engines:
            if e.role == "prefill" and attr != "queue_time":
                continue
            out.hist(name, lab(e), getattr(e, attr))
    out.family(a.cache_config, "gauge", "Information of the LLMEngine CacheConfig.")
    out.sample(a.cache_config, {
        "model_name": cfg.model_name, "block_size": cfg.block_tokens,
        "enable_prefix_caching": "True", "num_gpu_blocks": res.capacity_blocks,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "cache_dtype": cfg.kv_dtype, "kv_offloading": cfg.offload
        if cluster.topology.offloads_kv else "NATIVE_ONLY"}, 1)

    # kvbench's own series
    out.family("kvbench:kv_bytes_moved_total", "counter",
               "KV bytes moved between tiers or pools (tier: dram, disk, rdma, tcp).")
    for e in engines:
        for (tier, direction), v in sorted(e.bytes_moved.items()):
            out.sample("kvbench:kv_bytes_moved_total",
                       {"engine": e.name, "tier": tier, "direction": direction}, v)
    out.family("kvbench:kv_transfer_seconds_total", "counter",
               "Modelled seconds spent moving KV (P/D transfers, lower-tier loads).")
    for e in engines:
        for tier, v in sorted(e.transfer_seconds.items()):
            out.sample("kvbench:kv_transfer_seconds_total", {"engine": e.name, "tier": tier}, v)
    out.family("kvbench:kv_capacity_tokens", "gauge", "KV capacity of one GPU, in tokens.")
    for e in engines:
        out.sample("kvbench:kv_capacity_tokens", {"engine": e.name},
                   e.cache.capacity_blocks * cfg.block_tokens)
    out.family(TIER_CAPACITY, "gauge",
               "KV capacity of one engine's offload tiers below HBM (tier: dram, disk), in "
               "tokens.")
    for e in engines:
        for tier in (e.dram, e.disk):
            if tier is not None:
                out.sample(TIER_CAPACITY, {"engine": e.name, "tier": tier.name},
                           tier.capacity_blocks * cfg.block_tokens)
    out.family("kvbench:step_lateness_seconds", "histogram",
               "How late each engine step ended against its modelled duration.")
    for e in engines:
        out.hist("kvbench:step_lateness_seconds", {"engine": e.name}, e.lateness)
    out.family("kvbench:steps_total", "counter", "Engine steps run.")
    for e in engines:
        out.sample("kvbench:steps_total", {"engine": e.name}, e.steps)

    # DCGM-exporter names, one simulated GPU per engine.
    now = asyncio.get_running_loop().time()
    hw_total = res.hbm_bytes
    hwp = HARDWARE[cfg.hardware]
    rows = []
    for e in engines:
        busy, sm, dram = e.utilization(now)
        fb_used = res.weight_bytes + e.cache.used_blocks * res.block_bytes
        dl = {"gpu": str(e.gpu), "UUID": f"GPU-kvbench-{e.gpu:04d}", "device": f"nvidia{e.gpu}",
              "modelName": res.hw_name, "Hostname": cfg.hostname, "role": e.role,
              "engine": e.name}
        power = hwp.idle_watts + (hwp.tdp_watts - hwp.idle_watts) * min(1.0, 0.6 * sm + 0.4 * dram)
        moved = sum(v for (t, _), v in e.bytes_moved.items() if t in ("dram", "disk"))
        # dcgm-exporter reports PCIe traffic as a rate (bytes/s) since the previous sample.
        last_t, last_b = _PCIE_LAST.get(id(e), (now, moved))
        _PCIE_LAST[id(e)] = (now, moved)
        pcie = (moved - last_b) / (now - last_t) if now > last_t else 0.0
        rows.append((dl, busy, sm, dram, fb_used, power, pcie))
    for name, help_text, idx, conv in (
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", 1, lambda v: round(v * 100)),
            ("DCGM_FI_PROF_SM_ACTIVE", "Ratio of cycles an SM has at least 1 warp assigned.", 2,
             float),
            ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor pipe is active.", 2,
             lambda v: v * 0.8),
            ("DCGM_FI_PROF_DRAM_ACTIVE", "Ratio of cycles the device memory interface is active.",
             3, float),
            ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", 3,
             lambda v: round(v * 100)),
            ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", 4,
             lambda v: int(v // MIB)),
            ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", 4,
             lambda v: int(max(0.0, hw_total - v) // MIB)),
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", 5, float),
            ("DCGM_FI_PROF_PCIE_TX_BYTES", "Rate of PCIe tx data (bytes per second).", 6,
             float)):
        out.family(name, "gauge", help_text)
        for row in rows:
            out.sample(name, row[0], conv(row[idx]))
    return "\n".join(out.lines) + "\n"
