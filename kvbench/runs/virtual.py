"""The built-in endpoints' engines in virtual time: a workload's requests at Poisson times, a
fixed rate per run, the per-class SLO judgement, and the steady-state capacity bisected from
such runs. No HTTP, no Locust, no host: a minute of traffic takes seconds, with no host noise.

What runs is ``kvbench.endpoints.Cluster`` (the scheduler, prefix cache, offload tiers and KV
link the built-in server runs) on an asyncio loop whose clock jumps from event to event. A
workload is its requests as ``(class, prompt tokens, block hashes, max tokens)``, tokenised and
hashed into KV blocks as the built-in server does, and (``cache = "warm"``) its distinct
shared prefixes, sent once before each run.

``kvbench predict`` and ``bench/bakeoff_sim.py`` share this module: the capacity of one
(topology, options, seed) is ``bisect`` (from a start rate, x``step`` up or down to a passing
and a failing rate, then halved geometrically until hi/lo - 1 <= ``precision``; the capacity
is the highest rate that passed), ``summary`` the median over seeds.
"""

from __future__ import annotations

import asyncio
import itertools
import selectors
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvbench.core.errors import UserError
from kvbench.endpoints.cluster import Cluster
from kvbench.endpoints.config import validate_options
from kvbench.endpoints.kvcache import block_hashes
from kvbench.endpoints.seq import Seq, wait

HASH_BLOCK = 16  # tokens per KV block the workload's prompts are hashed in


class _JumpSelector(selectors.BaseSelector):
    """A selector with no file to watch: waiting ``timeout`` moves the clock by it."""

    def __init__(self) -> None:
        self.clock = 0.0
        self._map: dict = {}

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._map.pop(fileobj)

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("the simulation waits for nothing (deadlock)")
        self.clock += max(0.0, timeout)
        return []

    def get_map(self):
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer instead of waiting for it."""

    def __init__(self) -> None:
        self._jump = _JumpSelector()
        super().__init__(self._jump)

    def time(self) -> float:
        return self._jump.clock


@dataclass
class Workload:
    """A workload as the engines see it: ``reqs`` (class, prompt tokens, block hashes, max
    tokens) in order, the config's SLOs by class, and the shared prefixes to prime (prompt
    tokens, block hashes; None: a cold start)."""

    reqs: list[tuple]
    slo: dict
    prime: list | None = None


def load_workload(cfg, workload: str, warm: bool) -> Workload:
    """``workload`` of a validated config (``kvbench.config.BenchConfig``) built with the
    built-in tokenizer, as ``kvbench run`` would send it to a built-in endpoint."""
    from pathlib import Path

    from kvbench.runs.cache import shared_prefixes
    from kvbench.runs.job import resolve
    from kvbench.workloads.tokenizer import get_tokenizer

    job = resolve(cfg, workload=workload, endpoint=cfg.endpoints[0].name,
                  url="http://127.0.0.1:9", run_id="sim", results_dir=Path("/tmp"))
    tok = get_tokenizer("builtin")
    built = job.build_workload(tok)
    reqs = []
    for req in built.requests():
        text = req.prompt if req.messages is None else tok.render_chat(list(req.messages))
        tokens = tok.tokens(text)
        reqs.append((req.request_class, len(tokens), block_hashes(tokens, HASH_BLOCK),
                     req.max_tokens))
    slo = {k: s.limits() for k, s in job.slo.items()}
    prime = None
    if warm:
        prime = []
        for text in shared_prefixes(built, tok):
            tokens = tok.tokens(text)
            prime.append((len(tokens), block_hashes(tokens, HASH_BLOCK)))
    return Workload(reqs, slo, prime)


def _quiet(seq: Seq) -> None:
    """A request's sink: the harness reads its times when it finishes, so a token needs no
    wake-up of its task (the built-in server streams through a sink the same way)."""


def run_rate(topology: str, options: dict, reqs: list[tuple], rate: float, seconds: float,
             seed: int, prime: list | None = None) -> list[dict]:
    """One fixed-rate run from an empty cache (``prime``: each shared prefix sent once first,
    as ``cache = "warm"`` does): a row per request that arrived."""
    loop = VirtualLoop()
    res = validate_options(topology, options).resolved()
    if res.cfg.block_tokens != HASH_BLOCK:
        raise UserError(f"options.block_tokens is {res.cfg.block_tokens}; the virtual-time "
                        f"model hashes prompts in {HASH_BLOCK}-token blocks, so remove "
                        "block_tokens from the options to predict")
    rng = np.random.default_rng(seed)
    n = int(round(rate * seconds))
    times = np.sort(rng.uniform(0, seconds, n))
    rows: list[dict] = []
    base = {"t0": 0.0}

    async def one(i: int, t: float, r: tuple) -> None:
        cls, n_prompt, hashes, max_tokens = r
        seq = Seq(f"r{i}", n_prompt, hashes, max_tokens, loop.time())
        row = {"class": cls, "t": t - base["t0"], "ttft_ms": np.nan, "tpot_ms": np.nan,
               "e2e_ms": np.nan, "ok": False, "n_prompt": n_prompt, "cached": 0}
        rows.append(row)
        seq.sink = _quiet  # the engine calls it per token instead of waking this task
        await cluster.submit(seq, None, None)
        await wait(seq, lambda: seq.finished)
        if seq.t_first is not None:
            row["ttft_ms"] = (seq.t_first - t) * 1e3
        row["e2e_ms"] = (loop.time() - t) * 1e3
        if seq.generated > 1 and seq.t_first is not None:
            row["tpot_ms"] = (row["e2e_ms"] - row["ttft_ms"]) / (seq.generated - 1)
        row["ok"] = seq.error is None
        row["cached"] = seq.cached_tokens

    async def main() -> None:
        cluster.start()
        for k, (n, hashes) in enumerate(prime or ()):
            seq = Seq(f"prime{k}", n, hashes, 1, loop.time())
            await cluster.submit(seq, None, None)
            await wait(seq, lambda: seq.finished)
        t0 = base["t0"] = loop.time()
        tasks = []
        src = itertools.cycle(reqs)
        for i, t in enumerate(times):
            d = t0 + t - loop.time()
            if d > 0:
                await asyncio.sleep(d)
            tasks.append(loop.create_task(one(i, float(t0 + t), next(src))))
        await asyncio.gather(*tasks)
        await cluster.stop()

    cluster = Cluster(res)
    loop.run_until_complete(main())
    loop.close()
    return rows


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.nanpercentile(values, q)) if np.isfinite(values).any() else float("nan")


def table(rows: list[dict], slo: dict, warmup_s: float) -> dict:
    """Per class, of the requests that arrived after ``warmup_s``: their number, attainment,
    p50/p99 TTFT and TPOT (ms), the SLO missed most and the prefix hit ratio (cached over
    prompt tokens of the requests that finished; NaN where rows do not carry them)."""
    out = {}
    for cls in sorted({r["class"] for r in rows}):
        rs = [r for r in rows if r["class"] == cls and r["t"] >= warmup_s]
        if not rs:
            continue
        lim = slo.get(cls, {})
        miss = {"ttft_ms": 0, "tpot_ms": 0, "e2e_ms": 0, "error": 0}
        met = 0
        for r in rs:
            fine = r["ok"]
            if not r["ok"]:
                miss["error"] += 1
            for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
                if k in lim and not (r[k] <= lim[k] or (k == "tpot_ms" and np.isnan(r[k]))):
                    miss[k] += 1
                    fine = False
            met += fine
        ttft = np.array([r["ttft_ms"] for r in rs])
        tpot = np.array([r["tpot_ms"] for r in rs])
        done = [r for r in rs if r["ok"] and "cached" in r]
        prompt = sum(r["n_prompt"] for r in done)
        out[cls] = {"n": len(rs), "att": met / len(rs),
                    "hit_ratio": sum(r["cached"] for r in done) / prompt if prompt else np.nan,
                    "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
                    "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
                    "miss": max(miss, key=miss.get) if met < len(rs) else ""}
    return out


def capacity(points: list[tuple[float, dict]], target: float) -> tuple[float | None, str]:
    """The highest rate before the first one where some class misses ``target``, linearly
    interpolated to the crossing; and the class and SLO that cross first."""
    prev = None
    for rate, t in points:
        worst = min(t.items(), key=lambda kv: kv[1]["att"])
        if worst[1]["att"] < target:
            if prev is None:
                return None, f"{worst[0]} ({worst[1]['miss']})"
            r0, a0 = prev
            a1 = worst[1]["att"]
            x = r0 + (a0 - target) / (a0 - a1) * (rate - r0) if a0 > a1 else r0
            return x, f"{worst[0]} ({worst[1]['miss']})"
        prev = (rate, worst[1]["att"])
    return None, "none within the rates"


def verdict(t: dict, slo: dict, target: float) -> tuple[bool, str, float, str]:
    """Whether every class with an SLO (every class when none has one) kept ``target`` of
    its judged requests; the worst such class, its attainment and the SLO it missed most."""
    judged = {c: x for c, x in t.items() if c in slo} or t
    if not judged:
        return False, "", 0.0, "no request judged"
    cls, x = min(judged.items(), key=lambda kv: kv[1]["att"])
    return x["att"] >= target, cls, x["att"], x["miss"]


@dataclass
class Steady:
    """How a steady-state capacity is judged and searched: each rate a fresh run of
    ``warmup_s + seconds`` (``seconds`` judged) on ``work``; a rate passes when every class
    with an SLO keeps ``target``; the bisection stops at hi/lo - 1 <= ``precision``, its
    bracket found by x``step`` steps; ``grid_s``: each rate's run of the start estimate."""

    work: Workload
    warmup_s: float = 20.0
    seconds: float = 300.0
    target: float = 0.95
    precision: float = 0.02
    step: float = 1.25
    grid_s: float = 120.0
    probes: dict = field(default_factory=dict)  # (topology, options, seed, rate) -> probe


def _nan_none(x: float) -> float | None:
    return None if np.isnan(x) else x


def probe(s: Steady, topology: str, options: dict, rate: float, seed: int) -> dict:
    """One fixed-rate run of ``warmup_s + seconds`` judged after the warm-up (remembered:
    the same rate and seed is the same run)."""
    key = (topology, repr(sorted(options.items())), seed, rate)
    if key in s.probes:
        return s.probes[key]
    w = s.work
    t = table(run_rate(topology, options, w.reqs, rate, s.warmup_s + s.seconds, seed,
                       w.prime), w.slo, s.warmup_s)
    ok, cls, att, miss = verdict(t, w.slo, s.target)
    out = {"rate": rate, "pass": ok, "worst_class": cls, "worst_att": att, "miss": miss,
           "classes": {c: {"n": x["n"], "att": x["att"], "ttft_p99_ms": x["ttft_p99"],
                           "tpot_p99_ms": _nan_none(x["tpot_p99"]),
                           "ttft_p50_ms": x["ttft_p50"], "tpot_p50_ms": _nan_none(x["tpot_p50"]),
                           "hit_ratio": _nan_none(x.get("hit_ratio", np.nan)),
                           "miss": x["miss"]} for c, x in t.items()}}
    s.probes[key] = out
    return out


def quick_estimate(s: Steady, topology: str, options: dict, rates: list[float],
                   seed: int) -> tuple[float, str]:
    """A bisection's start rate from a coarse grid (``rates``, ``grid_s`` each, one seed):
    (rate, how it was found)."""
    w = s.work
    points = []
    for rate in rates:
        t = table(run_rate(topology, options, w.reqs, rate, s.grid_s, seed, w.prime),
                  w.slo, s.warmup_s)
        points.append((rate, t))
        if not verdict(t, w.slo, s.target)[0]:
            break
    cap, _ = capacity(points, s.target)
    if cap is not None:
        return cap, f"grid {','.join(f'{r:g}' for r, _ in points)} at {s.grid_s:g} s"
    if verdict(points[0][1], w.slo, s.target)[0]:
        return rates[-1], "grid passed every rate: its highest"
    return rates[0] / 2, "grid failed its lowest rate: half of it"


def bisect(s: Steady, topology: str, options: dict, seed: int, guess: float) -> dict:
    """One seed's capacity on one topology: from ``guess``, step x``step`` up (or down) to a
    bracket of a passing and a failing rate, then halve it (geometrically) until hi/lo - 1
    <= ``precision``. Every rate is a fresh ``warmup_s + seconds`` run with this seed."""
    cpu0 = time.process_time()
    tried: list[dict] = []

    def run(rate: float) -> dict:
        p = probe(s, topology, options, float(rate), seed)
        tried.append(p)
        return p

    lo = hi = None
    p = run(guess)
    for _ in range(40):  # x1.25 forty times: a factor of 7,500 either way
        if p["pass"]:
            lo = p
            if hi is not None:
                break
            p = run(lo["rate"] * s.step)
        else:
            hi = p
            if lo is not None:
                break
            p = run(hi["rate"] / s.step)
    out = {"seed": seed, "guess": guess, "capacity": None, "crossing": None, "bracket": None,
           "breaks": None, "tried": tried}
    if lo is None or hi is None:
        out["why"] = "no bracket within 40 steps"
        out["cpu_s"] = time.process_time() - cpu0
        return out
    while hi["rate"] / lo["rate"] - 1 > s.precision:
        p = run(float(np.sqrt(lo["rate"] * hi["rate"])))
        if p["pass"]:
            lo = p
        else:
            hi = p
    a0, a1, tg = lo["worst_att"], hi["worst_att"], s.target
    cross = lo["rate"] + (a0 - tg) / (a0 - a1) * (hi["rate"] - lo["rate"]) if a0 > a1 \
        else lo["rate"]
    out.update(capacity=lo["rate"], crossing=cross, bracket=[lo["rate"], hi["rate"]],
               breaks={"class": hi["worst_class"], "slo": hi["miss"],
                       "attainment": hi["worst_att"]},
               cpu_s=time.process_time() - cpu0)
    return out


def pooled_fit(seeds: list[dict], target: float, median: float | None) -> dict | None:
    """A cross-check of the median from every run at once: a least-squares line through all
    seeds' (rate, worst class's attainment) within 0.75-1.33x the median, and the rate where
    it crosses ``target`` (None unless the line falls)."""
    pts = [(p["rate"], p["worst_att"]) for s in seeds for p in s["tried"]
           if median and 0.75 * median <= p["rate"] <= median / 0.75]
    if len(pts) < 3:
        return None
    x, y = np.array(pts).T
    m, b = np.polyfit(x, y, 1)
    return {"rate": float((target - b) / m) if m < 0 else None, "slope_per_rps": float(m),
            "points": len(pts), "resid_sd": float(np.std(y - (m * x + b), ddof=2))}


def summary(topology: str, gpus: int, seeds: list[dict], target: float) -> dict:
    """The seeds' capacities of one topology: median (per GPU too), spread, crossings, the
    class and SLO that break first in most seeds, and the pooled cross-check."""
    caps = [s["capacity"] for s in seeds if s["capacity"] is not None]
    cross = [s["crossing"] for s in seeds if s["crossing"] is not None]
    breaks = Counter((s["breaks"]["class"], s["breaks"]["slo"]) for s in seeds if s["breaks"])
    (bc, bs), bn = breaks.most_common(1)[0] if breaks else (("", ""), 0)
    med = float(np.median(caps)) if caps else None
    return {
        "gpus": gpus, "seeds": seeds, "capacities": caps,
        "median": med, "median_per_gpu": med / gpus if med is not None else None,
        "per_gpu": [c / gpus for c in caps],
        "min": min(caps) if caps else None, "max": max(caps) if caps else None,
        "crossings": cross,
        "median_crossing": float(np.median(cross)) if cross else None,
        "pooled_fit": pooled_fit(seeds, target, med),
        "breaks_first": {"class": bc, "slo": bs, "seeds": bn, "of": len(seeds)},
        "runs": sum(len(s["tried"]) for s in seeds),
        "cpu_s": sum(s.get("cpu_s", 0.0) for s in seeds),
    }
