"""Typed parameters of every workload: the ``[workloads.<name>]`` tables of bench.toml.

Each spec is chosen by its ``kind`` (a pydantic discriminated union), so a typo is an error
naming the field before anything runs. Token lengths are in tokens of the configured tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthDist(Strict):
    """A distribution of token counts (or seconds for think times), clipped to [min, max].

    ``constant``: always ``mean``. ``uniform``: integers in [min, max]. ``lognormal``: median
    ``mean`` and log-space sigma ``sigma``. ``normal``: ``mean`` and ``sigma``.
    """

    dist: Literal["constant", "uniform", "lognormal", "normal"] = "constant"
    mean: float = Field(gt=0)
    sigma: float = Field(default=0.0, ge=0)
    min: float = Field(default=1, ge=0)
    max: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min}); make max >= min")
        if self.dist == "uniform" and self.max is None:
            raise ValueError("a uniform distribution needs max; set max")
        return self

    @property
    def upper(self) -> float:
        """The largest value this distribution can produce (inf if unbounded)."""
        if self.dist == "constant":
            return self.mean if self.max is None else min(self.mean, self.max)
        return float("inf") if self.max is None else self.max


def const(n: float) -> LengthDist:
    return LengthDist(dist="constant", mean=n)


class WorkingSet(Strict):
    """Size the workload's unique KV to ``multiple`` x ``kv_capacity_tokens`` (documents or
    contracts follow from it)."""

    kv_capacity_tokens: int = Field(gt=0)
    multiple: float = Field(gt=0)


class _Common(Strict):
    seed: int | None = None  # overrides the suite seed for this workload
    api: Literal["chat", "completions"] = "chat"
    working_set: WorkingSet | None = None


class RagSpec(_Common):
    kind: Literal["rag"] = "rag"
    requests: int = Field(default=200, gt=0)
    documents: int = Field(default=100, gt=0)
    chunks_per_document: int = Field(default=4, gt=0)
    chunk_tokens: LengthDist = const(256)
    top_k: int = Field(default=4, gt=0)
    zipf_s: float = Field(default=1.1, gt=0)  # popularity exponent over documents
    system_prompt_tokens: int = Field(default=128, ge=0)
    question_tokens: LengthDist = LengthDist(dist="lognormal", mean=24, sigma=0.4, min=4, max=128)
    output_tokens: LengthDist = LengthDist(dist="lognormal", mean=128, sigma=0.5, min=8, max=512)


class AgentSpec(_Common):
    kind: Literal["agent"] = "agent"
    sessions: int = Field(default=16, gt=0)
    turns: int = Field(default=6, gt=0)
    system_prompt_tokens: int = Field(default=512, ge=0)
    tool_schema_tokens: int = Field(default=1024, ge=0)
    task_tokens: LengthDist = LengthDist(dist="lognormal", mean=96, sigma=0.5, min=16, max=512)
    tool_result_tokens: LengthDist = LengthDist(dist="lognormal", mean=384, sigma=0.7, min=16,
                                                max=4096)
    output_tokens: LengthDist = LengthDist(dist="lognormal", mean=96, sigma=0.5, min=8, max=512)
    think_time_s: LengthDist = LengthDist(dist="uniform", mean=0.5, min=0.1, max=1.0)


class LongctxSpec(_Common):
    kind: Literal["longctx"] = "longctx"
    contracts: int = Field(default=4, gt=0)
    contract_tokens: LengthDist = LengthDist(dist="uniform", mean=32768, min=16384, max=32768)
    questions_per_contract: int = Field(default=4, gt=0)
    question_tokens: LengthDist = LengthDist(dist="lognormal", mean=32, sigma=0.3, min=8, max=128)
    output_tokens: LengthDist = LengthDist(dist="lognormal", mean=96, sigma=0.4, min=8, max=512)
    order: Literal["interleave", "tile"] = "interleave"
    think_time_s: LengthDist = LengthDist(dist="uniform", mean=0.2, min=0.0, max=0.5)


class ChatSpec(_Common):
    kind: Literal["chat"] = "chat"
    requests: int = Field(default=200, gt=0)
    prompt_tokens: LengthDist = LengthDist(dist="lognormal", mean=180, sigma=0.8, min=8,
                                           max=4096)
    output_tokens: LengthDist = LengthDist(dist="lognormal", mean=200, sigma=0.7, min=8,
                                           max=1024)


class HogwildSpec(_Common):
    kind: Literal["hogwild"] = "hogwild"
    tasks: int = Field(default=2, gt=0)
    workers: int = Field(default=4, gt=0)
    steps_per_worker: int = Field(default=4, gt=0)
    task_tokens: LengthDist = const(512)
    step_output_tokens: LengthDist = LengthDist(dist="lognormal", mean=64, sigma=0.3, min=8,
                                                max=256)


class MixComponent(Strict):
    workload: str  # name of another [workloads.<name>] table
    weight: float = Field(gt=0)


class MixSpec(_Common):
    kind: Literal["mix"] = "mix"
    requests: int = Field(default=300, gt=0)
    components: list[MixComponent] = Field(min_length=1)


class TraceSpec(_Common):
    kind: Literal["trace"] = "trace"
    format: Literal["mooncake", "azure", "lmcache_agent"]
    path: str  # a file, or for lmcache_agent a directory of session files
    speedup: float = Field(default=1.0, gt=0)  # 2.0 replays twice as fast
    limit: int | None = Field(default=None, gt=0)
    jitter_s: float = Field(default=0.0, ge=0)  # spreads Mooncake's 3 s timestamp steps
    skip_bad_lines: bool = False
    max_output_tokens: int | None = Field(default=None, gt=0)  # clip replayed outputs


WorkloadSpec = Annotated[
    Union[RagSpec, AgentSpec, LongctxSpec, ChatSpec, HogwildSpec, MixSpec, TraceSpec],
    Field(discriminator="kind"),
]


def max_prompt_upper(spec) -> float:
    """An upper bound of the prompt tokens a spec can produce, for context checks
    (inf when unknown before generation)."""
    if isinstance(spec, LongctxSpec):
        return spec.contract_tokens.upper + spec.question_tokens.upper
    if isinstance(spec, ChatSpec):
        return spec.prompt_tokens.upper
    if isinstance(spec, RagSpec):
        return (spec.system_prompt_tokens + spec.top_k * spec.chunk_tokens.upper
                + spec.question_tokens.upper)
    return float("inf")


def max_output_upper(spec) -> float:
    for name in ("output_tokens", "step_output_tokens"):
        dist = getattr(spec, name, None)
        if dist is not None:
            return dist.upper
    return float("inf")
