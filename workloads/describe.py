"""What a workload sends, summarised: sizes, unique tokens and the prefix-cache hit ratio a
perfect cache could reach.

The theoretical hit ratio is token-level and contiguous, at the granularity of KV blocks: a
request's prompt (the rendered chat text for chat requests) is cut into full blocks of
``block_tokens`` tokens, each named by a hash chained over all blocks before it, and its hit is
the leading run of blocks already seen (partial blocks never hit, as in vLLM). "unbounded"
keeps every block; "lru" keeps ``capacity_tokens`` worth of blocks, touching a request's blocks
last-to-first so a prefix's tail is evicted before its head (vLLM frees blocks in that order).
``unique_tokens`` is what an unbounded cache would still compute: prompt tokens minus hits.
Mooncake traces use their own ``hash_ids`` (512-token blocks) without building any text.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, OrderedDict
from typing import Iterable

import numpy as np

from workloads.tokenizer import BuiltinTokenizer, get_tokenizer

_CHAIN_START = 0x6B7662656E6368  # any constant: starts every block-hash chain


def block_keys(tokens: list, block_tokens: int) -> list[int]:
    """Chained hashes of the full blocks of a token sequence (within one process)."""
    keys = []
    h = _CHAIN_START
    for j in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hash((h, tuple(tokens[j:j + block_tokens])))
        keys.append(h)
    return keys


class PrefixCacheSim:
    """Leading-block hits of a stream of block-key lists, unbounded and with an LRU."""

    def __init__(self, capacity_blocks: int | None):
        self.seen: set = set()
        self.lru: OrderedDict | None = OrderedDict() if capacity_blocks is not None else None
        self.capacity = capacity_blocks

    def add(self, keys) -> tuple[int, int | None]:
        seen = self.seen
        hit = 0
        for k in keys:
            if k not in seen:
                break
            hit += 1
        seen.update(keys)
        hit_lru = None
        lru = self.lru
        if lru is not None:
            hit_lru = 0
            for k in keys:
                if k not in lru:
                    break
                hit_lru += 1
            for k in reversed(keys):
                if k in lru:
                    lru.move_to_end(k)
                else:
                    lru[k] = None
            while len(lru) > self.capacity:
                lru.popitem(last=False)
        return hit, hit_lru


def _pcts(x: np.ndarray) -> dict:
    if len(x) == 0:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(x.max())}


class _Progress:
    def __init__(self, enabled: bool, label: str):
        self.enabled = enabled
        self.label = label
        self.t_next = time.monotonic() + 0.5
        self.shown = False

    def tick(self, n: int, tokens: int) -> None:
        if self.enabled and n % 256 == 0 and time.monotonic() >= self.t_next:
            self.t_next = time.monotonic() + 0.5
            sys.stderr.write(f"\rdescribe {self.label}: {n:,} requests, "
                             f"{tokens / 1e6:,.1f}M prompt tokens")
            sys.stderr.flush()
            self.shown = True

    def done(self, n: int, tokens: int) -> None:
        if self.shown:
            sys.stderr.write(f"\rdescribe {self.label}: {n:,} requests, "
                             f"{tokens / 1e6:,.1f}M prompt tokens, done\n")
            sys.stderr.flush()


def describe(workload_or_requests, *, block_tokens: int = 16,
             capacity_tokens: int | None = None, tokenizer=None, limit: int | None = None,
             progress: bool = False) -> dict:
    """The summary ``kvbench run`` stores in run.json under ``workloads[<name>]``.

    Keys: requests, prompt_tokens_pcts and output_tokens_pcts ({p50, p90, p99, max}; outputs
    are ``max_tokens``), unique_tokens, total_prompt_tokens, theoretical_hit_ratio_unbounded,
    theoretical_hit_ratio_lru (None without ``capacity_tokens``), plus block_tokens,
    capacity_tokens, classes ({class: requests}), shared_prefix_ratio (the generators'
    declared reusable share), duration_s (last arrival, when requests carry arrivals) and
    notes (e.g. skipped trace lines).
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    wl = workload_or_requests
    label = getattr(wl, "name", "requests")
    prog = _Progress(progress, label)
    prompt, output = [], []
    hits = hits_lru = 0
    declared = 0
    classes: Counter = Counter()
    last_arrival = None
    if hasattr(wl, "describe_blocks"):
        rows = wl.describe_blocks(block_tokens)
        sim = None
        total = 0
        for n, (p_tok, m_tok, keys, bt) in enumerate(rows, 1):
            if sim is None:
                block_tokens = bt
                sim = PrefixCacheSim(None if capacity_tokens is None
                                     else capacity_tokens // block_tokens)
            h, hl = sim.add(keys)
            hits += min(h * bt, p_tok)
            hits_lru += min((hl or 0) * bt, p_tok)
            prompt.append(p_tok)
            output.append(m_tok)
            total += p_tok
            prog.tick(n, total)
            if limit is not None and n >= limit:
                break
        classes[getattr(wl, "request_class", "trace")] = len(prompt)
        if hasattr(wl, "offsets_s") and len(prompt):
            last_arrival = float(np.max(wl.offsets_s[wl.order[: len(prompt)]]))
        declared = None
    else:
        reqs: Iterable = wl.requests() if hasattr(wl, "requests") else wl
        tok = tokenizer or getattr(wl, "tokenizer", None) or get_tokenizer()
        split = tok.tokens if isinstance(tok, BuiltinTokenizer) else tok.encode
        sim = PrefixCacheSim(None if capacity_tokens is None
                             else capacity_tokens // block_tokens)
        total = 0
        for n, r in enumerate(reqs, 1):
            text = tok.render_chat(r.messages) if r.messages is not None else r.prompt
            toks = split(text)
            h, hl = sim.add(block_keys(toks, block_tokens))
            hits += h * block_tokens
            hits_lru += (hl or 0) * block_tokens
            prompt.append(len(toks))
            output.append(r.max_tokens)
            declared += r.shared_prefix_tokens
            classes[r.request_class] += 1
            if r.arrival_offset_s is not None:
                last_arrival = max(last_arrival or 0.0, r.arrival_offset_s)
            total += len(toks)
            prog.tick(n, total)
            if limit is not None and n >= limit:
                break
    p = np.asarray(prompt, dtype=np.int64)
    total_prompt = int(p.sum())
    prog.done(len(prompt), total_prompt)
    return {
        "requests": len(prompt),
        "prompt_tokens_pcts": _pcts(p),
        "output_tokens_pcts": _pcts(np.asarray(output, dtype=np.int64)),
        "unique_tokens": total_prompt - hits,
        "total_prompt_tokens": total_prompt,
        "theoretical_hit_ratio_unbounded": hits / total_prompt if total_prompt else 0.0,
        "theoretical_hit_ratio_lru": (hits_lru / total_prompt if total_prompt else 0.0)
        if capacity_tokens is not None else None,
        "block_tokens": block_tokens,
        "capacity_tokens": capacity_tokens,
        "classes": dict(classes),
        "shared_prefix_ratio": (declared / total_prompt if total_prompt else 0.0)
        if declared is not None else None,
        "duration_s": last_arrival,
        "notes": list(getattr(wl, "notes", []) or []),
    }
