"""Request routers over replicas in regions: ROUND_ROBIN (an ALB in the caller's region),
REGIONAL (cache-aware on prefix hashes within the caller's region) and GLOBAL (cache-aware
across regions, paying the cross-region round trip). A residency constraint always wins.

Session affinity: a request that names its session (the emulator's ``pin_header``, e.g.
``X-Session-ID``) goes to the replica its session's first request went to, as long as that
replica is in a region the request may use; the first request of a session is routed by the
policy (cache-aware or round-robin) and pins the session. What a real router's sticky sessions
do: a session's growing context stays on the replica that holds its KV blocks even when a
cache-aware estimate would move it (a long session's blocks are spread out by then).

Requests in transit: between the routing decision and the engine's queue lies the front end
(tokenising, the offload connector, a cross-region round trip), tens of milliseconds for a
100k-token prompt. The cache-aware estimate counts the requests it routed that have not reached
their engine yet (their uncached prefill, their number), as a real router counts its own
in-flight requests. Without it a burst of sessions starting together saw every replica idle
and all went to the first one, and pinned there (24 agent sessions on 12 replicas: a 0.56 hit
ratio against 0.93 for round robin with pinning, bench/bakeoff_sim.py). Round robin
consults no estimate, so nothing is counted for it."""

from __future__ import annotations

from collections import OrderedDict

from kvbench.endpoints.engine import Engine
from kvbench.endpoints.seq import Seq


MAX_PINNED = 100_000  # sessions remembered (the least recently used forgotten first)


class RoutingError(Exception):
    """A request names a region this endpoint does not have."""


class Router:
    def __init__(self, strategy: str, regions: dict[str, list[Engine]], rtt_ms: float,
                 prefill_tok_per_ms: float, block_tokens: int):
        self.strategy = strategy
        self.regions = regions
        self.rtt_ms = rtt_ms
        self.rate = prefill_tok_per_ms
        self.bt = block_tokens
        self._rr = {name: 0 for name in regions}
        # session -> (region, engine), least recently used first, at most MAX_PINNED
        self._pinned: OrderedDict[str, tuple[str, Engine]] = OrderedDict()
        self.default_region = next(iter(regions))
        # requests routed, not yet in their engine's queue: id(seq) -> (engine, uncached
        # tokens); per engine name: [requests, uncached tokens]
        self._transit_of: dict[int, tuple[Engine, int]] = {}
        self._transit: dict[str, list[int]] = {}

    def region_of(self, name: str | None, what: str) -> str | None:
        if name is None or name == "":
            return None
        if name not in self.regions:
            raise RoutingError(f"header {what}: unknown region {name!r}; use one of "
                               f"{sorted(self.regions)}")
        return name

    def cached_tokens(self, eng: Engine, seq: Seq) -> int:
        """Prompt tokens ``eng`` would not recompute (HBM, then its lower tiers)."""
        hashes = seq.hashes
        k = eng.cache.match(hashes)
        if eng.dram is not None:
            dram, disk = eng.dram, eng.disk
            while k < len(hashes) and (hashes[k] in dram or (disk is not None
                                                              and hashes[k] in disk)):
                k += 1
        return k * self.bt

    def estimate_ms(self, eng: Engine, seq: Seq, cross: bool) -> float:
        """Expected TTFT on ``eng``: round trip, queued prefill work, our uncached prefill."""
        todo = seq.n_prompt - self.cached_tokens(eng, seq)
        transit = self._transit.get(eng.name, (0, 0))[1]
        return (self.rtt_ms if cross else 0.0) + eng.load_ms() + (transit + todo) / self.rate

    def _routed(self, eng: Engine, seq: Seq) -> None:
        """``seq`` is on its way to ``eng`` (until ``arrived``)."""
        if self.strategy == "ROUND_ROBIN":
            return
        todo = seq.n_prompt - self.cached_tokens(eng, seq)
        self._transit_of[id(seq)] = (eng, todo)
        t = self._transit.setdefault(eng.name, [0, 0])
        t[0] += 1
        t[1] += todo

    def arrived(self, seq: Seq) -> None:
        """``seq`` reached its engine's queue, or was dropped on the way."""
        got = self._transit_of.pop(id(seq), None)
        if got is not None:
            t = self._transit[got[0].name]
            t[0] -= 1
            t[1] -= got[1]

    def pick(self, seq: Seq, caller: str | None = None, residency: str | None = None,
             session: str | None = None) -> tuple[Engine, bool]:
        """The engine to serve ``seq`` and whether it is in another region than the caller;
        ``session``: pin the session to the replica it was first routed to."""
        eng, cross = self._pick_pinned(seq, caller, residency, session)
        self._routed(eng, seq)
        return eng, cross

    def _pick_pinned(self, seq: Seq, caller: str | None, residency: str | None,
                     session: str | None) -> tuple[Engine, bool]:
        if not session:
            return self._pick(seq, caller, residency)
        caller_reg = self.region_of(caller, "x-kvbench-region") or self.default_region
        allowed_res = self.region_of(residency, "x-kvbench-residency")
        pinned = self._pinned.get(session)
        if pinned is not None:
            reg, eng = pinned
            allowed = ({allowed_res} if allowed_res is not None else set(self.regions)
                       if self.strategy == "GLOBAL" else {caller_reg})
            if reg in allowed:
                self._pinned.move_to_end(session)
                return eng, reg != caller_reg
        eng, cross = self._pick(seq, caller, residency)
        self._pinned[session] = (eng.region, eng)
        self._pinned.move_to_end(session)
        if len(self._pinned) > MAX_PINNED:
            self._pinned.popitem(last=False)
        return eng, cross

    def _pick(self, seq: Seq, caller: str | None = None,
              residency: str | None = None) -> tuple[Engine, bool]:
        caller = self.region_of(caller, "x-kvbench-region") or self.default_region
        residency = self.region_of(residency, "x-kvbench-residency")
        if residency is not None:
            allowed = [residency]
        elif self.strategy == "GLOBAL":
            allowed = list(self.regions)
        else:
            allowed = [caller]
        if self.strategy == "ROUND_ROBIN":
            reg = allowed[0] if caller not in allowed else caller
            engines = self.regions[reg]
            i = self._rr[reg]
            self._rr[reg] = i + 1
            return engines[i % len(engines)], reg != caller
        best = None
        for reg in allowed:
            cross = reg != caller
            for eng in self.regions[reg]:
                key = (self.estimate_ms(eng, seq, cross), eng.num_running + eng.num_waiting
                       + self._transit.get(eng.name, (0, 0))[0])
                if best is None or key < best[0]:
                    best = (key, eng, cross)
        return best[1], best[2]
