"""Pieces every generator shares: the LengthDist sampler, seeded generators, and the base
class that turns a workload's sessions into a flat, synthetically answered request stream."""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Iterable, Iterator

import numpy as np

from kvbench.workloads.base import Request, Session
from kvbench.workloads.specs import MAX_TOKENS, LengthDist
from kvbench.workloads.text import TextFactory, key_seed
from kvbench.workloads.tokenizer import BuiltinTokenizer, Tokenizer

_POOL = 16384  # words in the synthetic-response pool


def rng_for(seed: int, *parts: object) -> np.random.Generator:
    """An independent generator per (seed, purpose): streams never shift one another."""
    return np.random.default_rng(key_seed(seed, *parts))


def sample(dist: LengthDist, rng: np.random.Generator, n: int, *,
           integer: bool = True) -> np.ndarray:
    """``n`` draws of ``dist`` clipped to [min, max] (no max: the schema's bound on any length,
    so a wide lognormal never overflows); int64 token counts, or float64 seconds with
    ``integer=False``. ``lognormal`` takes ``mean`` as the median (exp of the log mean)."""
    lo = float(dist.min)
    hi = float(MAX_TOKENS if dist.max is None else dist.max)
    if dist.dist == "constant":
        x = np.full(n, float(dist.mean))
    elif dist.dist == "uniform":
        if integer:
            x = rng.integers(math.ceil(lo), math.floor(hi), size=n, endpoint=True).astype(float)
        else:
            x = rng.uniform(lo, hi, size=n)
    elif dist.dist == "lognormal":
        x = np.exp(math.log(dist.mean) + dist.sigma * rng.standard_normal(n))
    else:  # normal
        x = dist.mean + dist.sigma * rng.standard_normal(n)
    if integer:
        x = np.rint(x)
        lo, hi = math.ceil(lo), math.floor(hi)
    x = np.clip(x, lo, hi)
    return x.astype(np.int64) if integer else x


def zipf_cdf(n: int, s: float) -> np.ndarray:
    """Cumulative Zipf(s) popularity over ranks 1..n (rank 1 the most popular)."""
    w = 1.0 / np.arange(1, n + 1, dtype=float) ** s
    c = np.cumsum(w)
    return c / c[-1]


class GeneratedWorkload:
    """Base of the generators: ``requests()`` flattens ``sessions()`` and answers each request
    with a synthetic response of exactly ``max_tokens`` tokens.

    ``flatten_order``: "sequential" (each session to its end) or "round_robin" (one turn of
    every active session, then the answers, then the next turn; at most ``window`` sessions
    active at once, new ones start as others end).
    """

    name: str
    request_class: str
    has_arrivals = False
    flatten_order = "sequential"
    window: int | None = None

    def __init__(self, name: str, spec, tokenizer: Tokenizer, seed: int):
        self.name = name
        self.spec = spec
        self.tokenizer = tokenizer
        self.seed = seed
        self.text = TextFactory(tokenizer, seed)
        self._pool: list[str] | None = None

    def sessions(self) -> Iterator[Session]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def synthetic_response(self, req: Request) -> str:
        """Exactly ``max_tokens`` tokens standing in for the endpoint's answer: a window of a
        shared word pool at an offset hashed from the request id (for the built-in tokenizer,
        where words add up exactly; a fresh segment otherwise)."""
        n = req.max_tokens
        if self._pool is None:
            self._pool = self.text.segment(f"{self.name}/response-pool", _POOL).split(" ")[1:] \
                if isinstance(self.tokenizer, BuiltinTokenizer) else []
        if n > len(self._pool) or n <= 0:
            return self.text.segment(f"{self.name}/response/{req.request_id}", n)
        off = key_seed(self.seed, self.name, req.request_id) % (len(self._pool) - n + 1)
        return " " + " ".join(self._pool[off:off + n])

    def requests(self) -> Iterator[Request]:
        return flatten(self.sessions(), self.flatten_order, self.synthetic_response,
                       self.window)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def flatten(sessions: Iterable[Session], order: str,
            respond: Callable[[Request], str], window: int | None = None) -> Iterator[Request]:
    """Requests of ``sessions`` in send order, each answered by ``respond`` before its
    session's next turn (round robin answers a whole round after sending it)."""
    if order == "sequential":
        for s in sessions:
            while (req := s.next_request()) is not None:
                yield req
                s.feed_response(respond(req))
        return
    it = iter(sessions)
    active: deque = deque()
    limit = window or math.inf

    def refill() -> None:
        while len(active) < limit:
            nxt = next(it, None)
            if nxt is None:
                return
            active.append(nxt)

    refill()
    while active:
        sent = []
        for s in list(active):
            req = s.next_request()
            if req is None:
                active.remove(s)
                continue
            yield req
            sent.append((s, req))
        for s, req in sent:
            s.feed_response(respond(req))
        refill()
