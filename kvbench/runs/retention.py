"""The retention probe: how long does a prefix stay cached while other traffic runs?

For each background working set (a multiple of the endpoint's KV capacity) and each idle gap on
a geometric ladder: reset the cache where the engine can, send a probe prompt (a prefix no other
request shares), send background prompts cycling over the working set at a fixed token rate for
the gap, resend the probe, and record its cached tokens and time to its one output token. Every
background answer's usage says how many of its tokens the engine computed (not cached): the
tokens that needed fresh KV blocks, which is what pushes the probe out of an LRU cache.

Plain HTTP from threads (urllib): the probe's own timing matters only at the gap's scale
(tenths of seconds and more), and the background rate is tens of requests per second."""

from __future__ import annotations

import math
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from kvbench import engines
from kvbench.core.errors import UserError
from kvbench.runs import cache
from kvbench.runs.preflight import http_json

REQUEST_TIMEOUT_S = 120.0
MAX_BACKGROUND_THREADS = 32


@dataclass
class ProbeSpec:
    gaps_s: list[float]  # idle gaps between the probe and its resend
    working_sets: list[float]  # background distinct tokens, as multiples of capacity_tokens
    capacity_tokens: int  # KV capacity of the replica serving the probe
    block_tokens: int = 16
    probe_tokens: int = 0  # 0: capacity / 16
    background_tokens: int = 0  # per background prompt; 0: capacity / 32
    rate_tokens_s: float = 0.0  # background prompt tokens per second; 0: knee mid-ladder
    trials: int = 1
    seed: int = 0

    def resolved(self) -> "ProbeSpec":
        """The spec with its defaults filled from the capacity and the ladder."""
        c = self.capacity_tokens
        probe = self.probe_tokens or max(self.block_tokens, c // 16)
        bg = self.background_tokens or max(self.block_tokens, c // 32)
        rate = self.rate_tokens_s
        if rate <= 0:  # the LRU knee (capacity - probe/2 new tokens) at the ladder's middle
            mid = math.sqrt(min(self.gaps_s) * max(self.gaps_s))
            rate = (c - probe / 2) / mid
        return ProbeSpec(sorted(self.gaps_s), sorted(self.working_sets), c, self.block_tokens,
                         probe, bg, rate, self.trials, self.seed)

    def predicted_knee(self) -> tuple[float, float]:
        """Under LRU with tail-first eviction (vLLM, the emulator) the probe starts losing
        blocks once ``capacity - probe`` new background tokens were computed after it and is
        gone at ``capacity``: (new background tokens at half the probe lost, the gap at the
        spec's rate), when the working set cannot sit beside the probe."""
        tokens = self.capacity_tokens - self.probe_tokens / 2
        return tokens, tokens / self.rate_tokens_s

    def evicts(self, multiple: float) -> bool:
        """Whether a working set of ``multiple`` x capacity pushes the probe out (it does not
        when it fits beside the probe: its later passes are all hits)."""
        return multiple * self.capacity_tokens > self.capacity_tokens - self.probe_tokens


@dataclass
class Point:
    working_set: float
    gap_s: float
    trial: int
    probe_tokens: int
    cached_tokens: int | None  # of the resent probe
    first_cached_tokens: int | None  # of the probe's first send (0 after a reset)
    ttft_s: float  # resend: seconds to its one-token answer
    ttft_cold_s: float  # first send
    gap_actual_s: float  # from the first answer to the resend
    background_requests: int = 0
    background_tokens: int = 0  # prompt tokens the server counted, answered before the resend
    background_new_tokens: int = 0  # of those, the ones it computed (not cached)
    background_errors: int = 0
    reset: str = ""

    @property
    def hit_fraction(self) -> float | None:
        if self.cached_tokens is None or not self.probe_tokens:
            return None
        return min(1.0, self.cached_tokens / self.probe_tokens)


@dataclass
class Result:
    spec: ProbeSpec
    endpoint: str
    engine: str
    points: list[Point] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        tokens, gap = self.spec.predicted_knee()
        return {"endpoint": self.endpoint, "engine": self.engine, "spec": asdict(self.spec),
                "predicted_knee": {"new_tokens": tokens, "gap_s": gap},
                "points": [{**asdict(p), "hit_fraction": p.hit_fraction} for p in self.points],
                "notes": list(self.notes)}


class Prober:
    """Sends the probe and its background to one OpenAI-compatible endpoint."""

    def __init__(self, url: str, model: str, headers: dict, tokenizer, adapter):
        from kvbench.workloads.text import TextFactory

        self.url, self.model, self.headers = url.rstrip("/"), model, dict(headers)
        self.adapter = adapter
        self.text = TextFactory(tokenizer, seed=0)
        self.lock = threading.Lock()

    def complete(self, prompt: str) -> tuple[dict, float]:
        """(usage, seconds) of a one-token completion."""
        t0 = time.perf_counter()
        out = http_json(self.url + "/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": 1, "stream": False,
            "temperature": 0}, self.headers, timeout=REQUEST_TIMEOUT_S)
        return out.get("usage") or {}, time.perf_counter() - t0

    def point(self, spec: ProbeSpec, multiple: float, gap_s: float, trial: int,
              tag: str) -> Point:
        reset = ""
        if self.adapter.reset_cache is not None:
            done, how = cache.reset(self.url, self.adapter, self.headers)
            reset = how if done else f"not reset: {how}"
        probe = self.text.words_only(f"retention-probe/{tag}/{multiple}/{gap_s}/{trial}",
                                     spec.probe_tokens)
        usage, cold_s = self.complete(probe)
        first_cached = _cached(usage)
        n_prompts = max(1, math.ceil(multiple * spec.capacity_tokens / spec.background_tokens))
        bg = [self.text.words_only(f"retention-bg/{tag}/{multiple}/{gap_s}/{trial}/{i}",
                                   spec.background_tokens) for i in range(n_prompts)]
        period = spec.background_tokens / spec.rate_tokens_s
        t_answer = time.perf_counter()
        stats = {"requests": 0, "tokens": 0, "new": 0, "errors": 0}
        deadline = t_answer + gap_s

        def send(prompt: str) -> None:
            try:
                u, _ = self.complete(prompt)
            except (urllib.error.URLError, OSError, ValueError):
                with self.lock:
                    stats["errors"] += 1
                return
            if time.perf_counter() > deadline:
                return  # answered after the resend went out: not in this gap's count
            p, c = int(u.get("prompt_tokens") or 0), _cached(u) or 0
            with self.lock:
                stats["requests"] += 1
                stats["tokens"] += p
                stats["new"] += p - c

        with ThreadPoolExecutor(MAX_BACKGROUND_THREADS) as pool:
            k = 0
            while True:
                t_next = t_answer + k * period
                if t_next >= deadline:
                    break
                time.sleep(max(0.0, t_next - time.perf_counter()))
                pool.submit(send, bg[k % len(bg)])
                k += 1
            time.sleep(max(0.0, deadline - time.perf_counter()))
            gap_actual = time.perf_counter() - t_answer
            usage, warm_s = self.complete(probe)
            with self.lock:
                snap = dict(stats)
        return Point(multiple, gap_s, trial, spec.probe_tokens, _cached(usage), first_cached,
                     warm_s, cold_s, gap_actual, snap["requests"], snap["tokens"], snap["new"],
                     snap["errors"], reset)


def _cached(usage: dict) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    v = details.get("cached_tokens")
    return int(v) if v is not None else None


def ladder(lo: float, hi: float, factor: float = 2.0) -> list[float]:
    """``lo, lo*factor, ...`` up to ``hi`` (inclusive within rounding)."""
    if lo <= 0 or hi < lo or factor <= 1:
        raise UserError(f"--gaps {lo:g}:{hi:g}: give 0 < low <= high (and a factor above 1)")
    out, g = [], lo
    while g <= hi * (1 + 1e-9):
        out.append(round(g, 6))
        g *= factor
    return out


def probe(url: str, model: str, spec: ProbeSpec, *, headers: dict | None = None,
          tokenizer=None, adapter: engines.EngineAdapter | None = None, endpoint: str = "",
          progress=None) -> Result:
    """The whole ladder: every working set x gap x trial, in that order."""
    from kvbench.workloads.tokenizer import get_tokenizer

    adapter = adapter or engines.get("vllm")
    spec = spec.resolved()
    res = Result(spec, endpoint or url, adapter.name)
    if adapter.reset_cache is None:
        res.notes.append(f"{adapter.title} has no cache-reset call: each probe is a fresh "
                         "prefix, but the cache holds earlier points' background")
    prober = Prober(url, model, headers or {}, tokenizer or get_tokenizer(), adapter)
    tag = f"{time.time_ns()}"
    for m in spec.working_sets:
        for g in spec.gaps_s:
            for t in range(spec.trials):
                p = prober.point(spec, m, g, t, tag)
                res.points.append(p)
                if progress:
                    progress(p)
    if all(p.cached_tokens is None for p in res.points):
        res.notes.append("the server reported no cached_tokens: hit fractions are unknown "
                         "(vLLM needs --enable-prompt-tokens-details)")
    return res
