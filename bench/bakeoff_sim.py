"""The default bake-off's traffic on each built-in endpoint, in virtual time: per class, the SLO
attainment and the latency that decides it, against the offered rate.

What runs: the built-in endpoints' own engines (``kvbench.endpoints.Cluster``: the scheduler,
prefix cache, offload tiers and KV link the server runs), on an asyncio loop whose clock jumps
from event to event, fed the config's workload (``bench.toml``'s ``mix`` by default: the same
prompts, tokenised and hashed into KV blocks as the emulator's server does) at Poisson times,
a fixed rate per run, each run from an empty cache. What does not run: HTTP, Locust and the
host, so a minute of traffic takes seconds and the figures carry no host noise.

It answers "which class and which SLO decide each endpoint's capacity, and where does each
design win": the capacity search (``pacing = "search"``) measures the same thing on the real
path, with probes a few seconds long. Two modes:

The grid (default): one seed, each of ``--rates`` for ``--seconds`` (120, the warm-up
included), a table per class, the capacity interpolated where the first class crosses the
target; ``--search N`` runs the production search over the same engines beside it.

    python bench/bakeoff_sim.py [--config bench.toml] [--workload mix|longdoc] [--warm]
        [--rates 2,4,6,8,12,16,24] [--seconds 120] [--warmup-s 20] [--search N]
        [--topologies colocated,disaggregated,offloaded] [--slo CLASS:ttft_ms=..,tpot_ms=..]

``--precise``: the steady state a default run is judged against (issue 31). Per topology and
seed (``--seeds`` 5: seed..seed+4), the capacity at ``--target`` (every class with an SLO keeps
at least 95% of its requests judged after ``--warmup-s``) bisected: from a start rate
(``--guess``, else the grid's estimate at 120 s) step x``--step`` (1.25) up or down to a
passing and a failing rate, then halve the bracket geometrically until hi/lo - 1 <=
``--precision`` (0.02). Every rate is a fresh run of ``--warmup-s`` + ``--seconds`` (300
judged). The capacity is the highest rate that passed; the JSON also holds the linear
crossing of the worst class's attainment inside the last bracket. Printed per topology: the
median of the seeds, per GPU, min-max and each seed, and the class and SLO that break first;
``--json PATH`` writes it all (with every rate tried and its attainment per class). Each
(topology, seed) is one task of a ``--jobs`` process pool (2). The four references of
issue 31 (each about 10-20 CPU minutes; run under ``nice -n 19`` on a shared machine):

    python bench/bakeoff_sim.py --warm --precise --workload mix --json /work/truth/mix.json
    python bench/bakeoff_sim.py --warm --precise --workload longdoc \
        --json /work/truth/longdoc.json
    python bench/bakeoff_sim.py --warm --precise --workload mix --options '{"slowdown": 1.5}' \
        --json /work/truth/mix_slow15.json
    python bench/bakeoff_sim.py --warm --precise --workload longdoc \
        --options '{"slowdown": 1.5}' --json /work/truth/longdoc_slow15.json

Each topology runs with the options of the config's first built-in endpoint of it (the
default's colocated is one replica), ``--options`` over them; ``--warm`` primes every shared
prefix before each run, as ``cache = "warm"`` does. The harness (the fixed-rate run, the
per-class judgement, the bisection, the seeds' summary) is the product's
``kvbench.runs.virtual``, which ``kvbench predict`` runs too; this file builds the workload,
drives the modes and prints.

An agentic-coding trace workload (``kind = "trace"``, ``format = "agentic"``) is replayed as
sessions, not at a rate: ``--users`` concurrent users (2,4,8,16) each replay one conversation
at a time (a seeded order, recycled), sub-agents concurrently with their parent waiting,
``--replay think`` (after the previous answer plus the recorded think time) or ``timestamps``
(the recorded offsets, never before the previous answer), times multiplied by
``--time-scale`` (0.1), as a profile's ``time_scale`` does. Per count: the attainment (TTFT
judged on streaming requests only: a non-streaming
one has none), p99 TTFT and TPOT and the engines' prefix hit ratio; then the most sessions at
``--target``. Over 400 lines: the session replay shares the workload build and the judgement.

    python bench/bakeoff_sim.py --config my.toml --workload agentic --users 4,8,16,32
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import multiprocessing as mp
import resource
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from search_sim import SimBackend  # noqa: E402

from kvbench.config import load_config  # noqa: E402
from kvbench.endpoints.cluster import Cluster  # noqa: E402
from kvbench.endpoints.config import gpu_count, validate_options  # noqa: E402
from kvbench.endpoints.kvcache import block_hashes  # noqa: E402
from kvbench.endpoints.seq import Seq, wait  # noqa: E402
from kvbench.runs import search, virtual  # noqa: E402
from kvbench.runs.job import resolve  # noqa: E402
from kvbench.workloads.tokenizer import get_tokenizer  # noqa: E402

# The harness itself (the fixed-rate run, the per-class judgement, the bisection and the seeds'
# summary) is the product's (``kvbench predict`` runs it too); its names stay importable here.
from kvbench.runs.virtual import (  # noqa: E402,F401
    load_workload,
    capacity,
    pooled_fit,
    run_rate,
    summary,
    table,
    verdict,
)


def _job(config: Path, workload: str):
    cfg = load_config(config)
    return resolve(cfg, workload=workload, endpoint=cfg.endpoints[0].name,
                   url="http://127.0.0.1:9", run_id="sim", results_dir=Path("/tmp"))


def prompts(config: Path, workload: str) -> tuple[list[tuple], dict]:
    """The workload's requests as (class, prompt tokens, block hashes, max tokens), and the
    config's SLOs by class."""
    reqs, slo, _ = load(config, workload, warm=False)
    return reqs, slo


def primes(config: Path, workload: str) -> list[tuple[int, list[int]]]:
    """What ``cache = "warm"`` sends before a job: each distinct shared prefix once, as
    (prompt tokens, block hashes)."""
    return load(config, workload, warm=True)[2] or []


def load(config: Path, workload: str, warm: bool) -> tuple[list[tuple], dict, list | None]:
    """``prompts`` and (``warm``) ``primes`` from one build of the workload: its requests,
    the SLOs by class, and the shared prefixes (None when not ``warm``)."""
    cfg = load_config(config)
    if getattr(cfg.workloads.get(workload), "format", None) == "agentic":
        job = _job(config, workload)  # sessions, replayed by run_sessions
        built = job.build_workload(get_tokenizer("builtin"))
        return sim_sessions(built), {k: s.limits() for k, s in job.slo.items()}, \
            ([] if warm else None)
    w = load_workload(cfg, workload, warm)  # the product's loader
    return w.reqs, w.slo, w.prime


def sim_sessions(built, block: int = 16) -> list[tuple]:
    """An agentic trace's conversations for the sim, without prompt text: a session is a
    tuple of ("req", class, prompt tokens, block hashes, max tokens, think s, offset s,
    stream, session id) and ("spawn", think s, [sessions]) in the reader's seeded session
    order, with its
    think times and Spawn groups (what ``Session.next_request`` yields). Each 64-token block of the trace
    is ``64 / block`` engine blocks hashed from the reader's block key (equal ids, equal
    hashes, chained), the tail after the last full block one fresh hash per engine block."""
    from kvbench.workloads.traces.agentic import SpawnGroup

    def one(conv, sess, sid):
        items = []
        for k, x in enumerate(sess.items):
            if isinstance(x, SpawnGroup):
                items.append(("spawn", x.think_s, [one(conv, s, f"{sid}-s{s.index}")
                                                   for s in x.subs]))
                continue
            h, hashes = 0, []
            for key in (built.block_key(conv, i) for i in x.ids):
                for q in range(conv.block // block):
                    h = hash((h, key, q))
                    hashes.append(h)
            for q in range((x.n_in - len(x.ids) * conv.block) // block):
                h = hash((h, sid, k, q))
                hashes.append(h)
            items.append(("req", "trace", x.n_in, hashes, built._max_tokens(x.n_out),
                          x.think_s, x.offset_s, x.stream, sid))
        return items

    return [one(s.conv, s.sess, s.conv.cid) for s in built.sessions()]


def run_sessions(topology: str, options: dict, convs: list, users: int, seconds: float,
                 seed: int, replay: str = "think", time_scale: float = 1.0) -> list[dict]:
    """A closed-loop agentic replay from an empty cache: ``users`` concurrent users, each
    replaying one conversation at a time (``convs`` in order from a seeded start, recycled)
    until ``seconds``. A
    request is sent after its session's previous answer plus the think time ("think"), or
    at the conversation's start plus its recorded offset but never before the previous
    answer ("timestamps"); times multiplied by ``time_scale``. A Spawn starts its sub-agent
    sessions together and the parent waits for all of them. Non-streaming requests have no
    TTFT (NaN), as a client sees them. With ``pin_header`` in ``options`` each request names
    its session (the conversation's, or a sub-agent's, id and the replay's pass) and the
    router keeps a session on the replica its first request went to."""
    loop = virtual.VirtualLoop()
    res = validate_options(topology, options).resolved()
    if res.cfg.block_tokens != 16:
        raise SystemExit("the sim hashes 16-token blocks; the endpoint uses another size")
    start = int(np.random.default_rng(seed).integers(len(convs)))
    src = itertools.cycle(convs[start:] + convs[:start])
    rows: list[dict] = []
    t0 = 0.0
    n = itertools.count()
    passes = itertools.count()  # each replay of a conversation is a session of its own
    pin = bool(res.cfg.pin_header)  # the router pins each session (its id, as the header)

    async def session(items, start: float, npass: int) -> None:
        for it in items:
            if loop.time() - t0 >= seconds:
                return
            if it[0] == "spawn":
                await asyncio.sleep(it[1] * time_scale)
                await asyncio.gather(*(session(s, start, npass) for s in it[2]))
                continue
            _, cls, n_prompt, hashes, max_tokens, think, offset, stream, sid = it
            when = loop.time() + think * time_scale if replay == "think" else \
                max(loop.time(), start + offset * time_scale)
            if when > loop.time():
                await asyncio.sleep(when - loop.time())
            t = loop.time()
            seq = Seq(f"r{next(n)}", n_prompt, hashes, max_tokens, t)
            row = {"class": cls, "t": t - t0, "ttft_ms": np.nan, "tpot_ms": np.nan,
                   "e2e_ms": np.nan, "ok": False, "stream": stream, "n_prompt": n_prompt,
                   "cached": 0}
            rows.append(row)
            seq.sink = virtual._quiet  # times are read when it finishes
            await cluster.submit(seq, None, None, f"{sid}#{npass}" if pin else None)
            await wait(seq, lambda: seq.finished)
            row["e2e_ms"] = (loop.time() - t) * 1e3
            if seq.t_first is not None and stream:
                row["ttft_ms"] = (seq.t_first - t) * 1e3
            if seq.generated > 1 and seq.t_first is not None:
                row["tpot_ms"] = (loop.time() - seq.t_first) * 1e3 / (seq.generated - 1)
            row["ok"] = seq.error is None
            row["cached"] = seq.cached_tokens

    async def user() -> None:
        while loop.time() - t0 < seconds:
            await session(next(src), loop.time(), next(passes))

    async def main() -> None:
        nonlocal t0
        cluster.start()
        t0 = loop.time()
        await asyncio.gather(*(user() for _ in range(users)))
        await cluster.stop()

    cluster = Cluster(res)
    loop.run_until_complete(main())
    loop.close()
    return rows


def session_table(rows: list[dict], slo: dict, warmup_s: float) -> dict:
    """Per class as ``table`` judges, TTFT only where a request streamed (a non-streaming one
    has none by design), with the engines' prefix hit ratio (cached over prompt tokens)."""
    out = table([r if r["stream"] else {**r, "ttft_ms": 0.0} for r in rows], slo, warmup_s)
    for cls, x in out.items():
        rs = [r for r in rows if r["class"] == cls and r["t"] >= warmup_s]
        ttft = np.array([r["ttft_ms"] for r in rs if r["stream"]], dtype=float)
        x["ttft_p99"] = float(np.nanpercentile(ttft, 99)) if np.isfinite(ttft).any() \
            else float("nan")
        x["hit"] = sum(r["cached"] for r in rs) / max(1, sum(r["n_prompt"] for r in rs))
    return out


class MixBackend(SimBackend):
    """``search.drive``'s backend on one built-in topology, fed the workload's requests in
    order (cycled) with each class judged on its own SLOs."""

    def __init__(self, topology: str, options: dict, reqs: list[tuple], slo: dict,
                 seed: int, prime: list | None = None) -> None:
        self.topology, self.mix, self.src = topology, reqs, itertools.cycle(reqs)
        super().__init__(options, 0, 0, slo, seed)
        self.cluster = Cluster(validate_options(topology, options).resolved())
        self.loop.run_until_complete(self._start())
        if prime:
            self.loop.run_until_complete(self._prime(prime))

    async def _prime(self, prime: list) -> None:
        """``cache = "warm"``: each shared prefix once, one output token, one at a time."""
        for k, (n, hashes) in enumerate(prime):
            seq = Seq(f"prime{k}", n, hashes, 1, self.loop.time())
            await self.cluster.submit(seq, None, None)
            await wait(seq, lambda: seq.finished)

    def _shape(self, row: dict) -> tuple[int, list[int], int]:
        cls, n_prompt, hashes, max_tokens = next(self.src)
        row["class"] = cls
        return n_prompt, hashes, max_tokens


def searched(topology: str, options: dict, reqs, slo, spec: dict, seed: int,
             prime: list | None = None) -> tuple:
    """One capacity search over the sim: (bracket, probe trail)."""
    b = MixBackend(topology, options, reqs, slo, seed, prime)
    planner, control = search.drive(b, spec, say=lambda line: None)
    trail = " ".join(f"{p.rate_rps:g}{(p.verdict or 'v')[0].upper()}" for p in control.probes)
    return planner.bracket(), trail + f"  [{b.now():.0f} s]"


def search_spec(config: Path, profile: str, workload: str = "mix") -> dict:
    """The profile's capacity-search settings, as kvbench run hands them to the search."""
    cfg = load_config(config)
    job = resolve(cfg, workload=workload, endpoint=cfg.endpoints[0].name, url="http://127.0.0.1:9",
                  profile=profile, run_id="sim", results_dir=Path("/tmp"))
    return job.search.to_dict()


# What the pool's workers share, set by the parent before it forks them: the workload's
# requests, SLOs and warm prefixes (tokenised once), and the run settings.
_SHARED: dict = {}


def _steady() -> virtual.Steady:
    """``_SHARED`` as the product's settings of a steady-state search (one per process)."""
    w = _SHARED
    if "steady" not in w:
        w["steady"] = virtual.Steady(
            virtual.Workload(w["reqs"], w["slo"], w["prime"]), warmup_s=w["warmup_s"],
            seconds=w["seconds"], target=w["target"], precision=w["precision"],
            step=w["step"])
    return w["steady"]


def _probe(topology: str, options: dict, rate: float, seed: int) -> dict:
    """One fixed-rate run of ``warmup_s + seconds`` judged after the warm-up."""
    return virtual.probe(_steady(), topology, options, rate, seed)


def quick_estimate(task: tuple) -> tuple[str, float, str]:
    """The old grid's capacity (``--rates`` at 120 s, one seed) as a bisection's start rate:
    (topology, rate, how it was found)."""
    topology, options, rates, seed = task
    rate, why = virtual.quick_estimate(_steady(), topology, options, rates, seed)
    return topology, rate, why


def bisect(task: tuple) -> dict:
    """One seed's capacity on one topology (``kvbench.runs.virtual.bisect``)."""
    topology, options, seed, guess = task
    return virtual.bisect(_steady(), topology, options, seed, guess)


def guesses(text: str | None, topologies: list[str]) -> dict[str, float]:
    """``--guess``: one rate for every topology (``8``) or per topology
    (``offloaded=12,colocated=6``); topologies not named get the grid's estimate."""
    if not text:
        return {}
    if "=" not in text:
        return {t: float(text) for t in topologies}
    return {k.strip(): float(v) for k, v in (p.split("=") for p in text.split(","))}


def precise(a, topologies: list[str], opts: dict[str, dict], gpus: dict[str, int]) -> dict:
    """Per topology, each seed's capacity bisected in a pool of ``a.jobs`` processes; prints
    as seeds finish, returns what ``--json`` writes."""
    t_wall = time.monotonic()
    seeds = list(range(a.seed, a.seed + a.seeds))
    start = guesses(a.guess, topologies)
    ctx = mp.get_context("fork")  # the workers inherit _SHARED (the tokenised workload)
    with ctx.Pool(max(1, a.jobs)) as pool:
        how = {t: "--guess" for t in start}
        todo = [(t, opts[t], [float(x) for x in a.rates.split(",")], a.seed)
                for t in topologies if t not in start]
        for topo, rate, why in pool.imap_unordered(quick_estimate, todo):
            start[topo], how[topo] = rate, why
            print(f"  {topo}: start at {rate:.2f} req/s ({why})", flush=True)
        tasks = [(t, opts[t], s, start[t]) for t in topologies for s in seeds]
        done: dict[str, list[dict]] = {t: [] for t in topologies}
        for t, r in zip(tasks, pool.imap(bisect, tasks)):
            done[t[0]].append(r)
            trail = " ".join(f"{p['rate']:.3g}{'P' if p['pass'] else 'F'}" for p in r["tried"])
            cap = "n/a" if r["capacity"] is None else f"{r['capacity']:.3f} req/s"
            print(f"  {t[0]} seed {r['seed']}: {cap}  [{trail}]  {r.get('cpu_s', 0):.0f} CPU s",
                  flush=True)
    cpu = time.process_time() + _children_cpu()  # the whole command, the workload's build too
    res = {topo: {"options": opts[topo], "guess": start[topo], "guess_from": how[topo],
                  **summary(topo, gpus[topo], done[topo], a.target)} for topo in topologies}
    print(f"\ncapacity at {a.target:.0%} (every class with an SLO): the highest rate that passed,"
          f" bisected until hi/lo - 1 <= {a.precision:g}; {a.seconds:g} s judged per rate after"
          f" {a.warmup_s:g} s; seeds {seeds[0]}..{seeds[-1]}")
    for topo, r in res.items():
        if r["median"] is None:
            print(f"  {topo}: no capacity found", flush=True)
            continue
        each = ", ".join(f"{s['seed']}: {s['capacity']:.3f}" if s["capacity"] is not None
                         else f"{s['seed']}: n/a" for s in r["seeds"])
        bf = r["breaks_first"]
        print(f"  {topo} ({r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}): median "
              f"{r['median']:.3f} req/s, {r['median_per_gpu']:.3f} per GPU; spread "
              f"{r['min']:.3f}-{r['max']:.3f} ({r['min'] / r['median'] - 1:+.1%} / "
              f"{r['max'] / r['median'] - 1:+.1%}); seeds {each}; crossing median "
              f"{r['median_crossing']:.3f}; breaks first: {bf['class']} ({bf['slo']}) in "
              f"{bf['seeds']} of {bf['of']} seeds; {r['runs']} runs", flush=True)
        fit = r["pooled_fit"]
        if fit and fit["rate"] is not None:
            print(f"    cross-check: a line through all {fit['points']} runs near the median "
                  f"crosses {a.target:.0%} at {fit['rate']:.3f} req/s "
                  f"({fit['rate'] / r['median'] - 1:+.1%}; attainment {fit['slope_per_rps']:+.3f}"
                  f" per req/s, residual sd {fit['resid_sd']:.3f})", flush=True)
    wall = time.monotonic() - t_wall
    print(f"{cpu:.0f} CPU s in all, {wall:.0f} s wall for the pool's {a.jobs} jobs", flush=True)
    return {"capacity_is": "the highest rate that passed (crossing: the linear crossing of the "
                           "worst class's attainment with the target inside the final bracket)",
            "seeds": seeds, "cpu_s": cpu, "wall_s": wall, "topologies": res}


def agentic_grid(a, convs: list, slo: dict, topologies: list[str], opts: dict,
                 gpus: dict) -> None:
    """Per topology, each --users count replayed for --seconds: attainment, p99 TTFT
    (streaming requests) and the engine's prefix hit ratio; the most users at --target."""
    users = [int(x) for x in a.users.split(",")]
    print(f"sessions: {len(convs)} conversations, replay {a.replay}, times x {a.time_scale:g}")
    for topo in topologies:
        print(f"\n{topo} ({gpus[topo]} GPUs)\n  users  requests    att  ttft99 ms  "
              "tpot99 ms   hit")
        points = []
        for u in users:
            t = session_table(run_sessions(topo, opts[topo], convs, u, a.seconds, a.seed, a.replay,
                                   a.time_scale), slo, a.warmup_s)
            points.append((float(u), t))
            x = t.get("trace")
            print("  -" if x is None else
                  f"  {u:5d}  {x['n']:8d}  {x['att']:.3f}  {x['ttft_p99']:9.0f}  "
                  f"{x['tpot_p99']:9.0f}  {x['hit']:.3f}", flush=True)
        cap, why = capacity(points, a.target)
        print(f"  sessions at {a.target:.0%}: {'%.1f' % cap if cap is not None else 'n/a'}; "
              f"breaks first: {why}", flush=True)


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main(argv: list[str] | None = None) -> None:
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # the engines left at the end
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "bench.toml"))
    ap.add_argument("--workload", default="mix")
    ap.add_argument("--rates", default="2,4,6,8,12,16,24")
    ap.add_argument("--seconds", type=float, default=None,
                    help="grid: seconds per rate, the warm-up included (120); --precise: "
                         "seconds judged per rate, run after the warm-up (300)")
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--topologies", default="colocated,disaggregated,offloaded")
    ap.add_argument("--options", default="{}",
                    help="emulator options (JSON) for every endpoint, over each built-in "
                         "endpoint's own options in the config")
    ap.add_argument("--slo", action="append", default=[],
                    help="override a class's SLO: CLASS:ttft_ms=500,tpot_ms=40")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--search", type=int, default=0, metavar="N",
                    help="also run the config's search profile N times per endpoint (seeds "
                         "seed..seed+N-1) and print its brackets beside the capacity above")
    ap.add_argument("--warm", action="store_true",
                    help='prime each shared prefix once before every run (cache = "warm")')
    ap.add_argument("--profile", default="search")
    ap.add_argument("--spec", default="{}", help="search settings (JSON) over the profile's")
    ap.add_argument("--precise", action="store_true",
                    help="per topology and seed, bisect the capacity instead of the grid")
    ap.add_argument("--seeds", type=int, default=5, help="--precise: seeds seed..seed+N-1")
    ap.add_argument("--precision", type=float, default=0.02,
                    help="--precise: bisect until hi/lo - 1 <= this")
    ap.add_argument("--step", type=float, default=1.25,
                    help="--precise: the bracketing factor from the start rate")
    ap.add_argument("--guess", default=None,
                    help="--precise: start rate, one for all (8) or per topology "
                         "(offloaded=12,colocated=6); default: the grid's estimate")
    ap.add_argument("--jobs", type=int, default=2, help="--precise: processes")
    ap.add_argument("--json", default=None, metavar="PATH", help="--precise: write results")
    ap.add_argument("--users", default="2,4,8,16",
                    help="agentic traces: the concurrent users (sessions) tried, in place of "
                         "--rates")
    ap.add_argument("--replay", choices=("think", "timestamps"), default="think",
                    help="agentic traces: send after the previous answer plus the think time, "
                         "or at the recorded offsets (never before the previous answer)")
    ap.add_argument("--time-scale", type=float, default=0.1,
                    help="agentic traces: think times and offsets multiplied by this (as a "
                         "profile's time_scale)")
    a = ap.parse_args(argv)
    if a.seconds is None:
        a.seconds = 300.0 if a.precise else 120.0

    reqs, slo, prime = load(Path(a.config), a.workload, a.warm)
    for s in a.slo:
        cls, _, kv = s.partition(":")
        slo[cls] = {k: float(v) for k, v in (p.split("=") for p in kv.split(","))}
    if prime:
        print(f"warm: {len(prime)} shared prefixes, {sum(n for n, _ in prime):,} tokens, "
              "primed before each run")
    sessions = bool(reqs) and isinstance(reqs[0], list)  # an agentic trace's conversations
    if sessions and (a.precise or a.search or a.warm):
        raise SystemExit("an agentic trace replays sessions on the --users grid; --precise, "
                         "--search and --warm are for request workloads")
    classes = ["trace"] if sessions else sorted({r[0] for r in reqs})
    judged = (f"{a.seconds:g} s judged per rate after {a.warmup_s:g} s" if a.precise else
              f"{a.seconds:g} s per rate, first {a.warmup_s:g} s not judged")
    print(f"{a.workload}: {len(reqs)} {'conversations' if sessions else 'requests'}, classes {', '.join(classes)}; SLOs {slo}; "
          f"{judged}", flush=True)
    own = {}  # each topology's options as the config's first built-in endpoint of it sets them
    for ep in load_config(Path(a.config)).endpoints:
        if ep.kind == "builtin":
            own.setdefault(ep.topology, dict(ep.options or {}))
    topologies = a.topologies.split(",")
    opts = {t: {**own.get(t, {}), **json.loads(a.options)} for t in topologies}
    gpus = {t: gpu_count(validate_options(t, opts[t]))[0] for t in topologies}
    if a.precise:
        _SHARED.update(reqs=reqs, slo=slo, prime=prime, warmup_s=a.warmup_s,
                       seconds=a.seconds, target=a.target, precision=a.precision, step=a.step)
        res = precise(a, topologies, opts, gpus)
        if a.json:
            out = {"workload": a.workload, "config": str(a.config), "warm": a.warm,
                   "options": json.loads(a.options), "slo": slo, "target": a.target,
                   "warmup_s": a.warmup_s, "seconds": a.seconds, "precision": a.precision,
                   "step": a.step, "jobs": a.jobs,
                   "command": "python bench/bakeoff_sim.py " + " ".join(
                       shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)),
                   "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **res}
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {a.json}")
        return
    if sessions:
        return agentic_grid(a, reqs, slo, topologies, opts, gpus)
    rates = [float(x) for x in a.rates.split(",")]
    for topo in topologies:
        options = opts[topo]
        print(f"\n{topo} ({gpus[topo]} GPUs)")
        print("  rate  " + "  ".join(f"{c:>30s}" for c in classes))
        points = []
        for rate in rates:
            t = table(run_rate(topo, options, reqs, rate, a.seconds, a.seed, prime),
                      slo, a.warmup_s)
            points.append((rate, t))
            cells = []
            for c in classes:
                x = t.get(c)
                cells.append("-" if x is None else
                             f"{x['att']:.3f} ttft99 {x['ttft_p99']:6.0f} tpot99 "
                             f"{x['tpot_p99']:3.0f} {x['miss'][:4]:>4s}")
            print(f"  {rate:5.1f} " + "  ".join(f"{c:>30s}" for c in cells), flush=True)
        cap, why = capacity(points, a.target)
        per = f"({cap / gpus[topo]:.2f} per GPU)" if cap is not None else ""
        print(f"  capacity at {a.target:.0%}: "
              f"{'%.2f req/s' % cap if cap is not None else 'n/a'} {per}; breaks first: {why}",
              flush=True)
        for k in range(a.search):
            (lo, hi), trail = searched(topo, options, reqs, slo,
                                       {**search_spec(Path(a.config), a.profile, a.workload),
                                        **json.loads(a.spec)}, a.seed + k, prime)
            err = f" ({lo / cap - 1:+.0%})" if lo and cap else ""
            print(f"  search seed {a.seed + k}: {lo} .. {hi} req/s{err}  {trail}", flush=True)


if __name__ == "__main__":
    main()
