"""What kvbench knows of one serving-engine family: its ``/metrics`` names, its tokenize call and
its prefix-cache reset call. Pure data and pure functions (no I/O): collectors, reports and
finalize read metric names from here, and the run layer makes the HTTP calls it describes.

Adding an engine family is one module in this package that calls ``register`` at import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping


@dataclass(frozen=True)
class HttpCall:
    """An HTTP call the run layer makes on an engine (``path`` is relative to the server root;
    ``{slot}`` in it is filled per slot where the engine resets per slot)."""

    method: str
    path: str
    note: str = ""  # what the server needs for it (a flag, a dev mode), shown when it fails


@dataclass(frozen=True)
class EngineAdapter:
    """One engine family. A metric name is the Prometheus sample name as scraped (counters with
    their ``_total`` suffix); ``None`` when the engine does not publish it."""

    name: str  # vllm | sglang | llamacpp | dynamo | builtin
    title: str  # for reports: "vLLM", "llama.cpp llama-server", ...
    prefixes: tuple[str, ...]  # metric-name prefixes that identify the family in /metrics
    # prefix cache, in prompt tokens: hits / queries is the engine's hit ratio
    prefix_hits: str | None = None
    prefix_queries: str | None = None
    # True when ``prefix_queries`` counts only the tokens the engine computed (cache misses),
    # so queries = hits + that counter (llama.cpp's prompt_tokens_total)
    queries_exclude_hits: bool = False
    # prompt tokens served from offload tiers below HBM (a KV connector: CPU DRAM, disk,
    # LMCache), counted apart from ``prefix_hits``: the engine's whole hit count is
    # ``prefix_hits`` + the first of these it publishes (they count the same hits, so never
    # more than one)
    tier_hits: tuple[str, ...] = ()
    prompt_tokens: str | None = None
    generation_tokens: str | None = None
    kv_usage: str | None = None  # gauge, fraction 0..1 of KV capacity in use
    running: str | None = None  # gauge, requests being computed
    waiting: str | None = None  # gauge, requests queued
    preemptions: str | None = None  # counter
    # an info-style gauge whose labels give the KV geometry (vLLM's cache_config_info)
    cache_config: str | None = None
    cache_config_geometry: Callable[[Mapping[str, str]], tuple[int, int] | None] | None = None
    # the granularity of prefix reuse where the engine publishes no KV geometry (vLLM's GPU
    # default block; token-granular reuse is 1)
    default_block_tokens: int = 16
    tokenize: HttpCall | None = None
    # the tokenize request for (model, prompt, messages); None where the engine cannot tokenize
    # that request (the caller falls back, e.g. to a one-token completion's usage)
    tokenize_body: Callable[[str, str | None, list | None], dict | None] | None = None
    tokenize_count: Callable[[dict], int | None] | None = None
    reset_cache: HttpCall | None = None
    list_slots: HttpCall | None = None  # where resets are per slot (llama.cpp)
    slot_ids: Callable[[object], list[int]] | None = None  # the ids in list_slots' reply
    notes: tuple[str, ...] = field(default_factory=tuple)
    priority: int = 0  # detection: higher wins when several families' names are present

    def owns(self, metric: str) -> bool:
        return metric.startswith(self.prefixes)

    def hit_counters(self) -> tuple[str, str] | None:
        """(hits, queries) counter names when the engine publishes both."""
        if self.prefix_hits and self.prefix_queries:
            return self.prefix_hits, self.prefix_queries
        return None

    def hit_ratio(self, hits_increase: float, queries_increase: float) -> float | None:
        """The engine's prefix-cache hit ratio from its counters' increases over a window."""
        total = queries_increase + (hits_increase if self.queries_exclude_hits else 0.0)
        if total <= 0:
            return None
        return hits_increase / total

    def geometry(self, labels: Mapping[str, str]) -> tuple[int, int] | None:
        """(block_tokens, capacity_tokens) from the labels of ``cache_config``, where given."""
        if self.cache_config_geometry is None:
            return None
        try:
            return self.cache_config_geometry(labels)
        except (KeyError, ValueError, TypeError):
            return None


_REGISTRY: dict[str, EngineAdapter] = {}


def register(adapter: EngineAdapter) -> EngineAdapter:
    if adapter.name in _REGISTRY and _REGISTRY[adapter.name] is not adapter:
        raise ValueError(f"engine adapter {adapter.name!r} is registered twice")
    _REGISTRY[adapter.name] = adapter
    return adapter


def adapters() -> list[EngineAdapter]:
    """Every registered adapter, highest detection priority first."""
    return sorted(_REGISTRY.values(), key=lambda a: (-a.priority, a.name))


def get(name: str) -> EngineAdapter:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no engine adapter {name!r}; known: {sorted(_REGISTRY)}") from None


def detect(metric_names: Iterable[str]) -> EngineAdapter | None:
    """The adapter whose prefixes the scraped metric names carry (None: unknown engine); the
    built-in emulator publishes vLLM's names too and wins by its priority."""
    names = set(metric_names)
    best = None
    for a in _REGISTRY.values():
        n = sum(1 for m in names if a.owns(m))
        if n and (best is None or (a.priority, n) > (best[0], best[1])):
            best = (a.priority, n, a)
    return best[2] if best else None
