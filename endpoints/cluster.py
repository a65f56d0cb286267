"""The engines of one endpoint wired as a topology, and the path of a request through them."""

from __future__ import annotations

import asyncio

from kvbench.endpoints.config import Resolved
from kvbench.endpoints.engine import Engine
from kvbench.endpoints.router import Router
from kvbench.endpoints.seq import Seq
from kvbench.model import topologies
from kvbench.model.topologies.base import PREFILL


class Cluster:
    """The engines of the endpoint's topology, as its layout lists them: entry pools behind the
    router, and pools that take prefilled requests over the P/D link."""

    def __init__(self, res: Resolved):
        self.res = res
        cfg = res.cfg
        self.topology = topologies.get(cfg.topology)
        self.engines: list[Engine] = []
        self.decode_pool: list[Engine] = []
        self._link_free: dict[str, float] = {}
        regions: dict[str, list[Engine]] = {}
        layout = self.topology.layout(cfg)
        for pool in layout.pools:
            region = res.region_names[pool.region]
            prefix = pool.prefix.format(region=region)
            engines = [self._engine(f"{prefix}{i}", pool.role, region) for i in range(pool.count)]
            if pool.entry:
                regions.setdefault(region, []).extend(engines)
            else:
                self.decode_pool.extend(engines)
        self.router = Router(layout.router, regions, cfg.cross_region_rtt_ms,
                             res.prefill_tok_per_ms, cfg.block_tokens)

    def _engine(self, name: str, role: str, region: str) -> Engine:
        eng = Engine(self.res, name, role, region, gpu=len(self.engines),
                     on_prefilled=self._handoff if role == PREFILL else None,
                     offload=self.topology.offloads_kv)
        self.engines.append(eng)
        return eng

    def start(self) -> None:
        for e in self.engines:
            e.start()

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()

    async def submit(self, seq: Seq, caller: str | None, residency: str | None,
                     session: str | None = None) -> None:
        """Front end (tokenising, hashing), routing, the network, then an engine's queue.
        Raises router.RoutingError for an unknown region."""
        eng, cross = self.router.pick(seq, caller, residency, session)
        try:
            await self._to_engine(eng, cross, seq)
        finally:
            self.router.arrived(seq)

    async def _to_engine(self, eng: Engine, cross: bool, seq: Seq) -> None:
        """The front end's delay and the network after routing, then ``eng``'s queue."""
        cfg = self.res.cfg
        scale = cfg.time_scale / 1e3
        delay_ms = seq.n_prompt * cfg.frontend_us_per_prompt_token / 1e3 \
            + self.res.offload_request_overhead_ms * self.topology.offloads_kv
        if cross:
            seq.network_ms = cfg.cross_region_rtt_ms
            delay_ms += cfg.cross_region_rtt_ms
        seq.model_first_s += delay_ms * scale
        # The real time already spent reading and tokenising counts toward the front end.
        delay = delay_ms * scale - (asyncio.get_running_loop().time() - seq.t_arrival)
        if delay > 0:
            await asyncio.sleep(delay)
        if seq.cancelled:
            return
        eng.add(seq)

    def reset_prefix_cache(self) -> int | None:
        """Empty every engine's prefix cache (HBM and lower tiers) when no request is in the
        cluster; None (nothing dropped) while any is queued or running. Returns blocks dropped."""
        if any(e.num_running or e.num_waiting for e in self.engines) or any(
                e.cache.anon or len(e.cache.lru) != len(e.cache.ref) for e in self.engines):
            return None
        n = 0
        for e in self.engines:
            n += e.cache.reset() or 0
            for tier in (e.dram, e.disk):
                n += tier.clear() if tier is not None else 0
        return n

    def _handoff(self, src: Engine, seq: Seq) -> None:
        """Prefill done on ``src``: move the prompt's KV over the link, then queue on a decode
        GPU."""
        loop = asyncio.get_running_loop()
        cfg = self.res.cfg
        scale = cfg.time_scale / 1e3
        dst = min(self.decode_pool, key=lambda e: (e.num_running + e.num_waiting,
                                                    e.kv_usage()))
        total_ms = self.res.kv_transfer_ms(seq.n_prompt)
        wire_ms = seq.n_prompt * self.res.kv_bytes_per_token / (self.res.link_gb_s * 1e9) * 1e3
        now = loop.time()
        start = max(now, self._link_free.get(src.name, now))
        self._link_free[src.name] = start + wire_ms * scale
        done = start + total_ms * scale
        seq.kv_transfer_ms = total_ms
        seq.model_first_s += total_ms * scale
        tier = "rdma" if cfg.link == "rdma" else "tcp"
        src.move(tier, "send", seq.n_prompt * self.res.kv_bytes_per_token, total_ms * scale)
        dst.move(tier, "receive", seq.n_prompt * self.res.kv_bytes_per_token, 0.0)

        def arrive() -> None:
            # The modelled arrival: a late callback is host jitter, not transfer time (it shows
            # in the first decode instead).
            seq.t_transfer_done = done
            if seq.cancelled:
                return
            dst.add(seq)

        loop.call_at(done, arrive)
