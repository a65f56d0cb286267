"""KV blocks of one simulated GPU: HBM with a prefix cache (chained 16-token block hashes, LRU
eviction of unreferenced blocks) and optional lower tiers (DRAM, disk) for offloading."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


def block_hashes(tokens: Sequence[str], block_tokens: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``: block i's hash covers blocks 0..i, so
    equal hashes mean equal prefixes (within one process; Python's str hash is per process)."""
    out = []
    h = 0
    for i in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hash((h, tuple(tokens[i:i + block_tokens])))
        out.append(h)
    return out


class Tier:
    """A lower tier (DRAM or disk) holding whole blocks by hash, LRU when full."""

    def __init__(self, name: str, capacity_blocks: int):
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.below: Tier | None = None

    def put(self, h: int) -> int:
        """Store one block; returns how many blocks were newly written to this tier."""
        if self.capacity_blocks <= 0:
            return 0
        if h in self.blocks:
            self.blocks.move_to_end(h)
            return 0
        self.blocks[h] = None
        while len(self.blocks) > self.capacity_blocks:
            old, _ = self.blocks.popitem(last=False)
            if self.below is not None:
                self.below.put(old)
        return 1

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def touch(self, h: int) -> None:
        self.blocks.move_to_end(h)

    def clear(self) -> int:
        """Forget every block (a prefix-cache reset); returns how many were held."""
        n = len(self.blocks)
        self.blocks.clear()
        return n


class HBMCache:
    """Blocks in HBM. Referenced blocks belong to running sequences; cached blocks with no
    reference stay reusable until evicted in LRU order when space is needed."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self.ref: dict[int, int] = {}  # cached block hash -> reference count
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached hashes with no reference
        self.anon = 0  # blocks held by sequences that are not (yet) in the prefix cache
        self.evictions = 0

    @property
    def used_blocks(self) -> int:
        """Blocks holding KV (referenced or cached)."""
        return len(self.ref) + self.anon

    @property
    def active_blocks(self) -> int:
        """Blocks referenced by running sequences (vLLM's kv_cache_usage counts these)."""
        return len(self.ref) - len(self.lru) + self.anon

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - len(self.ref) - self.anon

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` present in HBM."""
        n = 0
        ref = self.ref
        for h in hashes:
            if h not in ref:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            c = self.ref[h]
            if c == 0:
                del self.lru[h]
            self.ref[h] = c + 1

    def allocate(self, n: int) -> bool:
        """Take ``n`` anonymous blocks, evicting unreferenced cached blocks if needed."""
        short = n - self.free_blocks
        if short > len(self.lru):
            return False
        for _ in range(max(0, short)):
            h, _ = self.lru.popitem(last=False)
            del self.ref[h]
            self.evictions += 1
        self.anon += n
        return True

    def register(self, hashes: Sequence[int]) -> list[int]:
        """Turn anonymous blocks holding these full blocks into cached ones (one reference
        each). Returns the hashes that are new to the cache."""
        new = []
        for h in hashes:
            c = self.ref.get(h)
            if c is None:
                self.ref[h] = 1
                new.append(h)
            else:  # computed twice (two requests at once): keep one copy
                if c == 0:
                    del self.lru[h]
                self.ref[h] = c + 1
            self.anon -= 1
        return new

    def reset(self) -> int | None:
        """Forget every cached block, as vLLM's ``reset_prefix_cache``: only when no sequence
        holds a block (None otherwise, nothing dropped). Returns the blocks dropped."""
        if self.anon or len(self.lru) != len(self.ref):
            return None
        n = len(self.lru)
        self.lru.clear()
        self.ref.clear()
        return n

    def release(self, hashes: Sequence[int], anon: int) -> None:
        """Drop references; a sequence's tail blocks become the first to evict (as vLLM)."""
        for h in reversed(hashes):
            c = self.ref[h] - 1
            self.ref[h] = c
            if c == 0:
                self.lru[h] = None
        self.anon -= anon
