"""Hardware and model profiles for the emulator's roofline, and the seeds' default constants.

Hardware numbers are vendor datasheet values (dense, no sparsity); model shapes are the
published Llama 3 configs. The seeds' constants (``../shared/seeds/``) are the emulator's
defaults; each carries its source.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- The seeds' constants (seed 000, "Setting / Default" table and FAQ) --------------------
PREFILL_TOK_PER_MS = 40.0  # seed 000 PREFILL_TOK_PER_MS: prefill throughput per GPU
CACHE_HIT_MS = 80.0  # seed 000 CACHE_HIT_MS: TTFT with the prefix resident
CACHE_MISS_MS = 800.0  # seed 000 CACHE_MISS_MS: TTFT with a cold prefill
REPLICAS_PER_REGION = 4  # seed 000 REPLICAS_PER_REGION ("Three regions")
REGIONS = 3  # seed 000: "Three regions"
KV_BYTES_PER_TOKEN_70B_FP8 = 125_000  # seed 000 KV_BYTES_PER_TOKEN_70B_FP8
NIXL_RDMA_GB_S = 100.0  # seed 000 NIXL_RDMA_GB_S: RDMA transfer rate
NIXL_TCP_GB_S = 10.0  # seed 000 NIXL_TCP_GB_S: TCP fallback rate
KV_BLOCK_TOKENS = 16  # seed 000 KV_BLOCK_TOKENS
CROSS_REGION_RTT_MS = 440.0  # seed 000 FAQ: "a cross-region route adds a 440 ms round-trip"
PD_TRANSFER_4K_MS_RANGE = (20.0, 80.0)  # seed 000 FAQ: 20-80 ms for 4K-prompt KV, 70B FP8, NIXL
HOGWILD_SPEEDUP = 1.8  # seed 000: 1.8x at p = 0.7, N = 4
OFFLOAD_OVERHEAD_LOW_PRESSURE = (0.03, 0.05)  # seed 000: LMCache 3-5% overhead at low pressure
RR_PREFIX_HIT_RATE = 0.08  # seed 000 symptom table: round-robin drops prefix hits to 8%
PD_CROSSOVER_PROMPT_TOKENS = 512  # seed 000: disaggregation wins for prompts > 512 tokens
PD_MIN_OUTPUT_TOKENS = 200  # seed 000: ... with outputs > 200 tokens
# seed 003 (LMCache config example): max_local_cpu_size 200 GB, max_local_disk_size 2000 GB.
DRAM_TIER_BYTES = 200e9
DISK_TIER_BYTES = 2000e9
# seed 003 transfer table: shared memory over PCIe 5 ~60 GB/s; we take 50 GB/s effective.
DRAM_TIER_GB_S = 50.0
# NVMe Gen4 x4 sequential read, typical datasheet figure (~7 GB/s); 6 GB/s effective.
DISK_TIER_GB_S = 6.0
# seed 003: LMCache chunk_size 256 tokens in its example config.
LMCACHE_CHUNK_TOKENS = 256
DEFAULT_REGION_NAMES = ("us-east-1", "eu-west-1", "ap-northeast-1")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float  # dense FLOP/s
    tdp_watts: float
    idle_watts: float


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    params: float

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """2 (K and V) x L x h_kv x d_head x bytes per element (seed 003's KV formula)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    def weight_bytes(self, weight_dtype: str) -> float:
        return self.params * DTYPE_BYTES[weight_dtype]

    def flops_per_token(self) -> float:
        """Forward FLOPs per token of a dense decoder (2 x parameters), attention excluded."""
        return 2.0 * self.params


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}

HARDWARE = {
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16, 1979 TFLOPS FP8, 700 W.
    "h100": HardwareProfile("NVIDIA H100 80GB HBM3", 80e9, 3.35e12, 989e12, 1979e12, 700.0, 70.0),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, same tensor cores as H100, 700 W.
    "h200": HardwareProfile("NVIDIA H200", 141e9, 4.8e12, 989e12, 1979e12, 700.0, 75.0),
}

MODELS = {
    # Meta Llama 3 8B config: 32 layers, hidden 4096, 8 KV heads of 128, 8.03 B parameters.
    "llama-3-8b": ModelProfile("Llama-3-8B", 32, 4096, 8, 128, 8.03e9),
    # Meta Llama 3 70B config: 80 layers, hidden 8192, 8 KV heads of 128, 70.6 B parameters.
    "llama-3-70b": ModelProfile("Llama-3-70B", 80, 8192, 8, 128, 70.6e9),
}

# The seeds' 40 tok/ms is taken to hold on the reference setup below; other hardware and
# models scale it by their roofline compute ratio (same MFU assumed).
REFERENCE_HARDWARE = "h200"
REFERENCE_MODEL = "llama-3-70b"
REFERENCE_DTYPE = "fp8"


def hardware(name: str) -> HardwareProfile:
    return HARDWARE[name]


def model(name: str) -> ModelProfile:
    return MODELS[name]


def compute_flops(hw: HardwareProfile, weight_dtype: str) -> float:
    return hw.fp8_flops if weight_dtype == "fp8" else hw.bf16_flops


def scaled_prefill_tok_per_ms(hw_name: str, model_name: str, weight_dtype: str) -> float:
    """The seed's prefill rate scaled by roofline compute (FLOP/s / FLOPs per token)."""
    ref = compute_flops(HARDWARE[REFERENCE_HARDWARE], REFERENCE_DTYPE) / \
        MODELS[REFERENCE_MODEL].flops_per_token()
    got = compute_flops(HARDWARE[hw_name], weight_dtype) / MODELS[model_name].flops_per_token()
    return PREFILL_TOK_PER_MS * got / ref
