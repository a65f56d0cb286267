"""The collectors' part of bench.toml: ``[collect]`` and its ``[[collect.roles]]`` GPU roles.
Imports only pydantic, so the config composes it without pulling in the samplers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvbench.model.topologies.base import ROLES  # the parts a GPU plays, as the emulator's


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,
                              str_max_length=4096)


# GPU indices of one host (NVML counts a few dozen; 1024 is past any chassis)
GpuIndex = Annotated[int, Field(ge=0, lt=1024)]


class GpuRole(_Strict):
    host: str = "*"
    gpus: list[GpuIndex] = Field(default_factory=list, max_length=1024)  # empty: all GPUs
    role: Literal[ROLES]


class CollectConfig(_Strict):
    nvml: bool = True
    # sampling periods: NVML refreshes its counters about every 1/60 s, and a sample an hour
    # apart says nothing about a run
    nvml_interval_s: float = Field(default=0.1, ge=0.001, le=3600)
    scrape_interval_s: float = Field(default=1.0, ge=0.001, le=3600)
    agents: list[str] = Field(default_factory=list, max_length=1000)  # `kvbench collect` URLs
    agent_token_env: str | None = None
    roles: list[GpuRole] = Field(default_factory=list, max_length=10_000)
