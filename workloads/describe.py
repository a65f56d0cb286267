"""What a workload sends, summarised: sizes, unique tokens and the prefix-cache hit ratio a
perfect cache could reach.

The theoretical hit ratio is token-level and contiguous, at the granularity of KV blocks: a
request's prompt (the rendered chat text for chat requests) is cut into full blocks of
``block_tokens`` tokens, each named by a hash chained over all blocks before it, and its hit is
the leading run of blocks already seen (partial blocks never hit, as in vLLM). "unbounded"
keeps every block; "lru" keeps ``capacity_tokens`` worth of blocks, touching a request's blocks
last-to-first so a prefix's tail is evicted before its head (vLLM frees blocks in that order).
``unique_tokens`` is what an unbounded cache would still compute: prompt tokens minus hits.
Mooncake traces use their own ``hash_ids`` (512-token blocks) without building any text, and
so do agentic-coding traces (64-token blocks). These also get an ``agentic`` section:
conversations, requests (sub-agents' included), sub-agent sessions, context growth (input
tokens of each conversation's first and last request, p50/p90) and the theoretical
within-conversation block hit ratio: a full block hits when its hash id appeared in an earlier
request of its own session or, for a sub-agent, of its parent before the spawn, requests in
file order; hit blocks over all full blocks (and the conversation-wide ratio, which also counts
a sibling sub-agent's earlier blocks).
"""

from __future__ import annotations

import sys
import time
from collections import Counter, OrderedDict
from typing import Iterable

import numpy as np

from kvbench.workloads.tokenizer import BuiltinTokenizer, get_tokenizer

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
    notes (e.g. skipped trace lines); ``agentic`` for agentic-coding traces (see the module
    docstring; None otherwise).
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
        # a completions prompt as the server tokenizes it (with the BOS it adds)
        split_prompt = tok.tokens if isinstance(tok, BuiltinTokenizer) else tok.encode_prompt
        sim = PrefixCacheSim(None if capacity_tokens is None
                             else capacity_tokens // block_tokens)
        total = 0
        for n, r in enumerate(reqs, 1):
            toks = split(tok.render_chat(r.messages)) if r.messages is not None \
                else split_prompt(r.prompt)
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
        "agentic": wl.describe_agentic() if hasattr(wl, "describe_agentic") else None,
    }


def base_request_id(request_id: str) -> str:
    """The workload's id of a sent request: later passes over a workload append ``#pass``."""
    i = request_id.rfind("#")
    return request_id[:i] if i > 0 and request_id[i + 1:].isdigit() else request_id


def describe_sent(workload, sent_ids, *, replicas=None, block_tokens: int = 16,
                  capacity_tokens: int | None = None, tokenizer=None) -> dict:
    """describe() over exactly the requests a run sent, in the order given (send order).

    ``sent_ids``: the records' request ids (``#pass`` suffixes of later passes repeat the
    workload's request). ``replicas``: the serving replica of each, when the endpoint said;
    with two or more, ``theoretical_hit_ratio_per_replica`` is the unbounded hit ratio when
    each replica only reuses blocks it computed itself (what any routing that spreads these
    requests the same way can reach). Adds requests_sent, unmatched (count) and
    unmatched_examples. Streams: the workload is walked forward once, holding only requests
    met before their first use, and each distinct prompt is tokenized once (its block keys
    kept only until its last repeat). A workload with ``sent_blocks`` (agentic traces) names
    each request's blocks from its hash ids instead, without building or tokenizing text.
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    sent_ids = [str(s) for s in sent_ids]
    if replicas is not None:
        replicas = [None if r is None else str(r) for r in replicas]
        if len(replicas) != len(sent_ids):
            raise ValueError("replicas must give one replica per sent id")
    bases = [base_request_id(s) for s in sent_ids]
    left = Counter(bases)  # uses still to come of each workload request
    reqs = iter(workload.requests() if hasattr(workload, "requests") else workload)
    ahead: dict = {}  # requests met while walking, before their first use (out of order)
    walked_all = False

    def first_use(base: str):
        """The workload's request ``base``, walking forward once; None when it has none."""
        nonlocal walked_all
        r = ahead.pop(base, None)
        if r is not None or walked_all:
            return r
        for r in reqs:
            rid = r.request_id
            if rid == base:
                return r
            if left.get(rid, 0) > 0 and rid not in ahead:
                ahead[rid] = r
        walked_all = True
        return None

    tok = tokenizer or getattr(workload, "tokenizer", None) or get_tokenizer()
    split = tok.tokens if isinstance(tok, BuiltinTokenizer) else tok.encode
    split_prompt = tok.tokens if isinstance(tok, BuiltinTokenizer) else tok.encode_prompt
    # base id -> (prompt tokens, block keys, max_tokens, class, declared shared, arrival),
    # kept only while the id has uses to come (later passes)
    summary_of: dict = {}
    pooled = PrefixCacheSim(None if capacity_tokens is None else capacity_tokens // block_tokens)
    per_rep: dict = {}
    n_rep = len({r for r in replicas if r is not None}) if replicas is not None else 0
    prompt, output = [], []
    hits = hits_lru = hits_rep = declared = routed_away = 0
    classes: Counter = Counter()
    missing: list = []
    last_arrival = None
    from_ids = getattr(workload, "sent_blocks", None)
    for k, base in enumerate(bases):
        got = summary_of.get(base)
        if got is None and from_ids is not None:
            got = from_ids(base, block_tokens)
            if got is None:
                left[base] -= 1
                missing.append(sent_ids[k])
                continue
        if got is None:
            r = first_use(base)
            if r is None:
                left[base] -= 1
                missing.append(sent_ids[k])
                continue
            toks = split(tok.render_chat(r.messages)) if r.messages is not None \
                else split_prompt(r.prompt)
            got = (len(toks), block_keys(toks, block_tokens), r.max_tokens, r.request_class,
                   r.shared_prefix_tokens, r.arrival_offset_s)
        left[base] -= 1
        if left[base] > 0:
            summary_of[base] = got
        else:
            summary_of.pop(base, None)
        n_tok, keys, max_tokens, cls, shared, arrival = got
        h, hl = pooled.add(keys)
        hits += h * block_tokens
        hits_lru += (hl or 0) * block_tokens
        if n_rep >= 2:
            rep = replicas[k]
            sim = per_rep.get(rep)
            if sim is None:
                sim = per_rep[rep] = PrefixCacheSim(None)
            hr, _ = sim.add(keys)
            hits_rep += hr * block_tokens
            routed_away += hr < h
        prompt.append(n_tok)
        output.append(max_tokens)
        declared += shared
        classes[cls] += 1
        if arrival is not None:
            last_arrival = max(last_arrival or 0.0, arrival)
    p = np.asarray(prompt, dtype=np.int64)
    total = int(p.sum())

    def ratio(x):
        return x / total if total else 0.0

    return {
        "requests": len(prompt),
        "requests_sent": len(sent_ids),
        "unmatched": len(missing),
        "unmatched_examples": missing[:5],
        "prompt_tokens_pcts": _pcts(p),
        "output_tokens_pcts": _pcts(np.asarray(output, dtype=np.int64)),
        "unique_tokens": total - hits,
        "total_prompt_tokens": total,
        "theoretical_hit_ratio_unbounded": ratio(hits),
        "theoretical_hit_ratio_lru": ratio(hits_lru) if capacity_tokens is not None else None,
        "theoretical_hit_ratio_per_replica": ratio(hits_rep) if n_rep >= 2 else None,
        "replicas": n_rep,
        "requests_hit_elsewhere": int(routed_away) if n_rep >= 2 else None,
        "block_tokens": block_tokens,
        "capacity_tokens": capacity_tokens,
        "classes": dict(classes),
        "shared_prefix_ratio": ratio(declared),
        "duration_s": last_arrival,
        "notes": list(getattr(workload, "notes", []) or []),
    }


def sent_descriptions(records, workloads, caches=None) -> dict:
    """``{endpoint: {workload: describe_sent(...)}}`` from a run's request records.

    ``records``: columns endpoint, workload, request_id, t_sent_ns and optionally
    server_replica, status, ttft_ns (a mapping of equal-length sequences, e.g. an Arrow table's
    ``to_pydict()``). Only requests the server prefilled count (status ok, or a first token
    seen), in t_sent order. ``workloads``: name -> workload; names not given are skipped.
    ``caches``: endpoint -> {"block_tokens", "capacity_tokens"} (the engine's KV block and
    per-replica capacity, where known).
    """
    caches = caches or {}
    n = len(records["request_id"])
    status = records.get("status") or [None] * n
    ttft = records.get("ttft_ns") or [None] * n
    rep = records.get("server_replica") or [None] * n
    groups: dict = {}
    for i in range(n):
        if status[i] not in (None, "ok") and ttft[i] is None:
            continue
        key = (records["endpoint"][i], records["workload"][i])
        if key[1] not in workloads or records["request_id"][i] is None:
            continue
        groups.setdefault(key, []).append(i)
    out: dict = {}
    t_sent = records["t_sent_ns"]
    for (ep, wl), rows in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        rows.sort(key=lambda i: (t_sent[i] or 0, i))
        cache = caches.get(ep) or {}
        out.setdefault(str(ep), {})[wl] = describe_sent(
            workloads[wl], [records["request_id"][i] for i in rows],
            replicas=[rep[i] for i in rows], block_tokens=int(cache.get("block_tokens") or 16),
            capacity_tokens=cache.get("capacity_tokens"))
    return out
