"""What every ``[workloads.<name>]`` table shares: token-length distributions, working-set sizing,
and ``KindSpec``, the base of each kind's own spec (defined in the kind's module, beside its
generator, and chosen by its ``kind`` field). Token lengths are in tokens of the configured
tokenizer.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

# Bounds no real suite reaches: past them a value is a typo, and a generator asked for it would
# exhaust memory or run for months. Every kind's table is held to them at load time.
MAX_REQUESTS = 10_000_000  # requests one table generates: over a day at 100 req/s
MAX_TOKENS = 10_000_000  # tokens of one prompt or output: the longest context windows served
MAX_SESSION_TURNS = 10_000  # turns, questions or steps of one session
# sessions a generator keeps active at once (round robin): 100,000 long contracts are billions
# of tokens of unique KV, past any cache tier
MAX_ACTIVE_SESSIONS = 100_000
MAX_SECONDS = 7 * 86400.0  # any duration or think time: a week
MAX_STRING = 4096  # characters of any text field (PATH_MAX on Linux)

# A name of a [workloads.*], [profiles.*] or [[endpoints]] table: it is printed in reports and
# used in paths and request ids, so plain characters only (no ":" that could read as an import
# path, no "/" or spaces).
from kvbench.core.contract import NAME_PATTERN  # noqa: E402
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]


class Strict(BaseModel):
    """Unknown fields are errors, floats are finite, strings are of sane length."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,
                              str_max_length=MAX_STRING)


class LengthDist(Strict):
    """A distribution of token counts (or seconds for think times), clipped to [min, max].

    ``constant``: always ``mean``. ``uniform``: integers in [min, max]. ``lognormal``: median
    ``mean`` and log-space sigma ``sigma``. ``normal``: ``mean`` and ``sigma``.
    """

    dist: Literal["constant", "uniform", "lognormal", "normal"] = "constant"
    mean: float = Field(gt=0, le=MAX_TOKENS)
    # lognormal sigma 10 spreads lengths over e^10 either side of the median: beyond any trace
    sigma: float = Field(default=0.0, ge=0, le=10)
    min: float = Field(default=1, ge=0, le=MAX_TOKENS)
    max: float | None = Field(default=None, gt=0, le=MAX_TOKENS)

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

    # 1e9 tokens: the KV of a 70B model in ~300 TB, more than a fleet's HBM and DRAM together
    kv_capacity_tokens: int = Field(gt=0, le=1_000_000_000)
    multiple: float = Field(gt=0, le=100)


class KindSpec(Strict):
    """Base of every kind's spec: a subclass adds ``kind: Literal["<kind>"] = "<kind>"`` and
    its own fields, and registers itself with ``kvbench.workloads.registry.register``."""

    kind: str
    seed: int | None = None  # overrides the suite seed for this workload
    api: Literal["chat", "completions"] = "chat"
    working_set: WorkingSet | None = None

    sizable: ClassVar[bool] = False  # True where working_set sizes the generated KV
    path_fields: ClassVar[tuple[str, ...]] = ()  # file paths, relative to the config file

    @model_validator(mode="after")
    def _sizes(self):
        n = self.planned_requests()
        if n is not None and n > MAX_REQUESTS:
            raise ValueError(f"this table generates {n:,} requests, over the {MAX_REQUESTS:,} "
                             "a real suite needs; lower its counts")
        for what, v in (("prompts", self.max_prompt_upper()),
                        ("outputs", self.max_output_upper())):
            if v != float("inf") and v > MAX_TOKENS:
                raise ValueError(f"{what} can reach {int(v):,} tokens, over the {MAX_TOKENS:,} "
                                 "of the longest context windows; lower the token sizes")
        return self

    def planned_requests(self) -> int | None:
        """How many requests the table generates (None: known only from its data)."""
        return None

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
