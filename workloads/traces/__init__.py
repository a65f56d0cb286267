"""Replay of real serving traces: Mooncake JSONL, Azure 2023 CSV, LMCache agent sessions,
agentic-coding conversations (kv-cache-tester JSON, with sub-agents).

Every reader streams its file once into compact columns (no prompt text is built while
reading); prompt text is built lazily per request. A malformed line is a ``UserError`` naming
``file:line`` (or, with ``skip_bad_lines``, counted in ``skipped_lines``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, ClassVar, Iterator, Literal, Union

import numpy as np
from pydantic import Field, model_validator

from kvbench.core.errors import UserError
from kvbench.workloads.base import Request, SingleTurnSession
from kvbench.workloads.common import GeneratedWorkload, rng_for
from kvbench.workloads.prompt import Assembler
from kvbench.workloads.registry import BuildContext, register
from kvbench.workloads.specs import MAX_REQUESTS, MAX_SECONDS, MAX_TOKENS, KindSpec

FORMATS = ("mooncake", "azure", "lmcache_agent", "agentic")
# A trace's timestamps span at most a year (the public ones span an hour to a week): later
# ones are damage, and an arrival that far out would hold a run open for ever.
MAX_SPAN_S = 366 * 86400.0


def shown(value, n: int = 40) -> str:
    """A value of a trace line quoted in a message, cut to ``n`` characters."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


class TraceSpec(KindSpec):
    kind: Literal["trace"] = "trace"
    format: Literal["mooncake", "azure", "lmcache_agent", "agentic"]
    path: str  # a file, or for lmcache_agent and agentic a directory of session files
    # 2.0 replays twice as fast; past 1e6 a day of trace is sent in under a tenth of a second
    speedup: float = Field(default=1.0, gt=0, le=1e6)
    limit: int | None = Field(default=None, gt=0, le=MAX_REQUESTS)
    jitter_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS)  # spreads Mooncake's 3 s steps
    skip_bad_lines: bool = False
    max_output_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS)  # clip outputs
    # agentic only: the tool definitions + system prompt shared by every conversation
    # ("shared"), each conversation's own ("per_conversation"), or only that fraction of it
    # shared (kv-cache-tester's warm prefix)
    shared_prefix: Union[Literal["shared", "per_conversation"],
                         Annotated[float, Field(ge=0, le=1)]] = "shared"
    min_tokens: bool = False  # agentic: send min_tokens = max_tokens (the answer's length)
    conversations: int | None = Field(default=None, gt=0, le=MAX_REQUESTS)  # agentic: cap
    # agentic: leave out whole conversations with a request over this many tokens (input plus
    # output as sent): a trace's longest contexts (452k) past an endpoint's (131,072)
    max_context_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS)

    path_fields: ClassVar[tuple[str, ...]] = ("path",)

    @model_validator(mode="after")
    def _agentic_only(self):
        if self.format != "agentic":
            for key, default in (("shared_prefix", "shared"), ("min_tokens", False),
                                 ("conversations", None), ("max_context_tokens", None)):
                if getattr(self, key) != default:
                    raise ValueError(f"{key} applies to format = \"agentic\" only; remove it")
        return self


def traces_dir() -> Path:
    """Where the real public traces live: ``$KVBENCH_TRACES`` or ``../shared/traces`` from
    the repository root (absent on most machines)."""
    env = os.environ.get("KVBENCH_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def guess_format(path: Path) -> str:
    """The trace format from the path: a directory is LMCache agent sessions (``.jsonl``
    files) or agentic-coding conversations (``.json`` files), ``.json`` is an agentic-coding
    conversation, ``.csv`` is Azure, ``.jsonl`` is Mooncake unless its first record has an
    ``input`` text."""
    if path.is_dir():
        has_jsonl = next(path.glob("*.jsonl"), None) is not None
        return "agentic" if not has_jsonl and next(path.glob("*.json"), None) is not None \
            else "lmcache_agent"
    if path.suffix.lower() == ".json":
        return "agentic"
    if path.suffix.lower() == ".csv":
        return "azure"
    try:
        with path.open("rb") as fh:
            first = fh.readline()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the trace ({exc.strerror}); check the path") \
            from None
    return "lmcache_agent" if b'"input"' in first else "mooncake"


class BadLines:
    """Collects malformed lines: raises at the first one unless skipping."""

    def __init__(self, path: Path, skip: bool):
        self.path = path
        self.skip = skip
        self.count = 0
        self.first: str | None = None

    def __call__(self, line_no: int, what: str) -> None:
        if not self.skip:
            raise UserError(f"{self.path}:{line_no}: {what}; fix the line or set "
                            "skip_bad_lines = true to skip such lines")
        self.count += 1
        if self.first is None:
            self.first = f"{self.path}:{line_no}: {what}"


class TraceWorkload(GeneratedWorkload):
    """Base of the readers: requests carry ``arrival_offset_s`` (trace time / speedup, plus
    the seeded uniform ``jitter_s``), sorted by it."""

    request_class = "trace"
    has_arrivals = True

    def __init__(self, name: str, spec: TraceSpec, tokenizer, seed: int):
        super().__init__(name, spec, tokenizer, seed)
        self.path = Path(spec.path)
        if not self.path.exists():
            raise UserError(f"workloads.{name}.path: {self.path} does not exist; give the path "
                            f"of a {spec.format} trace")
        self.asm = Assembler(tokenizer, spec.api)
        self.skipped_lines = 0
        self.skipped_records = 0
        self.notes: list[str] = []

    def _arrivals(self, trace_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Offsets in seconds and the send order (stable sort by offset)."""
        t = np.asarray(trace_s, dtype=float)
        if self.spec.jitter_s > 0 and len(t):
            t = t + rng_for(self.seed, self.name, "jitter").uniform(0, self.spec.jitter_s,
                                                                      len(t))
        t = t / self.spec.speedup
        order = np.argsort(t, kind="stable")
        return t, order

    def _max_tokens(self, n: int) -> int:
        m = self.spec.max_output_tokens
        return max(1, n if m is None else min(n, m))

    def _require_requests(self, n: int, where: Path, first_bad: str | None = None) -> None:
        """A trace with no request to replay is an error, not an empty run."""
        if n:
            return
        why = ""
        if self.skipped_lines:
            why = f" (all {self.skipped_lines} of its lines are malformed, the first: {first_bad})"
        elif self.skipped_records:
            why = f" (all {self.skipped_records} of its records have an empty input or output)"
        raise UserError(f"{where}: the trace holds no requests{why}; give the path of a "
                        f"{self.spec.format} trace with at least one request")

    def _note_bad(self, bad: BadLines) -> None:
        self.skipped_lines = bad.count
        if bad.count:
            self.notes.append(f"skipped {bad.count} malformed line(s) of {bad.path}, "
                              f"the first: {bad.first}")

    def build_request(self, i: int) -> Request:  # pragma: no cover - per reader
        raise NotImplementedError

    def requests(self) -> Iterator[Request]:
        return (self.build_request(int(i)) for i in self.order)

    def sessions(self):
        return (SingleTurnSession(r) for r in self.requests())

    def __len__(self) -> int:
        return len(self.order)


def open_trace(name: str, spec: TraceSpec, tokenizer, seed: int) -> TraceWorkload:
    if spec.format == "mooncake":
        from kvbench.workloads.traces.mooncake import MooncakeTrace
        return MooncakeTrace(name, spec, tokenizer, seed)
    if spec.format == "azure":
        from kvbench.workloads.traces.azure import AzureTrace
        return AzureTrace(name, spec, tokenizer, seed)
    if spec.format == "agentic":
        from kvbench.workloads.traces.agentic import AgenticTrace
        return AgenticTrace(name, spec, tokenizer, seed)
    from kvbench.workloads.traces.lmcache_agent import LMCacheAgentTrace
    return LMCacheAgentTrace(name, spec, tokenizer, seed)


def _build(name: str, spec: TraceSpec, ctx: BuildContext) -> TraceWorkload:
    n = ctx.n_requests
    if n is not None and (spec.limit is None or spec.limit > n):
        spec = spec.model_copy(update={"limit": n})
    return open_trace(name, spec, ctx.tokenizer, ctx.seed)


register(spec=TraceSpec, build=_build, request_class=TraceWorkload.request_class)
