"""The report's and the gate's part of bench.toml: per-class SLOs (``[slo.<class>]``) and the
gate rules (``[gate]``). Imports only pydantic, so the config and the reports share one schema."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SLO(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)


class GateRule(_Strict):
    metric: str  # e.g. ttft_p99, tpot_p50, e2e_p95, goodput_rps, error_rate
    request_class: str = Field(default="*", alias="class")
    endpoint: str = "*"
    max_increase_pct: float | None = Field(default=None, ge=0)
    max_decrease_pct: float | None = Field(default=None, ge=0)
    max_value: float | None = None  # absolute ceiling, in the metric's own unit

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _one(self):
        given = [x for x in (self.max_increase_pct, self.max_decrease_pct, self.max_value)
                 if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of max_increase_pct, max_decrease_pct, max_value")
        return self


class GateConfig(_Strict):
    rules: list[GateRule] = Field(default_factory=list)
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    bootstrap_resamples: int = Field(default=1000, ge=100)
