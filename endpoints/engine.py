# Over 400 lines, kept whole: one class whose scheduler (_schedule, _admit, _preempt, _apply)
# and step loop share the batch, the cache and the counters on every step.
"""The engine model: one asyncio task per simulated GPU steps a continuous batch in real time.

Each step takes a token budget: one token for every decoding sequence, then chunks of the
prompts being prefilled (chunked prefill), then new admissions. Its duration is the roofline
of ``costmodel.step_ms`` (prefill compute-bound, decode bandwidth-bound) times ``slowdown``,
plus any KV loaded from lower tiers; the task sleeps until the step's deadline, then emits one
token per decoding sequence. Roles: ``colocated`` (prefill and decode share the GPU, so
prefill chunks stretch decode steps), ``prefill`` (hands each prefilled sequence to a
callback) and ``decode`` (receives prefilled sequences).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

from kvbench.endpoints.config import Resolved, ceil_div
from kvbench.endpoints.histogram import (
    E2E_BUCKETS, ITL_BUCKETS, LATENESS_BUCKETS, TTFT_BUCKETS, Histogram)
from kvbench.endpoints.kvcache import HBMCache, Tier
from kvbench.endpoints.seq import Seq

# How far behind its timeline (wall seconds) an engine may fall and still catch up by running
# steps back to back; beyond it the timeline restarts from now (an overloaded host).
CATCH_UP_S = 0.25


class Engine:
    """One simulated GPU (a replica, or one GPU of a prefill or decode pool)."""

    def __init__(self, res: Resolved, name: str, role: str, region: str, gpu: int,
                 on_prefilled: Callable[[Engine, Seq], None] | None = None,
                 offload: bool = False):
        self.res = res
        self.cfg = res.cfg
        self.name = name
        self.role = role
        self.region = region
        self.gpu = gpu
        self.on_prefilled = on_prefilled
        self.cache = HBMCache(res.capacity_blocks)
        self.dram: Tier | None = None
        self.disk: Tier | None = None
        self.offload_mode = res.cfg.offload if offload else "NATIVE_ONLY"
        if self.offload_mode != "NATIVE_ONLY":
            self.dram = Tier("dram", int(res.cfg.dram_bytes // res.block_bytes))
            if self.offload_mode == "LMCACHE":
                self.disk = Tier("disk", int(res.cfg.disk_bytes // res.block_bytes))
                self.dram.below = self.disk
        self.step_overhead = res.offload_step_overhead if offload else 0.0
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._prev_deadline: float | None = None
        # counters (/metrics)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.external_queries = 0
        self.external_hits = 0
        self.preemptions = 0
        self.finished_ok = 0
        self.finished_abort = 0
        self.steps = 0
        self.bytes_moved: dict[tuple[str, str], float] = {}
        self.transfer_seconds: dict[str, float] = {}
        self.busy_s = 0.0
        self.sm_s = 0.0
        self.dram_s = 0.0
        self.samples: deque[tuple[float, float, float, float]] = deque()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue_time = Histogram(E2E_BUCKETS)
        self.lateness = Histogram(LATENESS_BUCKETS)
        self.lateness_max_s = 0.0
        self.model_step_s = 0.0  # sum of the modelled step durations (wall seconds)
        # the last finished requests' modelled times (rid, first-token s, decode s, tokens):
        # the server's log a check of the model reads on a busy host
        self.done_log: deque[tuple[str, float, float, int]] = deque(maxlen=4096)
        self.actual_step_s = 0.0  # sum of the measured ones

    # -- public -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def add(self, seq: Seq) -> None:
        seq.replica = self.name if not seq.replica else f"{seq.replica}>{self.name}"
        seq.region = self.region
        self.waiting.append(seq)
        self._wake.set()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute here (a load estimate for routers)."""
        n = 0
        for s in self.waiting:
            n += s.target - s.computed
        for s in self.running:
            if s.computed < s.target:
                n += s.target - s.computed
        return n

    def load_ms(self) -> float:
        """Estimated delay before a new request's prefill starts: queued prefill work."""
        return self.pending_prefill_tokens() / self.res.prefill_tok_per_ms

    def kv_usage(self) -> float:
        return self.cache.active_blocks / self.cache.capacity_blocks

    def move(self, tier: str, direction: str, nbytes: float, seconds: float = 0.0) -> None:
        key = (tier, direction)
        self.bytes_moved[key] = self.bytes_moved.get(key, 0.0) + nbytes
        if seconds:
            self.transfer_seconds[tier] = self.transfer_seconds.get(tier, 0.0) + seconds

    def utilization(self, now: float, window_s: float = 1.0) -> tuple[float, float, float]:
        """(busy, sm_active, dram_active) fractions over about the last ``window_s``."""
        old = None
        for s in self.samples:
            if s[0] >= now - window_s:
                old = s
                break
        if old is None or now - old[0] <= 1e-6:
            if self._task is None or (not self.running and not self.waiting):
                return 0.0, 0.0, 0.0
            old = self.samples[-1] if self.samples else None
            if old is None or now - old[0] <= 1e-6:
                return 0.0, 0.0, 0.0
        span = now - old[0]
        return (min(1.0, (self.busy_s - old[1]) / span), min(1.0, (self.sm_s - old[2]) / span),
                min(1.0, (self.dram_s - old[3]) / span))

    # -- the step loop ------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        scale = self.cfg.time_scale * self.cfg.slowdown / 1e3  # model ms -> wall s
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                self._prev_deadline = None
                await self._wake.wait()
            plan = self._schedule()
            if plan is None:
                # Nothing could run (e.g. the queue head waits for memory nobody frees).
                self._wake.clear()
                self._prev_deadline = None
                await self._wake.wait()
                continue
            decodes, prefills, compute_tokens, kv_tokens, load_ms = plan
            ms, compute_ms, mem_ms = self.res.step_ms(compute_tokens, kv_tokens)
            if self.cfg.step_us_per_seq:
                ms += (len(decodes) + len(prefills)) * self.cfg.step_us_per_seq / 1e3
            if self.cfg.prefill_ms_per_token2:
                ms += self.cfg.prefill_ms_per_token2 * sum(
                    (s.computed + c) ** 2 - s.computed ** 2 for s, c in prefills)
            ms = ms * (1.0 + self.step_overhead) + load_ms
            wall = ms * scale
            now = loop.time()
            prev = self._prev_deadline
            # Keep the model's timeline: a step starts where the last one ended (unless the
            # engine fell idle or is hopelessly behind), so wake-up delays do not accumulate.
            start = prev if prev is not None and now - prev < CATCH_UP_S else now
            deadline = start + wall
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            end = loop.time()
            late = end - deadline
            self.lateness.observe(late if late > 0 else 0.0)
            if late > self.lateness_max_s:
                self.lateness_max_s = late
            self.model_step_s += wall
            self.actual_step_s += end - start
            self._prev_deadline = deadline
            for s in decodes:
                if s.t_first is None:
                    s.model_first_s += wall
                else:
                    s.model_decode_s += wall
            for s, _ in prefills:
                if s.t_first is None:
                    s.model_first_s += wall
            self.steps += 1
            self.busy_s += wall
            if ms > 0:
                self.sm_s += wall * compute_ms / ms
                self.dram_s += wall * mem_ms / ms
            if not self.samples or end - self.samples[-1][0] >= 0.05:
                self.samples.append((end, self.busy_s, self.sm_s, self.dram_s))
                while self.samples and self.samples[0][0] < end - 5.0:
                    self.samples.popleft()
            self._apply(decodes, prefills, end, wall)

    def _free(self, seq: Seq) -> None:
        self.cache.release(seq.held, seq.anon)
        seq.held = []
        seq.anon = 0

    def _preempt(self, victim: Seq) -> None:
        """vLLM's recompute preemption: drop the KV, re-prefill prompt and output later."""
        self._free(victim)
        self.running.remove(victim)
        victim.computed = 0
        victim.target = victim.n_prompt + max(0, victim.generated - 1)
        victim.prefilled = False
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def _admit(self, seq: Seq) -> bool:
        """Find cached blocks, load lower-tier hits, allocate the rest. False: no room now."""
        cfg = self.cfg
        bt = cfg.block_tokens
        cache = self.cache
        if seq.prefilled:  # KV arrived from the prefill pool
            k = cache.match(seq.hashes)
            cache.acquire(seq.hashes[:k])
            need = ceil_div(seq.target + 1, bt) - k  # room for the first decode token too
            if not cache.allocate(need):
                cache.release(seq.hashes[:k], 0)
                return False
            new = seq.hashes[k:]
            cache.register(new)
            seq.held = list(seq.hashes)
            seq.anon = need - len(new)
            seq.computed = seq.target
            return True
        hashes = seq.hashes
        max_hit = min(len(hashes), (seq.target - 1) // bt)
        k = cache.match(hashes[:max_hit]) if max_hit > 0 else 0
        j = k
        dram_blocks = disk_blocks = 0
        if self.dram is not None:
            dram, disk = self.dram, self.disk
            while j < max_hit:
                h = hashes[j]
                if h in dram:
                    dram.touch(h)
                    dram_blocks += 1
                elif disk is not None and h in disk:
                    disk_blocks += 1
                else:
                    break
                j += 1
        cache.acquire(hashes[:k])
        need = ceil_div(seq.target, bt) - k
        if not cache.allocate(need):
            cache.release(hashes[:k], 0)
            return False
        loaded = hashes[k:j]
        cache.register(loaded)
        seq.held = list(hashes[:j])
        seq.anon = need - len(loaded)
        seq.computed = j * bt
        load_ms = 0.0
        bb = self.res.block_bytes
        if dram_blocks:
            t = self.res.tier_load_ms(dram_blocks * bt, "dram")
            load_ms += t
            self.move("dram", "load", dram_blocks * bb, t / 1e3)
        if disk_blocks:
            t = self.res.tier_load_ms(disk_blocks * bt, "disk")
            load_ms += t
            self.move("disk", "load", disk_blocks * bb, t / 1e3)
        if disk_blocks and self.dram is not None:
            for h in loaded:
                self.dram.put(h)
        seq.load_ms = load_ms
        self.prefix_queries += seq.target
        self.prefix_hits += k * bt
        if self.dram is not None:
            self.external_queries += seq.target - k * bt
            self.external_hits += (j - k) * bt
        if seq.first_admit:
            seq.first_admit = False
            seq.cached_tokens = j * bt
            self.prompt_tokens += seq.n_prompt
        return True

    def _schedule(self):
        cfg = self.cfg
        bt = cfg.block_tokens
        budget = cfg.step_token_budget
        cache = self.cache
        decodes: list[Seq] = []
        prefills: list[tuple[Seq, int]] = []
        kv_tokens = 0
        # Drop cancelled requests first.
        if any(s.cancelled for s in self.running):
            for s in [s for s in self.running if s.cancelled]:
                self._free(s)
                self.running.remove(s)
                self.finished_abort += 1
        if self.waiting and any(s.cancelled for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        # 1. one token for each decoding sequence (growing its blocks, preempting if full).
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            s = running[i]
            if s.computed < s.target:
                i += 1
                continue
            need = ceil_div(s.computed + 1, bt) - len(s.held) - s.anon
            if need > 0:
                gone = False
                while not cache.allocate(need):
                    victim = running[-1]
                    self._preempt(victim)
                    if victim is s:
                        gone = True
                        break
                if gone:
                    break
                s.anon += need
            decodes.append(s)
            kv_tokens += s.computed + 1
            budget -= 1
            i += 1
        # 2. continue chunked prefills already running.
        for s in running:
            if budget <= 0:
                break
            if s.computed < s.target:
                chunk = min(s.target - s.computed, budget)
                prefills.append((s, chunk))
                kv_tokens += s.computed + chunk
                budget -= chunk
        # 3. admit new sequences (FCFS) while the budget and memory allow.
        load_ms = 0.0
        loop_time = asyncio.get_running_loop().time
        while self.waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            s = self.waiting[0]
            if ceil_div(s.target + 1, bt) > cache.capacity_blocks:
                self.waiting.popleft()
                s.fail(400, "BadRequestError",
                       f"the prompt needs {s.target} tokens of KV cache but one GPU of this "
                       f"endpoint holds {cache.capacity_blocks * bt}; send a shorter prompt")
                continue
            if not self._admit(s):
                break
            self.waiting.popleft()
            running.append(s)
            if s.t_scheduled is None:
                s.t_scheduled = loop_time()
            load_ms += s.load_ms
            s.load_ms = 0.0
            if s.computed >= s.target:
                # KV handed over from a prefill pool: its first decode step is this one.
                decodes.append(s)
                kv_tokens += s.computed + 1
                budget -= 1
                continue
            chunk = min(s.target - s.computed, budget)
            prefills.append((s, chunk))
            kv_tokens += s.computed + chunk
            budget -= chunk
        if not decodes and not prefills and load_ms == 0.0:
            return None
        compute_tokens = len(decodes) + sum(c for _, c in prefills)
        return decodes, prefills, compute_tokens, kv_tokens, load_ms

    def _apply(self, decodes: list[Seq], prefills: list[tuple[Seq, int]], now: float,
               wall: float) -> None:
        bt = self.cfg.block_tokens
        done: list[Seq] = []
        n_itl = 0
        for s in decodes:
            if s.cancelled:
                continue
            s.computed += 1
            if s.generated:
                n_itl += 1
            s.generated += 1
            if s.t_first is None:
                s.t_first = now
                self.ttft.observe(now - s.t_arrival)
            if s.generated >= s.max_tokens:
                done.append(s)
            elif s.sink is not None:
                s.sink(s)
            else:
                w = s.waiter
                if w is not None and not w.done():
                    w.set_result(None)
        if n_itl:
            self.itl.observe(wall, n_itl)
        self.generation_tokens += len(decodes)
        for s, chunk in prefills:
            if s.cancelled:
                continue
            s.computed += chunk
            if s.computed < s.target:
                continue
            # Prefill complete: its full prompt blocks join the prefix cache.
            nfull = min(len(s.hashes), s.computed // bt)
            if nfull > len(s.held):
                new_hashes = s.hashes[len(s.held):nfull]
                fresh = self.cache.register(new_hashes)
                s.held.extend(new_hashes)
                s.anon -= len(new_hashes)
                if self.dram is not None and fresh:
                    stored = sum(self.dram.put(h) for h in fresh)
                    if stored:
                        self.move("dram", "store", stored * self.res.block_bytes)
            if s.t_prefill_done is None:
                s.t_prefill_done = now
            if self.role == "prefill":
                self.running.remove(s)
                self._free(s)
                s.prefilled = True
                if self.on_prefilled is not None:
                    self.on_prefilled(self, s)
                continue
            # The prefill step samples the next token.
            s.generated += 1
            self.generation_tokens += 1
            if s.t_first is None:
                s.t_first = now
                self.ttft.observe(now - s.t_arrival)
            if s.generated >= s.max_tokens:
                done.append(s)
            else:
                s.notify()
        for s in done:
            self.running.remove(s)
            self._free(s)
            s.finished = True
            s.t_done = now
            self.finished_ok += 1
            self.done_log.append((s.rid, s.model_first_s, s.model_decode_s, s.generated))
            self.e2e.observe(now - s.t_arrival)
            if s.t_scheduled is not None:
                self.queue_time.observe(s.t_scheduled - s.t_arrival)
            s.notify()
