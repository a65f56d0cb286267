"""Settings of the built-in endpoints: every constant of the emulator, the seeds' values as
defaults. ``validate_options`` is what ``kvbench/config.py`` calls for ``[[endpoints]]
kind = "builtin" options = {...}``; ``kvbench serve --config/--options-json`` use it too."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvbench.model import costmodel as cm
from kvbench.model import profiles as pf
from kvbench.model import topologies

# Engines of one built-in endpoint (replicas, P/D GPUs, regions): each is emulated in the one
# server process, so a thousand is already a slow event loop, and 1e18 never starts listening
MAX_ENGINES = 1024
SLOWDOWN_MAX = 100.0  # options.slowdown: beyond it, a probe of the endpoint would never end
FAULT_KINDS = ("error", "rate_limit", "stall_before", "stall_mid", "reset", "malformed",
               "slow_headers")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FaultConfig(_Strict):
    """Fault injection, off by default. Each ``*_rate`` is the probability per request."""

    error_rate: float = Field(default=0.0, ge=0, le=1)
    error_statuses: list[int] = Field(default_factory=lambda: [500, 502, 503])
    rate_limit_rate: float = Field(default=0.0, ge=0, le=1)
    retry_after_s: float = Field(default=1.0, ge=0)
    stall_before_rate: float = Field(default=0.0, ge=0, le=1)
    stall_mid_rate: float = Field(default=0.0, ge=0, le=1)
    stall_ms: float = Field(default=2000.0, ge=0)
    reset_rate: float = Field(default=0.0, ge=0, le=1)
    malformed_rate: float = Field(default=0.0, ge=0, le=1)
    slow_headers_rate: float = Field(default=0.0, ge=0, le=1)
    slow_headers_ms: float = Field(default=1000.0, ge=0)

    @model_validator(mode="after")
    def _statuses(self):
        for s in self.error_statuses:
            if not 400 <= s <= 599:
                raise ValueError(f"error_statuses holds {s}; use HTTP error codes 400-599")
        return self


class EmulatorConfig(_Strict):
    """One emulated endpoint. Times in ms, sizes in bytes, bandwidths in GB/s (1e9 B/s)."""

    topology: str = Field(default_factory=lambda: topologies.default().name)  # registered
    model_name: str = "kvbench-llama-3-70b"
    max_model_len: int = Field(default=131072, gt=0)
    hardware: Literal["h100", "h200"] = "h200"
    model: Literal["llama-3-8b", "llama-3-70b"] = "llama-3-70b"
    weight_dtype: Literal["bf16", "fp8"] = "fp8"
    kv_dtype: Literal["bf16", "fp8"] = "fp8"
    # None: the seed's 125,000 B for Llama-3-70B FP8 KV, else 2 L h_kv d_head bytes.
    kv_bytes_per_token: int | None = Field(default=None, gt=0)
    # None: the seed's 40 tok/ms on the reference (H200, 70B, FP8), scaled by roofline otherwise.
    prefill_tok_per_ms: float | None = Field(default=None, gt=0)
    hbm_bytes: float | None = Field(default=None, gt=0)
    hbm_gb_s: float | None = Field(default=None, gt=0)
    gpu_memory_utilization: float = Field(default=cm.GPU_MEMORY_UTILIZATION, gt=0, le=1)
    kv_capacity_tokens: int | None = Field(default=None, gt=0)  # per GPU; None: from HBM
    block_tokens: int = Field(default=pf.KV_BLOCK_TOKENS, gt=0)
    step_token_budget: int = Field(default=cm.STEP_TOKEN_BUDGET, gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    frontend_us_per_prompt_token: float = Field(default=cm.FRONTEND_US_PER_PROMPT_TOKEN, ge=0)
    # Host work per sequence in each step (scheduling, sampling, detokenising, streaming its
    # token), added to the step's roofline: what a CPU engine of a tiny model spends per
    # sequence beside its KV reads. 0 on the GPU model (there it hides under the roofline).
    step_us_per_seq: float = Field(default=0.0, ge=0)
    # Attention over the context during prefill: a chunk taking the context from c0 to c1
    # tokens adds this x (c1^2 - c0^2) ms. 0 on the GPU model; a CPU engine's tiny model
    # spends as much there as on the linear part at a few thousand tokens.
    prefill_ms_per_token2: float = Field(default=0.0, ge=0)
    default_max_tokens: int = Field(default=256, gt=0)  # chat requests without max_tokens
    # engines of a topology of replicas; None: its module's default (kvbench.model.topologies)
    replicas: int | None = Field(default=None, gt=0, le=MAX_ENGINES)
    prefill_gpus: int = Field(default=1, gt=0, le=MAX_ENGINES)
    decode_gpus: int = Field(default=1, gt=0, le=MAX_ENGINES)
    link: Literal["rdma", "tcp"] = "rdma"
    rdma_gb_s: float = Field(default=pf.NIXL_RDMA_GB_S, gt=0)
    tcp_gb_s: float = Field(default=pf.NIXL_TCP_GB_S, gt=0)
    pd_setup_ms: float = Field(default=cm.PD_SETUP_MS, ge=0)
    pd_us_per_block_layer: float = Field(default=cm.PD_US_PER_BLOCK_LAYER, ge=0)
    offload: Literal["NATIVE_ONLY", "CPU_OFFLOAD", "LMCACHE"] = "LMCACHE"
    dram_bytes: float = Field(default=pf.DRAM_TIER_BYTES, ge=0)
    disk_bytes: float = Field(default=pf.DISK_TIER_BYTES, ge=0)
    dram_gb_s: float = Field(default=pf.DRAM_TIER_GB_S, gt=0)
    disk_gb_s: float = Field(default=pf.DISK_TIER_GB_S, gt=0)
    lmcache_chunk_tokens: int = Field(default=pf.LMCACHE_CHUNK_TOKENS, gt=0)
    tier_us_per_load_unit: float = Field(default=cm.TIER_US_PER_LOAD_UNIT, ge=0)
    offload_step_overhead: float | None = Field(default=None, ge=0)  # None: per mode (costmodel)
    offload_request_overhead_ms: float | None = Field(default=None, ge=0)
    regions: int = Field(default=pf.REGIONS, gt=0, le=MAX_ENGINES)
    replicas_per_region: int = Field(default=pf.REPLICAS_PER_REGION, gt=0, le=MAX_ENGINES)
    region_names: list[str] | None = None
    cross_region_rtt_ms: float = Field(default=pf.CROSS_REGION_RTT_MS, ge=0)
    router: Literal["ROUND_ROBIN", "REGIONAL", "GLOBAL"] = "REGIONAL"
    # Session affinity: the request header whose value pins a session to the replica its
    # first request was routed to (e.g. "X-Session-ID", which kvbench's load sends); "": none
    pin_header: str = Field(default="", max_length=128,
                            pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]*$")
    # A uniformly slower endpoint: a factor on every modelled step time (prefill, decode and
    # KV loads from lower tiers); 1.2 = 20% slower. The front end, the network and the P/D
    # link keep their times. What A/B tests of the gate and the capacity search compare.
    slowdown: float = 1.0
    time_scale: float = Field(default=1.0, gt=0)  # wall seconds per model second (0.1: 10x faster)
    seed: int = 0
    hostname: str = "kvbench-emulator"
    faults: FaultConfig = FaultConfig()

    @field_validator("topology", mode="before")
    @classmethod
    def _known(cls, v):
        return topologies.accept(v)

    @field_validator("slowdown")
    @classmethod
    def _slowdown(cls, v: float) -> float:
        if not (math.isfinite(v) and 0 < v <= SLOWDOWN_MAX):
            raise ValueError(f"slowdown is {v!r}; give a factor above 0 and at most "
                             f"{SLOWDOWN_MAX:g} on the modelled step times (1.2 makes the "
                             "endpoint 20% slower, 1 leaves it as modelled)")
        return v

    @model_validator(mode="after")
    def _topology(self, info):
        want = (info.context or {}).get("topology")
        if want is not None and self.topology != want:
            raise ValueError(f"options say topology {self.topology!r} but the endpoint is "
                             f"{want!r}; remove topology from options")
        return self

    @model_validator(mode="after")
    def _names(self):
        if self.region_names is not None and len(self.region_names) != self.regions:
            raise ValueError(f"region_names has {len(self.region_names)} names for "
                             f"{self.regions} regions; give one name per region")
        Resolved.from_config(self)  # raises ValueError when the weights leave no KV room
        return self

    def resolved(self) -> "Resolved":
        return Resolved.from_config(self)


def gpu_count(cfg: EmulatorConfig) -> tuple[int, str]:
    """The GPUs an emulated endpoint runs (each engine is one GPU) and how they add up."""
    return topologies.get(cfg.topology).gpus(cfg)


def validate_options(topology: str, options: dict) -> EmulatorConfig:
    """The settings of a built-in endpoint; raises pydantic.ValidationError on bad options."""
    data = dict(options or {})
    data.setdefault("topology", topology)
    return EmulatorConfig.model_validate(data, context={"topology": topology})


@dataclass(frozen=True)
class Resolved:
    """Numbers the engine uses, derived once from the settings and the profiles."""

    cfg: EmulatorConfig
    prefill_tok_per_ms: float
    kv_bytes_per_token: float
    weight_bytes: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    layers: int
    capacity_blocks: int
    link_gb_s: float
    offload_step_overhead: float
    offload_request_overhead_ms: float
    region_names: tuple[str, ...]
    hw_name: str

    @classmethod
    def from_config(cls, c: EmulatorConfig) -> "Resolved":
        hw = pf.HARDWARE[c.hardware]
        mp = pf.MODELS[c.model]
        if c.kv_bytes_per_token is not None:
            kvb = float(c.kv_bytes_per_token)
        elif (c.model, c.kv_dtype) == ("llama-3-70b", "fp8"):
            kvb = float(pf.KV_BYTES_PER_TOKEN_70B_FP8)
        else:
            kvb = float(mp.kv_bytes_per_token(c.kv_dtype))
        rate = c.prefill_tok_per_ms or pf.scaled_prefill_tok_per_ms(c.hardware, c.model,
                                                                     c.weight_dtype)
        hbm = c.hbm_bytes or hw.hbm_bytes
        wb = mp.weight_bytes(c.weight_dtype)
        if c.kv_capacity_tokens is not None:
            cap_tokens = c.kv_capacity_tokens
        else:
            cap_tokens = int(max(0.0, hbm * c.gpu_memory_utilization - wb) // kvb)
        blocks = cap_tokens // c.block_tokens
        if blocks < 1:
            raise ValueError(f"{mp.name} {c.weight_dtype} weights leave no KV room on "
                             f"{hw.name}; pick a larger GPU, FP8 weights or kv_capacity_tokens")
        names = tuple(c.region_names) if c.region_names else tuple(
            (pf.DEFAULT_REGION_NAMES[i] if i < len(pf.DEFAULT_REGION_NAMES) else f"region-{i}")
            for i in range(c.regions))
        return cls(
            cfg=c, prefill_tok_per_ms=rate, kv_bytes_per_token=kvb, weight_bytes=wb,
            hbm_bytes=hbm, hbm_bytes_per_s=(c.hbm_gb_s * 1e9 if c.hbm_gb_s else
                                            hw.hbm_bytes_per_s),
            layers=mp.layers, capacity_blocks=blocks,
            link_gb_s=c.rdma_gb_s if c.link == "rdma" else c.tcp_gb_s,
            offload_step_overhead=(c.offload_step_overhead if c.offload_step_overhead is not None
                                   else cm.OFFLOAD_STEP_OVERHEAD[c.offload]),
            offload_request_overhead_ms=(
                c.offload_request_overhead_ms if c.offload_request_overhead_ms is not None
                else cm.OFFLOAD_REQUEST_OVERHEAD_MS[c.offload]),
            region_names=names, hw_name=hw.name)

    @property
    def block_bytes(self) -> float:
        return self.kv_bytes_per_token * self.cfg.block_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.cfg.block_tokens

    def step_ms(self, compute_tokens: float, kv_read_tokens: float) -> tuple[float, float, float]:
        return cm.step_ms(compute_tokens, kv_read_tokens,
                          prefill_tok_per_ms=self.prefill_tok_per_ms,
                          weight_bytes=self.weight_bytes, hbm_bytes_per_s=self.hbm_bytes_per_s,
                          kv_bytes_per_token=self.kv_bytes_per_token)

    def kv_transfer_ms(self, tokens: int) -> float:
        c = self.cfg
        return cm.kv_transfer_ms(tokens, kv_bytes_per_token=self.kv_bytes_per_token,
                                 layers=self.layers, block_tokens=c.block_tokens,
                                 link_gb_s=self.link_gb_s, setup_ms=c.pd_setup_ms,
                                 us_per_block_layer=c.pd_us_per_block_layer)

    def tier_load_ms(self, tokens: int, tier: str) -> float:
        c = self.cfg
        return cm.tier_load_ms(tokens, tier, mode=c.offload,
                               kv_bytes_per_token=self.kv_bytes_per_token,
                               dram_gb_s=c.dram_gb_s, disk_gb_s=c.disk_gb_s,
                               block_tokens=c.block_tokens, chunk_tokens=c.lmcache_chunk_tokens,
                               us_per_unit=c.tier_us_per_load_unit)

def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


