"""What every ``[workloads.<name>]`` table shares: token-length distributions, working-set sizing,
and ``KindSpec``, the base of each kind's own spec (defined in the kind's module, beside its
generator, and chosen by its ``kind`` field). Token lengths are in tokens of the configured
tokenizer.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Mapping

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


class KindSpec(Strict):
    """Base of every kind's spec: a subclass adds ``kind: Literal["<kind>"] = "<kind>"`` and
    its own fields, and registers itself with ``kvbench.workloads.registry.register``."""

    kind: str
    seed: int | None = None  # overrides the suite seed for this workload
    api: Literal["chat", "completions"] = "chat"
    working_set: WorkingSet | None = None

    sizable: ClassVar[bool] = False  # True where working_set sizes the generated KV
    path_fields: ClassVar[tuple[str, ...]] = ()  # file paths, relative to the config file

    def max_prompt_upper(self) -> float:
        """An upper bound of the prompt tokens this table can produce, for context checks
        (inf when unknown before generation)."""
        return float("inf")

    def max_output_upper(self) -> float:
        """An upper bound of the max_tokens this table can ask for (inf when unknown)."""
        return float("inf")

    def parts(self) -> list[str]:
        """Names of the other ``[workloads.*]`` tables this one is built from (a mix's)."""
        return []

    def check_tables(self, name: str, tables: Mapping[str, "KindSpec"]) -> tuple[str, str] | None:
        """(field, problem and fix) where this table contradicts the others of its config."""
        return None

    def working_set_problem(self, name: str, sizable_kinds: list[str]) -> str | None:
        """Why ``working_set`` cannot be used here (None: it can, or it is not set)."""
        if self.working_set is None or self.sizable:
            return None
        kinds = ", ".join(sizable_kinds[:-1]) + " and " + sizable_kinds[-1] \
            if len(sizable_kinds) > 1 else "".join(sizable_kinds)
        return (f"workloads.{name}.working_set: sizing applies to {kinds} workloads, not "
                f"{self.kind}; remove working_set")
