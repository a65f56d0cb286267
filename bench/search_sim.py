"""The capacity search's state machine against the emulator in virtual time: many seeds in
minutes, to study the search's error against a truth known to a fraction of a percent.

What runs: ``kvbench.runs.search.drive`` (the production state machine: the planner, the
verdicts, the cuts, the pipelining) over ``SimBackend``, which plays the built-in colocated
endpoint's own engine (``kvbench.endpoints``: the same scheduler and step costs) on an asyncio
loop whose clock jumps from event to event. Arrivals are the probes' (``round(rate x
duration)`` at sorted uniform times, as ``loadgen.pacing`` sends them); a request's TTFT is its
first token's engine time minus its arrival. What does not run: HTTP, Locust and the host (a
real run adds about a millisecond to each TTFT and a busy host's late wake-ups).

The truth is a long fixed-rate run per rate (``--truth-s`` of load after ``--truth-warmup-s``),
the attainment of the SLO against rate interpolated to the target, as ``bench/search_truth.py``
does with the real endpoint.

Run: ``python bench/search_sim.py`` (the defaults of ``bench/search_truth.py``: max_num_seqs 4,
time_scale 0.5, chat 64 -> 32 tokens, TTFT SLO 250 ms, budget 78.75 s), ``--seeds 40``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvbench.endpoints.cluster import Cluster  # noqa: E402
from kvbench.endpoints.config import validate_options  # noqa: E402
from kvbench.endpoints.seq import Seq, wait  # noqa: E402
from kvbench.runs import search  # noqa: E402
from kvbench.runs.virtual import VirtualLoop  # noqa: E402


class SimBackend:
    """``search.drive``'s backend: probes become arrivals at the emulated endpoint."""

    def __init__(self, options: dict, prompt: int, output: int, slo: dict, seed: int) -> None:
        self.loop = VirtualLoop()
        self.slo = slo
        self.prompt, self.output = prompt, output
        self.rng = np.random.default_rng(seed)
        self.cluster = Cluster(validate_options("colocated", options).resolved())
        self.loop.run_until_complete(self._start())
        self.control: search.Control | None = None  # as last published
        self.seen_probes = 0
        self.reqs: dict[int, list[dict]] = {}  # probe -> request rows
        self.tasks: dict[int, list[asyncio.Task]] = {}
        self.arrivals: dict[int, asyncio.Task] = {}
        self.t_start: dict[int, float] = {}
        self.current: int | None = None
        self.cut_done: set[int] = set()
        self.rid = 0

    async def _start(self) -> None:
        self.cluster.start()

    # -- the backend interface
    def publish(self, control: search.Control) -> None:
        self.control = control
        while self.seen_probes < len(control.probes):
            p = control.probes[self.seen_probes]
            self.seen_probes += 1
            self._begin(p.index, float(p.rate_rps), p.duration_s)
        for i in control.end:
            if i in self.arrivals:
                self.arrivals[i].cancel()
        for i in control.cut:
            if i not in self.cut_done:
                self.cut_done.add(i)
                self._cut(i)

    def launch(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def started(self, index: int) -> float | None:
        return self.t_start.get(index)

    def now(self) -> float:
        return self.loop.time()

    def sleep(self, dt: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(dt))

    def abort(self) -> None:
        pass

    def frames(self, index: int):
        rows = self.reqs.get(index, [])
        shaped = [r for r in rows if "class" in r]  # every request that reached the endpoint
        done = [r for r in shaped if r["done"]]
        pend = [r for r in shaped if not r["done"]]

        def frame(rs, pending=False):
            if not rs:
                return None
            ok = np.array([r["ok"] for r in rs], bool)
            lat = {k: np.array([np.nan if r[k] is None else r[k] for r in rs], float)
                   for k in ("ttft_ms", "tpot_ms", "e2e_ms")}
            classes = np.array([r["class"] for r in rs], object)
            met = np.zeros(len(rs), bool)
            for c in set(classes):  # each class within its own SLOs
                m = classes == c
                met[m] = within({k: v[m] for k, v in lat.items()}, self.slo.get(c, {}))
            return pd.DataFrame({
                "request_class": classes, "has_slo": [c in self.slo for c in classes],
                "ok": ok & ~pending, "t_scheduled": np.array([r["t"] for r in rs], float),
                "cancelled": np.array([r["cancelled"] for r in rs], bool) | pending,
                **lat, "slo_met": ok & met})

        now = self.loop.time()
        t0 = self.t_start[index]
        load = {"lateness_ms": 0.0, "sent": len(rows), "first_ns": None,
                "pending_ages_s": np.array([now - r["t"] for r in pend]),
                "sent_s": np.array([r["t"] for r in rows], float) - t0,
                "done_s": np.array([r.get("t_done", np.nan) for r in rows], float) - t0,
                "now_s": now - t0}
        return frame(done), frame(pend, True), load

    def e2e_mean_s(self, index: int) -> float | None:
        v = [r["e2e_ms"] for r in self.reqs.get(index, []) if r["done"] and r["ok"]]
        return float(np.mean(v)) / 1e3 if v else None

    # -- the endpoint side
    def _begin(self, index: int, rate: float, duration: float) -> None:
        if self.current is not None and self.current in self.arrivals:
            self.arrivals[self.current].cancel()  # a new probe ends the last one's arrivals
        self.current = index
        t0 = self.loop.time()
        self.t_start[index] = t0
        n = int(round(rate * duration))
        times = t0 + np.sort(self.rng.uniform(0, duration, n))
        self.reqs[index] = []
        self.tasks[index] = []
        self.arrivals[index] = self.loop.create_task(self._arrive(index, times))

    async def _arrive(self, index: int, times) -> None:
        for t in times:
            d = t - self.loop.time()
            if d > 0:
                await asyncio.sleep(d)
            row = {"t": t, "ttft_ms": None, "tpot_ms": None, "e2e_ms": None, "done": False,
                   "ok": False, "cancelled": False}
            self.reqs[index].append(row)
            self.tasks[index].append(self.loop.create_task(self._request(row)))

    def _shape(self, row: dict) -> tuple[int, list[int], int]:
        """The next request's (prompt tokens, KV block hashes, max tokens): a fresh prompt
        of the configured length (no prefix shared with any other), of class chat."""
        row["class"] = "chat"
        return (self.prompt, [int(x) for x in self.rng.integers(1, 2**62, self.prompt // 16)],
                self.output)

    async def _request(self, row: dict) -> None:
        self.rid += 1
        t = self.loop.time()
        seq = Seq(f"r{self.rid}", *self._shape(row), t)
        try:
            await self.cluster.submit(seq, None, None)
            await wait(seq, lambda: seq.generated > 0 or seq.finished)
            row["ttft_ms"] = (seq.t_first - t) * 1e3 if seq.t_first is not None else None
            await wait(seq, lambda: seq.finished)
            row["e2e_ms"] = (self.loop.time() - t) * 1e3
            row["t_done"] = self.loop.time()
            if row["ttft_ms"] is not None and seq.generated > 1:
                row["tpot_ms"] = (row["e2e_ms"] - row["ttft_ms"]) / (seq.generated - 1)
            row["ok"] = seq.error is None
            row["done"] = True
        except asyncio.CancelledError:
            seq.cancelled = True
            row["cancelled"] = True
            row["done"] = True
            raise

    def _cut(self, index: int) -> None:
        if index in self.arrivals:
            self.arrivals[index].cancel()
        for t in self.tasks.get(index, []):
            t.cancel()

    def fixed(self, rate: float, duration: float) -> list[dict]:
        """One fixed-rate stage (the truth's sweep point): its request rows when all ended."""
        self._begin(-1, rate, duration)
        self.sleep(duration)
        while any(not r["done"] for r in self.reqs[-1]):
            self.sleep(1.0)
        return self.reqs[-1]


def within(lat: dict, limits: dict) -> np.ndarray:
    """Per request: every latency of ``lat`` within its limit in ``limits`` (SLO keys)."""
    ok = np.ones(len(next(iter(lat.values()))), bool)
    for k, lim in limits.items():
        v = lat[k]
        ok &= ~np.isnan(v) & (v <= lim)
    return ok


OPTIONS = {"max_num_seqs": 4, "replicas": 1, "time_scale": 0.5}


def spec_of(a) -> dict:
    return dict(start_rps=a.start_rps, growth=1.7, target=0.95, probe_s=a.probe_s,
                min_requests=30, max_probe_s=a.max_probe_s, min_class_requests=5, refine=1,
                precision=a.precision, budget_s=a.budget_s, settle_s=5.0, confidence=0.95,
                max_rps=1e6, min_rps=0.01)


def attainment(rate: float, a, seed: int) -> tuple[float, int]:
    b = SimBackend(a.options, a.prompt, a.output, a.slo, seed)
    rows = b.fixed(rate, a.truth_warmup_s + a.truth_s)
    n_warm = int(round(rate * a.truth_warmup_s))
    judged = rows[n_warm:]
    lat = {k: np.array([np.nan if r[k] is None else r[k] for r in judged], float)
           for k in ("ttft_ms", "tpot_ms", "e2e_ms")}
    met = within(lat, a.slo["chat"]) & np.array([r["ok"] for r in judged], bool)
    return float(met.mean()), len(judged)


def truth(a) -> float:
    rates = np.geomspace(a.sweep_lo, a.sweep_hi, a.sweep_n)
    pts = []
    for r in rates:
        att, n = attainment(float(r), a, seed=7)
        pts.append((float(r), att))
        print(f"    truth {r:6.2f} req/s: attainment {att:.4f} ({n} requests)", flush=True)
    for (r0, a0), (r1, a1) in zip(pts, pts[1:]):
        if a0 >= 0.95 > a1:
            return r0 + (a0 - 0.95) / (a0 - a1) * (r1 - r0)
    raise SystemExit("the sweep does not cross the target: widen --sweep-lo/--sweep-hi")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--seed-base", type=int, default=100)
    ap.add_argument("--truth", type=float, default=None, help="skip the sweep: a known truth")
    ap.add_argument("--truth-s", type=float, default=1500.0)
    ap.add_argument("--truth-warmup-s", type=float, default=60.0)
    ap.add_argument("--sweep-lo", type=float, default=11.0)
    ap.add_argument("--sweep-hi", type=float, default=14.5)
    ap.add_argument("--sweep-n", type=int, default=8)
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--ttft-ms", type=float, default=250.0)
    ap.add_argument("--tpot-ms", type=float, default=None)
    ap.add_argument("--options", default="{}",
                    help="JSON: emulator options over the defaults (max_num_seqs 4, replicas 1, "
                         "time_scale 0.5)")
    ap.add_argument("--start-rps", type=float, default=3.0)
    ap.add_argument("--probe-s", type=float, default=6.0)
    ap.add_argument("--max-probe-s", type=float, default=10.0)
    ap.add_argument("--precision", type=float, default=0.05)
    ap.add_argument("--budget-s", type=float, default=78.75)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--ab", type=float, default=None, metavar="SLOWDOWN",
                    help="A/A and A/B instead: per seed, search A twice (seeds s and s+1000) "
                         "and B = A made SLOWDOWN times slower (seed s); print whether the A/A "
                         "brackets overlap and whether B's capacity is 15%% lower with its "
                         "bracket wholly below A's")
    a = ap.parse_args()
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # the engines left at the end
    a.slo = {"chat": {"ttft_ms": a.ttft_ms, **({"tpot_ms": a.tpot_ms} if a.tpot_ms else {})}}
    a.options = {**OPTIONS, "slowdown": a.slowdown, **json.loads(a.options)}
    t0 = time.monotonic()
    if a.ab is not None:
        return ab(a, t0)
    cap_true = a.truth if a.truth is not None else truth(a)
    print(f"TRUTH {cap_true:.3f} req/s ({time.monotonic() - t0:.0f} s)", flush=True)
    errs = []
    for k in range(a.seeds):
        seed = a.seed_base + k
        b = SimBackend(a.options, a.prompt, a.output, a.slo, seed)
        planner, control = search.drive(b, spec_of(a), say=lambda line: None)
        lo, hi = planner.bracket()
        err = (lo / cap_true - 1) if lo else math.nan
        errs.append(err)
        trail = " ".join(f"{p.rate_rps:g}{(p.verdict or 'v')[0].upper()}"
                         for p in control.probes)
        print(f"    seed {seed}: {lo} req/s ({err * 100:+.1f}%)  {trail}", flush=True)
    e = np.array(errs)
    ok = np.abs(e) <= a.tolerance
    print(f"RESULT: {ok.sum()} of {len(e)} within +-{a.tolerance:.0%}; error median "
          f"{np.nanmedian(e) * 100:+.1f}%, p10 {np.nanpercentile(e, 10) * 100:+.1f}%, p90 "
          f"{np.nanpercentile(e, 90) * 100:+.1f}%; {time.monotonic() - t0:.0f} s")


def ab(a, t0: float) -> None:
    def bracket(seed: int, slowdown: float):
        b = SimBackend({**a.options, "slowdown": slowdown}, a.prompt, a.output, a.slo, seed)
        planner, _ = search.drive(b, spec_of(a), say=lambda line: None)
        return planner.bracket()

    aa = ba = 0
    for k in range(a.seeds):
        s = a.seed_base + k
        x, y, z = bracket(s, 1.0), bracket(s + 1000, 1.0), bracket(s, a.ab)
        overlap = x[0] is not None and y[0] is not None and \
            x[0] <= (y[1] or math.inf) and y[0] <= (x[1] or math.inf)
        below = (z[0] is not None and x[0] is not None and z[0] <= 0.85 * x[0]
                 and (z[1] or math.inf) <= x[0])
        aa += overlap
        ba += below
        print(f"    seed {s}: A {x}, A' {y} ({'overlap' if overlap else 'APART'}); "
              f"B {z} ({'15% lower, wholly below' if below else 'NOT TOLD APART'})", flush=True)
    print(f"RESULT: A/A brackets overlap in {aa} of {a.seeds}; B ({a.ab:g}x slower) at least "
          f"15% lower and wholly below A in {ba} of {a.seeds}; {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
