"""The seeds' cost model as pure functions: the emulator steps with them, the reports overlay them.

Times are milliseconds, sizes bytes, rates tokens/ms or GB/s (1 GB = 1e9 bytes). Defaults are
the seeds' constants (see ``kvbench.model.profiles``); where the seeds' own numbers disagree with
their formulas, the calibration constant that reconciles them is documented here.
(Just over 400 lines: one function per seed formula, each beside the constants it uses.)
"""

from __future__ import annotations

import math

import numpy as np

from kvbench.model.profiles import (
    CACHE_HIT_MS,
    CACHE_MISS_MS,
    CROSS_REGION_RTT_MS,
    DISK_TIER_GB_S,
    DRAM_TIER_GB_S,
    HARDWARE,
    KV_BLOCK_TOKENS,
    KV_BYTES_PER_TOKEN_70B_FP8,
    LMCACHE_CHUNK_TOKENS,
    MODELS,
    NIXL_RDMA_GB_S,
    NIXL_TCP_GB_S,
    PREFILL_TOK_PER_MS,
    REGIONS,
    REPLICAS_PER_REGION,
    ModelProfile,
)

# --- Calibration constants (ours; each reconciles a seed number with a seed formula) --------

# The reference replica: one H200 running Llama-3-70B with FP8 weights (70.6 GB fit in 141 GB).
WEIGHT_BYTES_REF = MODELS["llama-3-70b"].weight_bytes("fp8")
HBM_BYTES_PER_S_REF = HARDWARE["h200"].hbm_bytes_per_s
# Fraction of HBM the engine may use (vLLM's default --gpu-memory-utilization 0.9).
GPU_MEMORY_UTILIZATION = 0.9
# Tokens per engine step: vLLM's default max_num_batched_tokens for its API server on GPUs of
# 70 GiB or more other than the A100 (H100, H200: 8192; smaller GPUs: 2048), from
# EngineArgs.get_batch_defaults in vllm/engine/arg_utils.py. A prefill chunk this long takes a
# ~205 ms step on the reference GPU, and every running decode waits for it: the stall
# disaggregation removes.
STEP_TOKEN_BUDGET = 8192
# API-server work per prompt token before scheduling (tokenize, hash blocks, serialise): 2 us.
# Calibrated so the long-contract prefix below gives the seed's ~80 ms resident TTFT.
FRONTEND_US_PER_PROMPT_TOKEN = 2.0
# The "default long-contract prefix" of the seed's 80/800 ms: 30,000 contract tokens plus a
# 32-token question. Cold: 2 us x 30,032 + 30,032 / 40 tok/ms = 811 ms; resident: 60 ms of
# front end + one ~15 ms decode-bound step = ~75 ms.
LONG_CONTRACT_PREFIX_TOKENS = 30_000
LONG_CONTRACT_QUESTION_TOKENS = 32
# P/D transfer overheads. The seed's bytes/bandwidth alone gives 5 ms for 4K tokens of 70B FP8
# KV at 100 GB/s, below its own 20-80 ms; NIXL moves KV per block and per layer, so each
# (block, layer) descriptor costs 1.6 us and each transfer 1 ms of setup: 39 ms for 4K tokens.
PD_SETUP_MS = 1.0
PD_US_PER_BLOCK_LAYER = 1.6
# Other requests sharing a GPU in the analytic "under load" comparisons (ms_colocated and
# ms_disaggregated); with 2 the RDMA crossover for 200-token outputs lands at ~530 prompt tokens,
# the seed's "about 512".
PD_DEFAULT_CONCURRENCY = 2
# Per-block (CPU_OFFLOAD: 16-token blocks) or per-chunk (LMCACHE: 256-token chunks) cost of a
# load from a lower tier: a kernel launch and DMA setup, 20 us.
TIER_US_PER_LOAD_UNIT = 20.0
# Overhead of offloading at low memory pressure (store kernels, PCIe copies of every new block,
# connector lookups). Seed 000: "3-5% overhead at low pressure" (LMCache).
OFFLOAD_STEP_OVERHEAD = {"NATIVE_ONLY": 0.0, "CPU_OFFLOAD": 0.03, "LMCACHE": 0.03}
OFFLOAD_REQUEST_OVERHEAD_MS = {"NATIVE_ONLY": 0.0, "CPU_OFFLOAD": 0.0, "LMCACHE": 0.3}
# Hogwild!: the coordination cost c (in steps, per worker) that, with the seed's 200-step
# budget as T_serial, gives expected_speedup(200, 0.7, 4, 4, 50) = 200 / (95 + 16) = 1.80.
HOGWILD_T_SERIAL = 200
HOGWILD_COORDINATION_STEPS = 4

OFFLOAD_CONFIGS = ("NATIVE_ONLY", "CPU_OFFLOAD", "LMCACHE")
ROUTER_STRATEGIES = ("ROUND_ROBIN", "REGIONAL", "GLOBAL")


# --- Roofline pieces ------------------------------------------------------------------------

def kv_bytes(model: ModelProfile | str, tokens: int, kv_dtype: str = "fp8") -> int:
    """KV bytes of ``tokens`` tokens: 2 x L x h_kv x d_head x bytes x tokens (seed 003)."""
    prof = MODELS[model] if isinstance(model, str) else model
    return prof.kv_bytes_per_token(kv_dtype) * int(tokens)


def prefill_ms(tokens: float, prefill_tok_per_ms: float = PREFILL_TOK_PER_MS) -> float:
    """Compute-bound prefill time of ``tokens`` tokens."""
    return tokens / prefill_tok_per_ms


def step_ms(compute_tokens: float, kv_read_tokens: float, *,
            prefill_tok_per_ms: float = PREFILL_TOK_PER_MS,
            weight_bytes: float = WEIGHT_BYTES_REF,
            hbm_bytes_per_s: float = HBM_BYTES_PER_S_REF,
            kv_bytes_per_token: float = KV_BYTES_PER_TOKEN_70B_FP8) -> tuple[float, float, float]:
    """One engine step's roofline: (step_ms, compute_ms, memory_ms).

    Compute: every token in the batch (prefill chunk or decode) at the prefill rate. Memory:
    all weights once plus the KV each sequence's attention reads. The step takes the larger.
    """
    compute = compute_tokens / prefill_tok_per_ms
    memory = (weight_bytes + kv_read_tokens * kv_bytes_per_token) / hbm_bytes_per_s * 1e3
    return (compute if compute > memory else memory), compute, memory


def decode_step_ms(batch: int = 1, context_tokens: float = 0.0, **roofline) -> float:
    """A decode-only step for ``batch`` sequences of ``context_tokens`` context each."""
    return step_ms(batch, batch * context_tokens, **roofline)[0]


def frontend_ms(prompt_tokens: float, us_per_token: float = FRONTEND_US_PER_PROMPT_TOKEN) -> float:
    return prompt_tokens * us_per_token / 1e3


def ttft_ms(prompt_tokens: int, cached_tokens: int = 0, *,
            prefill_tok_per_ms: float = PREFILL_TOK_PER_MS,
            step_token_budget: int = STEP_TOKEN_BUDGET, **roofline) -> float:
    """Unloaded colocated TTFT: front end, then chunked prefill of the uncached tokens (each
    chunk a roofline step that also reads the context's KV)."""
    done = max(0, min(cached_tokens, prompt_tokens - 1))  # the last token is always computed
    todo = prompt_tokens - done
    total = frontend_ms(prompt_tokens)
    while todo > 0:
        chunk = min(todo, step_token_budget)
        total += step_ms(chunk, done + chunk, prefill_tok_per_ms=prefill_tok_per_ms,
                         **roofline)[0]
        todo -= chunk
        done += chunk
    return total


# --- Disaggregation (seed 000: ms_disaggregated; the transfer tax) -------------------------

def kv_transfer_ms(tokens: int, use_rdma: bool = True, *,
                   kv_bytes_per_token: float = KV_BYTES_PER_TOKEN_70B_FP8,
                   layers: int = 80, block_tokens: int = KV_BLOCK_TOKENS,
                   link_gb_s: float | None = None, setup_ms: float = PD_SETUP_MS,
                   us_per_block_layer: float = PD_US_PER_BLOCK_LAYER) -> float:
    """P/D KV transfer: setup + bytes / link bandwidth + a per (block, layer) descriptor cost."""
    gb_s = link_gb_s if link_gb_s is not None else (NIXL_RDMA_GB_S if use_rdma else NIXL_TCP_GB_S)
    wire = tokens * kv_bytes_per_token / (gb_s * 1e9) * 1e3
    blocks = math.ceil(tokens / block_tokens)
    return setup_ms + wire + blocks * layers * us_per_block_layer / 1e3


def _itl_ms(prompt: int, output: int, concurrency: int) -> float:
    return decode_step_ms(concurrency, prompt + output / 2)


def ms_colocated(prompt: int, output: int, *, concurrency: int = PD_DEFAULT_CONCURRENCY) -> float:
    """Request time on a shared GPU: prefill, decode, and the other requests' prefills that
    stall our decode steps (the interference): (c-1) x A x B / (A + B), A the other request's
    prefill time, B our decode time (the share of its prefill that lands in our decode)."""
    a = prefill_ms(prompt)
    b = output * _itl_ms(prompt, output, concurrency)
    interference = (concurrency - 1) * a * b / (a + b) if a + b > 0 else 0.0
    return a + b + interference


def ms_disaggregated(prompt: int, output: int, use_rdma: bool = True, *,
                     concurrency: int = PD_DEFAULT_CONCURRENCY) -> float:
    """Seed 000's formula: prefill + transfer tax + decode on the (uninterrupted) decode pool,
    plus the wait for the decode pool's next step (half a step on average)."""
    itl = _itl_ms(prompt, output, concurrency)
    return prefill_ms(prompt) + kv_transfer_ms(prompt, use_rdma) + itl / 2 + output * itl


def pd_crossover_prompt_tokens(output: int, use_rdma: bool = True, *,
                               concurrency: int = PD_DEFAULT_CONCURRENCY,
                               max_prompt: int = 1_000_000) -> int | None:
    """The smallest prompt (tokens) at which disaggregation beats colocation for ``output``
    tokens, or None if it never does below ``max_prompt``."""
    def wins(p: int) -> bool:
        return ms_disaggregated(p, output, use_rdma, concurrency=concurrency) < \
            ms_colocated(p, output, concurrency=concurrency)

    lo, hi = 1, None
    p = 16
    while p <= max_prompt:  # find a winning prompt on a doubling grid
        if wins(p):
            hi = p
            break
        lo = p
        p *= 2
    if hi is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if wins(mid):
            hi = mid
        else:
            lo = mid
    return hi


# --- Offloading ------------------------------------------------------------------------------

def tier_load_ms(tokens: int, tier: str = "dram", *, mode: str = "CPU_OFFLOAD",
                 kv_bytes_per_token: float = KV_BYTES_PER_TOKEN_70B_FP8,
                 dram_gb_s: float = DRAM_TIER_GB_S, disk_gb_s: float = DISK_TIER_GB_S,
                 block_tokens: int = KV_BLOCK_TOKENS,
                 chunk_tokens: int = LMCACHE_CHUNK_TOKENS,
                 us_per_unit: float = TIER_US_PER_LOAD_UNIT) -> float:
    """Loading ``tokens`` of KV from a lower tier back to HBM: bytes / tier bandwidth plus a
    per-unit cost (16-token blocks for vLLM's CPU offload, 256-token chunks for LMCache)."""
    gb_s = dram_gb_s if tier == "dram" else disk_gb_s
    unit = chunk_tokens if mode == "LMCACHE" else block_tokens
    return tokens * kv_bytes_per_token / (gb_s * 1e9) * 1e3 + \
        math.ceil(tokens / unit) * us_per_unit / 1e3


def offload_break_even(tokens: int, tier: str = "dram", *, mode: str = "CPU_OFFLOAD",
                       prefill_tok_per_ms: float = PREFILL_TOK_PER_MS, **load) -> dict:
    """Recompute vs reload for ``tokens`` cached tokens (seed 003: offloading pays when
    t_recompute > KV bytes / link bandwidth). Returns recompute_ms, load_ms, saving_ms,
    offload_wins and break_even_tokens (smallest size where reloading wins)."""
    rec = prefill_ms(tokens, prefill_tok_per_ms)
    ld = tier_load_ms(tokens, tier, mode=mode, **load)
    lo, hi = 0, 1
    while hi < 1 << 24 and tier_load_ms(hi, tier, mode=mode, **load) >= \
            prefill_ms(hi, prefill_tok_per_ms):
        lo, hi = hi, hi * 2
    if hi >= 1 << 24:
        be = None
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tier_load_ms(mid, tier, mode=mode, **load) < prefill_ms(mid, prefill_tok_per_ms):
                hi = mid
            else:
                lo = mid
        be = hi
    return {"recompute_ms": rec, "load_ms": ld, "saving_ms": rec - ld,
            "offload_wins": ld < rec, "break_even_tokens": be}


def offload_ttft_ms(mode: str, prompt_tokens: int, reused_tokens: int, working_set_tokens: float,
                    hbm_kv_tokens: float, dram_tokens: float = 200e9 / KV_BYTES_PER_TOKEN_70B_FP8,
                    ) -> float:
    """Expected unloaded TTFT of a request whose first ``reused_tokens`` were seen before, when
    the reused KV working set is ``working_set_tokens`` and uniformly popular: it is in HBM with
    probability hbm/ws, in DRAM with dram/ws (not NATIVE_ONLY), else recomputed."""
    if mode not in OFFLOAD_CONFIGS:
        raise ValueError(f"mode must be one of {OFFLOAD_CONFIGS}")
    ws = max(working_set_tokens, 1.0)
    p_hbm = min(1.0, hbm_kv_tokens / ws)
    p_low = 0.0 if mode == "NATIVE_ONLY" else min(1.0 - p_hbm,
                                                  max(0.0, (hbm_kv_tokens + dram_tokens) / ws
                                                      - p_hbm))
    p_miss = 1.0 - p_hbm - p_low
    new = prompt_tokens - reused_tokens
    over = 1.0 + OFFLOAD_STEP_OVERHEAD[mode]
    t_hit = ttft_ms(prompt_tokens, reused_tokens) * over
    t_low = t_hit + tier_load_ms(reused_tokens, "dram", mode=mode)
    t_miss = ttft_ms(prompt_tokens, 0) * over
    del new
    return OFFLOAD_REQUEST_OVERHEAD_MS[mode] + p_hbm * t_hit + p_low * t_low + p_miss * t_miss


# --- Routing -------------------------------------------------------------------------------

def router_ttft_ms(hit: bool, cross_region: bool = False, *, hit_ms: float = CACHE_HIT_MS,
                   miss_ms: float = CACHE_MISS_MS, rtt_ms: float = CROSS_REGION_RTT_MS) -> float:
    """Seed 000: ~80 ms with the prefix resident, ~800 ms cold, +440 ms across regions."""
    return (hit_ms if hit else miss_ms) + (rtt_ms if cross_region else 0.0)


def ttft_hit_ms() -> float:
    return router_ttft_ms(True)


def ttft_miss_ms() -> float:
    return router_ttft_ms(False)


def ttft_cross_region_ms(hit: bool = True) -> float:
    return router_ttft_ms(hit, True)


def cross_region_worth_it(hit_ms: float = CACHE_HIT_MS, miss_ms: float = CACHE_MISS_MS,
                          rtt_ms: float = CROSS_REGION_RTT_MS) -> bool:
    """Seed 000: compare the 440 ms round trip with the prefill a remote hit saves."""
    return miss_ms - hit_ms > rtt_ms


def simulate_routing(strategy: str, *, requests: int = 4000, documents: int = 500,
                     regions: int = REGIONS, replicas_per_region: int = REPLICAS_PER_REGION,
                     capacity_docs: int = 20, zipf_s: float = 0.6, seed: int = 0) -> dict:
    """A seeded RAG stream (each request reuses one Zipf-popular document prefix) routed over
    regions x replicas with per-replica LRU caches. Returns hit_rate, mean_ttft_ms,
    cross_region_share."""
    if strategy not in ROUTER_STRATEGIES:
        raise ValueError(f"strategy must be one of {ROUTER_STRATEGIES}")
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, documents + 1, dtype=float)
    probs = ranks ** -zipf_s
    probs /= probs.sum()
    docs = rng.choice(documents, size=requests, p=probs)
    origin = rng.integers(0, regions, size=requests)
    caches = [[dict() for _ in range(replicas_per_region)] for _ in range(regions)]
    rr = [0] * regions
    hits = cross = 0
    total_ms = 0.0
    for t, (doc, reg) in enumerate(zip(docs.tolist(), origin.tolist())):
        target_reg = reg
        if strategy == "ROUND_ROBIN":
            rep = rr[reg] % replicas_per_region
            rr[reg] += 1
        else:
            rep = hash((doc, 7919)) % replicas_per_region  # prefix-hash placement
            if strategy == "GLOBAL" and doc not in caches[reg][rep] and \
                    cross_region_worth_it():
                for r2 in range(regions):
                    if r2 != reg and doc in caches[r2][hash((doc, 7919)) % replicas_per_region]:
                        target_reg = r2
                        break
        cache = caches[target_reg][rep]
        hit = doc in cache
        hits += hit
        cross += target_reg != reg
        total_ms += router_ttft_ms(hit, target_reg != reg)
        cache[doc] = t
        if len(cache) > capacity_docs:
            del cache[min(cache, key=cache.get)]
    return {"strategy": strategy, "hit_rate": hits / requests,
            "mean_ttft_ms": total_ms / requests, "cross_region_share": cross / requests}


# --- Hogwild! -------------------------------------------------------------------------------

def expected_speedup(T_serial: int, p: float, c: int, N: int, steps_per_worker: int) -> float:
    """Seed 000: Amdahl plus coordination, T_serial / (T_serial((1-p) + p/N) + cN). A worker
    cannot finish in fewer than ``steps_per_worker`` steps, which bounds the parallel time."""
    if N < 1 or T_serial <= 0 or not 0.0 <= p <= 1.0:
        raise ValueError("need N >= 1, T_serial > 0 and 0 <= p <= 1")
    parallel = T_serial * ((1 - p) + p / N) + c * N
    return T_serial / max(parallel, steps_per_worker)


def run_hogwild(n_workers: int, step_budget: int, target_per_category: int,
                coordination_weight: float, *, categories: int = 2, pool_factor: float = 1.0,
                coordination_overhead: float = 0.05, seed: int = 0) -> dict:
    """A seeded simulation of ``n_workers`` sharing one KV cache to find
    ``target_per_category`` distinct items in each of ``categories`` categories.

    Each step a worker either coordinates (probability ``coordination_weight``: it reads the
    shared cache, takes the neediest category and an item nobody has) or works alone (a
    category it has not finished itself, an item it has not found itself; a duplicate if
    another worker already has it). Reading the others costs ``coordination_overhead`` of a
    step per other worker. Stops when every category is complete or the budget (in steps of
    wall time) runs out.
    """
    rng = np.random.default_rng(seed)
    pool = max(target_per_category, int(pool_factor * target_per_category))
    found = [set() for _ in range(categories)]
    own = [[set() for _ in range(categories)] for _ in range(n_workers)]
    step_time = 1.0 + coordination_weight * coordination_overhead * (n_workers - 1)
    t = 0.0
    rounds = dup = work = 0
    goal = categories * target_per_category

    def done() -> bool:
        return all(len(f) >= target_per_category for f in found)

    while not done() and t + step_time <= step_budget + 1e-9:
        rounds += 1
        t += step_time
        for w in range(n_workers):
            work += 1
            if rng.random() < coordination_weight:
                cat = min(range(categories), key=lambda k: len(found[k]))
                if len(found[cat]) >= pool:
                    continue
                while True:
                    item = int(rng.integers(pool))
                    if item not in found[cat]:
                        break
            else:
                open_cats = [k for k in range(categories)
                             if len(own[w][k]) < target_per_category]
                cat = open_cats[int(rng.integers(len(open_cats)))] if open_cats else \
                    int(rng.integers(categories))
                if len(own[w][cat]) >= pool:
                    continue
                while True:
                    item = int(rng.integers(pool))
                    if item not in own[w][cat]:
                        break
            own[w][cat].add(item)
            if item in found[cat]:
                dup += 1
            else:
                found[cat].add(item)
    unique = sum(min(len(f), target_per_category) for f in found)
    return {"n_workers": n_workers, "coordination_weight": coordination_weight,
            "completed": done(), "time_steps": t, "rounds": rounds, "worker_steps": work,
            "unique_items": unique, "progress": unique / goal, "duplicates": dup,
            "duplicate_rate": dup / work if work else 0.0}


def hogwild_speedup(n_workers: int, coordination_weight: float, *, step_budget: int = 400,
                    target_per_category: int = 100, seed: int = 0) -> float:
    """Time for one worker over time for ``n_workers`` to finish the same task."""
    one = run_hogwild(1, step_budget, target_per_category, coordination_weight, seed=seed)
    many = run_hogwild(n_workers, step_budget, target_per_category, coordination_weight,
                       seed=seed)
    if not many["completed"]:
        return one["time_steps"] / step_budget * many["progress"]
    return one["time_steps"] / many["time_steps"]
