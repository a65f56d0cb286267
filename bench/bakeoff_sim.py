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
path, with probes a few seconds long.

    python bench/bakeoff_sim.py [--config bench.toml] [--workload mix|longdoc] [--warm]
        [--rates 2,4,6,8,12,16,24] [--seconds 120] [--warmup-s 20] [--search N]
        [--topologies colocated,disaggregated,offloaded] [--slo CLASS:ttft_ms=..,tpot_ms=..]

Each topology runs with the options of the config's first built-in endpoint of it (the
default's colocated is one replica), ``--options`` over them; ``--warm`` primes every shared
prefix before each run, as ``cache = "warm"`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from search_sim import SimBackend, VirtualLoop  # noqa: E402

from kvbench.config import load_config  # noqa: E402
from kvbench.endpoints.cluster import Cluster  # noqa: E402
from kvbench.endpoints.config import gpu_count, validate_options  # noqa: E402
from kvbench.endpoints.kvcache import block_hashes  # noqa: E402
from kvbench.endpoints.seq import Seq, wait  # noqa: E402
from kvbench.runs import search  # noqa: E402
from kvbench.runs.job import resolve  # noqa: E402
from kvbench.workloads.tokenizer import get_tokenizer  # noqa: E402


def prompts(config: Path, workload: str) -> tuple[list[tuple], dict]:
    """The workload's requests as (class, prompt tokens, block hashes, max tokens), and the
    config's SLOs by class."""
    cfg = load_config(config)
    job = resolve(cfg, workload=workload, endpoint=cfg.endpoints[0].name, url="http://127.0.0.1:9",
                  run_id="sim", results_dir=Path("/tmp"))
    tok = get_tokenizer("builtin")
    out = []
    for req in job.build_workload(tok).requests():
        text = req.prompt if req.messages is None else tok.render_chat(list(req.messages))
        tokens = tok.tokens(text)
        out.append((req.request_class, len(tokens), block_hashes(tokens, 16), req.max_tokens))
    slo = {k: s.limits() for k, s in job.slo.items()}
    return out, slo


def primes(config: Path, workload: str) -> list[tuple[int, list[int]]]:
    """What ``cache = "warm"`` sends before a job: each distinct shared prefix once, as
    (prompt tokens, block hashes)."""
    from kvbench.runs.cache import shared_prefixes

    cfg = load_config(config)
    job = resolve(cfg, workload=workload, endpoint=cfg.endpoints[0].name,
                  url="http://127.0.0.1:9", run_id="sim", results_dir=Path("/tmp"))
    tok = get_tokenizer("builtin")
    out = []
    for text in shared_prefixes(job.build_workload(tok), tok):
        tokens = tok.tokens(text)
        out.append((len(tokens), block_hashes(tokens, 16)))
    return out


def run_rate(topology: str, options: dict, reqs: list[tuple], rate: float, seconds: float,
             seed: int, prime: list | None = None) -> list[dict]:
    """One fixed-rate run from an empty cache (``prime``: each shared prefix sent once first,
    as ``cache = "warm"`` does): a row per request that arrived."""
    loop = VirtualLoop()
    res = validate_options(topology, options).resolved()
    block = res.cfg.block_tokens
    rng = np.random.default_rng(seed)
    n = int(round(rate * seconds))
    times = np.sort(rng.uniform(0, seconds, n))
    rows: list[dict] = []
    base = {"t0": 0.0}

    async def one(i: int, t: float, r: tuple) -> None:
        cls, n_prompt, hashes, max_tokens = r
        if block != 16:
            raise SystemExit("the sim hashes 16-token blocks; the endpoint uses another size")
        seq = Seq(f"r{i}", n_prompt, hashes, max_tokens, loop.time())
        row = {"class": cls, "t": t - base["t0"], "ttft_ms": np.nan, "tpot_ms": np.nan, "e2e_ms": np.nan,
               "ok": False}
        rows.append(row)
        await cluster.submit(seq, None, None)
        await wait(seq, lambda: seq.generated > 0 or seq.finished)
        if seq.t_first is not None:
            row["ttft_ms"] = (seq.t_first - t) * 1e3
        await wait(seq, lambda: seq.finished)
        row["e2e_ms"] = (loop.time() - t) * 1e3
        if seq.generated > 1 and seq.t_first is not None:
            row["tpot_ms"] = (row["e2e_ms"] - row["ttft_ms"]) / (seq.generated - 1)
        row["ok"] = seq.error is None

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


def table(rows: list[dict], slo: dict, warmup_s: float) -> dict:
    """Per class: requests, attainment, p99 TTFT / TPOT and the SLO missed most."""
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
        out[cls] = {"n": len(rs), "att": met / len(rs),
                    "ttft_p99": float(np.nanpercentile(ttft, 99)),
                    "tpot_p99": float(np.nanpercentile(tpot, 99)) if np.isfinite(tpot).any()
                    else float("nan"),
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


def search_spec(config: Path, profile: str, workload: str = "mix") -> dict:
    """The profile's capacity-search settings, as kvbench run hands them to the search."""
    cfg = load_config(config)
    job = resolve(cfg, workload=workload, endpoint=cfg.endpoints[0].name, url="http://127.0.0.1:9",
                  profile=profile, run_id="sim", results_dir=Path("/tmp"))
    return job.search.to_dict()


def main() -> None:
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # the engines left at the end
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "bench.toml"))
    ap.add_argument("--workload", default="mix")
    ap.add_argument("--rates", default="2,4,6,8,12,16,24")
    ap.add_argument("--seconds", type=float, default=120.0)
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
    a = ap.parse_args()
    import json

    reqs, slo = prompts(Path(a.config), a.workload)
    for s in a.slo:
        cls, _, kv = s.partition(":")
        slo[cls] = {k: float(v) for k, v in (p.split("=") for p in kv.split(","))}
    rates = [float(x) for x in a.rates.split(",")]
    prime = primes(Path(a.config), a.workload) if a.warm else None
    if prime:
        print(f"warm: {len(prime)} shared prefixes, {sum(n for n, _ in prime):,} tokens, "
              "primed before each run")
    classes = sorted({r[0] for r in reqs})
    print(f"{a.workload}: {len(reqs)} requests, classes {', '.join(classes)}; SLOs {slo}; "
          f"{a.seconds:g} s per rate, first {a.warmup_s:g} s not judged")
    own = {}  # each topology's options as the config's first built-in endpoint of it sets them
    for ep in load_config(Path(a.config)).endpoints:
        if ep.kind == "builtin":
            own.setdefault(ep.topology, dict(ep.options or {}))
    for topo in a.topologies.split(","):
        options = {**own.get(topo, {}), **json.loads(a.options)}
        gpus = gpu_count(validate_options(topo, options))[0]
        print(f"\n{topo} ({gpus} GPUs)")
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
        per = f"({cap / gpus:.2f} per GPU)" if cap is not None else ""
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
