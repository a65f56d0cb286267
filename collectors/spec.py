"""The collectors' part of bench.toml: ``[collect]`` and its ``[[collect.roles]]`` GPU roles.
Imports only pydantic, so the config composes it without pulling in the samplers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ROLES = ("prefill", "decode", "colocated", "cache")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuRole(_Strict):
    host: str = "*"
    gpus: list[int] = Field(default_factory=list)  # empty: all GPUs of that host
    role: Literal[ROLES]


class CollectConfig(_Strict):
    nvml: bool = True
    nvml_interval_s: float = Field(default=0.1, gt=0)
    scrape_interval_s: float = Field(default=1.0, gt=0)
    agents: list[str] = Field(default_factory=list)  # remote `kvbench collect` URLs
    agent_token_env: str | None = None
    roles: list[GpuRole] = Field(default_factory=list)
