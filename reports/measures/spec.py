"""The report's and the gate's part of bench.toml: per-class SLOs (``[slo.<class>]``) and the
gate rules (``[gate]``). Imports pydantic (and, to check a rule's metric, the metric registry
when a rule is validated), so the config and the reports share one schema."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The metrics a gate rule may name: ``reports.metrics`` registers exactly these (it asserts so
# at import). Kept here, apart from their pandas implementations, so loading a config (a load
# process does) validates gate rules without importing pandas.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e", "lateness", "ttft_intended", "e2e_intended")
QUANTILE_NAMES = ("p50", "p90", "p95", "p99", "p999")
OTHER_METRICS = ("offered_rps", "throughput_rps", "started_rps", "goodput_rps",
                 "slo_attainment", "output_tps", "input_tps", "error_rate", "hit_ratio")
METRIC_NAMES = frozenset([f"{b}_{q}" for b in LATENCY_METRICS
                          for q in (*QUANTILE_NAMES, "mean")] + list(OTHER_METRICS))


def metric_name(name: str) -> str:
    """Canonical metric name (accepts ``ttft_p99.9`` for ``ttft_p999``, ``e2el_`` for vLLM's
    E2EL); an unknown one is a ``UserError`` listing the known ones."""
    from kvbench.core.errors import UserError

    key = name.strip().lower().replace("p99.9", "p999")
    if key.startswith("e2el_"):
        key = "e2e_" + key[len("e2el_"):]
    if key not in METRIC_NAMES:
        raise UserError(f"unknown metric {name!r}; use one of {', '.join(sorted(METRIC_NAMES))}")
    return key

_DAY_MS = 86_400_000.0  # an SLO above a day is a typo (the request deadline caps at a day)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,
                              str_max_length=4096)


class SLO(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0, le=_DAY_MS)
    tpot_ms: float | None = Field(default=None, gt=0, le=_DAY_MS)
    e2e_ms: float | None = Field(default=None, gt=0, le=_DAY_MS)


# SLOs a class gets when bench.toml gives it none. Only the ``trace`` class (every trace reader's
# requests: Mooncake, Azure, LMCache agent) has one: a replayed trace has no author who set an
# SLO, and without one its goodput would be "no SLO". TTFT 5 s is the longctx class's (trace
# prompts are long: Mooncake's conversation trace averages ~12k tokens, which one H200
# prefills in about 0.3 s, so 5 s leaves room for batching, not for a queue of tens of
# seconds); TPOT 100 ms is 10 tokens/s, about reading speed. A [slo.trace] table overrides it.
DEFAULT_SLOS: dict[str, SLO] = {"trace": SLO(ttft_ms=5000.0, tpot_ms=100.0)}


class GateRule(_Strict):
    metric: str  # a name of reports.metrics.METRIC_INFO: ttft_p99, goodput_rps, error_rate...
    request_class: str = Field(default="*", alias="class")
    endpoint: str = "*"
    # a change beyond a million percent (or a fall beyond 100%) cannot be a tolerance
    max_increase_pct: float | None = Field(default=None, ge=0, le=1e6)
    max_decrease_pct: float | None = Field(default=None, ge=0, le=100)
    max_value: float | None = None  # absolute ceiling, in the metric's own unit
    # a rule that finds no data is not judged (said in every output) instead of an error
    allow_missing: bool = Field(default=False, strict=True)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              allow_inf_nan=False, str_max_length=4096)

    @field_validator("metric")
    @classmethod
    def _known(cls, v: str) -> str:
        from kvbench.core.errors import UserError

        try:
            metric_name(v)
        except UserError:
            raise ValueError(f"{v[:40]!r} is not a metric; use one of "
                             f"{', '.join(sorted(METRIC_NAMES))}") from None
        return v

    @model_validator(mode="after")
    def _one(self):
        given = [x for x in (self.max_increase_pct, self.max_decrease_pct, self.max_value)
                 if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of max_increase_pct, max_decrease_pct, max_value")
        return self


class GateConfig(_Strict):
    rules: list[GateRule] = Field(default_factory=list, max_length=1000)
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    # intervals settle long before 100,000 resamples; each costs a pass over the requests
    bootstrap_resamples: int = Field(default=1000, ge=100, le=100_000)
