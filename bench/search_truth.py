"""Capacity search against ground truth, on the built-in colocated endpoint.

The truth: a fine, long, fixed-rate sweep (one ``kvbench run`` per rate, open-loop Poisson,
each long enough for a tight attainment estimate). Each rate's attainment per class is the
share of its requests within every SLO of the class (errors and cuts are misses, as in a
probe's verdict); the true capacity is the highest rate at which every class reaches the
target (0.95), interpolated linearly between the last rate above the target and the first
below it (the worst class's attainment against rate).

Then the capacity search (``pacing = "search"``, the path ``kvbench run`` normally takes: one
Locust child fed probe by probe) runs ``--repeats`` times with different suite seeds. Per
repeat it prints the search's capacity (``Capacity.estimate_rps``: where the attainment
crosses the target between its highest passing and lowest failing rate, read as the truth
is read between two sweep rates; the highest passing rate's error is printed beside it),
its error against the truth, and its load-seconds (sum of its probes' load) as a fraction of the sweep's. Done:
within +-10% using at most a quarter of the sweep's load-seconds in every repeat.

Every run is ``kvbench run --config X --profile P --endpoint colocated`` on a config written to
``--out``; the commands are printed and results are read with kvbench's own readers
(``load_results``, ``request_frame``, ``reports.capacity``).

The endpoint is the built-in colocated one, shrunk so that its capacity is a few requests per
second that two busy cores can offer and measure (``--max-num-seqs`` sequences at a time on
one replica, at ``--time-scale``), with a chat workload of fixed lengths and a TTFT SLO: the
capacity is where queueing for a slot pushes more than 5% of first tokens past the SLO.

The sweep is long because the truth needs it: near capacity misses come in queue bursts, so
an attainment is uncertain over seconds and the crossing moves with it. 50-s stages put it at
32.54 req/s with the sweep's own interval at its last passing rate [0.935, 0.981]; 150-s stages
at 31.89 (2026-12-02). The search then gets a quarter of that sweep's load, with 20-28 s probes.

``--loop closed`` asks the closed-loop question instead: the truth is a sweep of fixed numbers
of users (``--users``), the search runs from ``--start-users`` in whole users. With fixed
lengths the attainment is a cliff (8 users 0.999, 9 users 0.661) and every seed takes the same
path; ``--output-spread 0.75`` varies the answers' lengths: truth 6.11 users (6: 0.964, 7:
0.829), the search 6 users in 5 of 5 seeds on 12% of the sweep's load (2026-12-02).

Run: ``python bench/search_truth.py`` (about 33 minutes: a 16-minute sweep, five searches of
3-4 minutes), ``--skip-sweep --truth 31.889`` for the searches alone, ``--quick`` (a 50-s
sweep, 10-14 s probes; about 11 minutes); ``--reuse`` re-reads the runs already in ``--out``
(their run.json present).
"""

from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from kvbench.core.store import load_results  # noqa: E402
from kvbench.reports.analysis import capacity as C # noqa: E402
from kvbench.reports.statistics.metrics import request_frame  # noqa: E402

CONFIG = """
[suite]
name = "search-truth"
seed = {seed}
results_dir = "{results}"
workloads = ["chat"]
profile = "search"

[[endpoints]]
name = "colocated"
kind = "builtin"
topology = "colocated"
options = {{ max_num_seqs = {seqs}, replicas = 1, time_scale = {time_scale}, slowdown = {slowdown} }}

[workloads.chat]
kind = "chat"
requests = {requests}
prompt_tokens = {{ dist = "constant", mean = {prompt} }}
output_tokens = {output}

[profiles.search]
pacing = "search"
search = {{ {search} }}
drain_s = 2

{sweep}

[slo.chat]
ttft_ms = {ttft_ms}

[collect]
nvml = false
"""

SEARCH = ("start_rps = {start}, growth = 1.7, target = 0.95, probe_s = {probe_s}, "
          "min_requests = 30, max_probe_s = {max_probe_s}, min_class_requests = 5, refine = 1, "
          "precision = {precision}, budget_s = {budget}, settle_s = 5")
# --loop closed: the highest number of users at SLO, from --start-users
SEARCH_CLOSED = ("loop = \"closed\", start_users = {start}, growth = 1.7, target = 0.95, "
                 "probe_s = {probe_s}, min_requests = 30, max_probe_s = {max_probe_s}, "
                 "min_class_requests = 5, refine = 1, precision = {precision}, "
                 "budget_s = {budget}, settle_s = 5")
# the most requests a second the endpoint could answer (its open-loop capacity is ~32): sizes
# the workload so that no prompt repeats within a run (a repeat would be a prefix-cache hit)
CEILING_RPS = 40.0


def output_dist(a) -> str:
    """The answers' lengths: constant, or uniform within +-``--output-spread`` of the mean
    (service times that vary: an attainment that falls gradually with load, and seeds that
    differ even in a closed loop, whose arrivals are not random)."""
    if not a.output_spread:
        return f'{{ dist = "constant", mean = {a.output_tokens} }}'
    lo = max(1, round(a.output_tokens * (1 - a.output_spread)))
    hi = round(a.output_tokens * (1 + a.output_spread))
    return f'{{ dist = "uniform", mean = {a.output_tokens}, min = {lo}, max = {hi} }}'


def write_config(out: Path, name: str, seed: int, a, rates: list[float]) -> Path:
    closed = a.loop == "closed"
    what = "users = {:d}" if closed else "rate_rps = {:g}"
    sweep = "\n".join(
        f"[profiles.rate_{i}]\npacing = \"{'closed' if closed else 'poisson'}\"\n"
        f"stages = [{{ {what.format(int(r) if closed else r)}, "
        f"duration_s = {a.stage_s + a.warmup_s:g} }}]\n"
        "drain_s = 10\n"
        for i, r in enumerate(rates))
    budget = a.budget_s if a.budget_s is not None else a.stage_s * len(rates) / 4
    search = (SEARCH_CLOSED if closed else SEARCH).format(
        start=a.start_users if closed else a.start_rps, probe_s=a.probe_s,
        max_probe_s=a.max_probe_s, precision=a.precision, budget=f"{budget:g}")
    top = CEILING_RPS if closed else max(rates + [a.start_rps])
    requests = int(max(top * (a.stage_s + a.warmup_s), top * 1.7 * budget) * 1.5) + 200
    cfg = out / "configs" / f"{name}.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(CONFIG.format(seed=seed, results=out / "results", seqs=a.max_num_seqs,
                                 time_scale=a.time_scale, slowdown=a.slowdown,
                                 requests=requests, prompt=a.prompt_tokens,
                                 output=output_dist(a), search=search, sweep=sweep,
                                 ttft_ms=a.ttft_ms))
    return cfg


def kvbench_run(cfg: Path, profile: str, run_id: str, out: Path, reuse: bool) -> Path:
    run_dir = out / "results" / run_id
    cmd = [sys.executable, "-m", "kvbench", "run", "--config", str(cfg), "--profile", profile,
           "--endpoint", "colocated", "--run-id", run_id]
    print("  $ " + shlex.join(["kvbench"] + cmd[3:]), flush=True)
    if reuse and (run_dir / "run.json").exists():
        return run_dir
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"kvbench run {run_id} failed ({p.returncode}):\n"
                         f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return run_dir


def frame_of(run_dir: Path):
    res = load_results(run_dir)
    slo = res.meta.config["slo"]
    return res, request_frame(res.requests, stages=res.meta.stages, slo=slo), slo


def sweep_point(run_dir: Path, target: float, warmup_s: float) -> dict:
    """One rate of the sweep: every class's attainment (kvbench's probe verdict on the
    stage's requests scheduled after its first ``warmup_s``), the worst one, and the judged
    load-seconds (the warm-up is not counted)."""
    res, f, slo = frame_of(run_dir)
    (st,) = res.meta.stages
    ts = res.requests.column("t_scheduled").to_numpy(zero_copy_only=False)
    f = f[(ts - int(st["t_start_ns"])) >= warmup_s * 1e9]
    v = C.probe_verdict(f, slo, target=target)
    w = v.worst
    load = float(st["duration_s"]) - warmup_s
    return {"rate": C.level(st), "load_s": load, "n": len(f),
            "worst": w.request_class, "attainment": w.attainment, "low": w.low,
            "high": w.high, "sent_rate": len(f) / load}


def truth_from(points: list[dict], target: float) -> tuple[float | None, str]:
    """The highest rate at which every class reaches ``target``, interpolated: between the
    highest passing rate below the first failing one and that failing rate."""
    pts = sorted(points, key=lambda p: p["rate"])
    first_fail = next((i for i, p in enumerate(pts) if p["attainment"] < target), None)
    if first_fail is None:
        return None, "no rate of the sweep missed the target: sweep higher (--sweep-hi)"
    if first_fail == 0:
        return None, "the lowest rate of the sweep missed the target: sweep lower (--sweep-lo)"
    lo, hi = pts[first_fail - 1], pts[first_fail]
    # the attainment curve between the two, linear in rate
    t = (lo["attainment"] - target) / (lo["attainment"] - hi["attainment"])
    cap = lo["rate"] + t * (hi["rate"] - lo["rate"])
    later = [p for p in pts[first_fail + 1:] if p["attainment"] >= target]
    note = (f"between {lo['rate']:g} ({lo['attainment']:.3f}) and {hi['rate']:g} "
            f"({hi['attainment']:.3f})")
    if later:
        again = ", ".join(f"{p['rate']:g}" for p in later)
        note += (f"; NOTE: higher rates passed again ({again}): the curve is noisy there, "
                 "lengthen --stage-s")
    return cap, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="50-s sweep stages, 10-14 s probes and 3 repeats (about 11 minutes)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed-base", type=int, default=1)
    ap.add_argument("--sweep-lo", type=float, default=27.0, help="lowest sweep rate, req/s")
    ap.add_argument("--sweep-hi", type=float, default=35.0, help="highest sweep rate, req/s")
    ap.add_argument("--sweep-n", type=int, default=6, help="sweep rates (geometric)")
    ap.add_argument("--stage-s", type=float, default=150.0,
                    help="each sweep rate's judged load, s (after --warmup-s)")
    ap.add_argument("--warmup-s", type=float, default=5.0,
                    help="each sweep run's first seconds, left out of its attainment and load "
                         "(a new run's first seconds hold a startup stall of the host)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--output-spread", type=float, default=0.0,
                    help="answers uniform within +- this fraction of --output-tokens (0: "
                         "constant)")
    ap.add_argument("--ttft-ms", type=float, default=100.0)
    ap.add_argument("--start-rps", type=float, default=7.5, help="the search's first probe")
    ap.add_argument("--probe-s", type=float, default=20.0)
    ap.add_argument("--max-probe-s", type=float, default=28.0)
    ap.add_argument("--precision", type=float, default=0.05)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="the search's budget, s (default: a quarter of the sweep's "
                         "load-seconds; with --skip-sweep, of --stage-s x --sweep-n)")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--loop", choices=("open", "closed"), default="open",
                    help="closed: the highest number of users at SLO (sweep --users, search "
                         "from --start-users) instead of the highest rate")
    ap.add_argument("--users", default="4,5,6,7,8,9",
                    help="--loop closed: the sweep's numbers of users")
    ap.add_argument("--start-users", type=int, default=2,
                    help="--loop closed: the search's first probe")
    ap.add_argument("--out", default="/tmp/kvbench-search-truth")
    ap.add_argument("--reuse", action="store_true", help="re-read runs already in --out")
    ap.add_argument("--skip-sweep", action="store_true", help="searches only (needs --truth)")
    ap.add_argument("--truth", type=float, default=None, help="a known truth, req/s")
    a = ap.parse_args()
    if a.quick:
        # the budget is a quarter of the sweep: fewer rates, nearer the capacity, as long each
        a.sweep_lo, a.sweep_hi, a.sweep_n, a.stage_s = 27.0, 35.0, 6, 50.0
        a.probe_s, a.max_probe_s = 10.0, 14.0
        a.repeats = min(a.repeats, 3)
    rates = [float(f"{a.sweep_lo * (a.sweep_hi / a.sweep_lo) ** (i / max(1, a.sweep_n - 1)):.3g}")
             for i in range(a.sweep_n)]
    unit = "req/s"
    if a.loop == "closed":
        rates = [float(int(u)) for u in a.users.split(",")]
        unit = "users"
        if a.out == ap.get_default("out"):
            a.out += "-closed"
    sweep_load = a.stage_s * len(rates)
    out = Path(a.out)
    target = 0.95
    t0 = time.monotonic()
    print(f"endpoint: built-in colocated, 1 replica, max_num_seqs {a.max_num_seqs}, time_scale "
          f"{a.time_scale:g}, slowdown {a.slowdown:g}; chat {a.prompt_tokens} -> "
          f"{a.output_tokens} tokens (+-{a.output_spread:.0%}); SLO TTFT {a.ttft_ms:g} ms; "
          f"target {target}", flush=True)

    truth, note, points = a.truth, "given with --truth", []
    if not a.skip_sweep:
        cfg = write_config(out, "sweep", a.seed_base, a, rates)
        print(f"\nsweep: {len(rates)} rates x {a.stage_s:g} s ({sweep_load:g} load-s judged, "
              f"after {a.warmup_s:g} s of warm-up each), config {cfg}", flush=True)
        for i, r in enumerate(rates):
            run_dir = kvbench_run(cfg, f"rate_{i}", f"sweep-{i}", out, a.reuse)
            p = sweep_point(run_dir, target, a.warmup_s)
            points.append(p)
            print(f"    {r:7.3g} {unit}: {p['n']:5d} requests, worst class {p['worst']} "
                  f"attainment {p['attainment']:.3f} [{p['low']:.3f}, {p['high']:.3f}]  "
                  f"({time.monotonic() - t0:.0f} s so far)", flush=True)
            if p["attainment"] < target - 0.15 and i + 1 < len(rates):
                print("    (far below the target: higher rates skipped, they fail too)")
                break
        truth, note = truth_from(points, target)
        sweep_load = sum(p["load_s"] for p in points)
    if truth is None:
        raise SystemExit(f"no truth: {note}")
    print(f"\nTRUTH: capacity at SLO {truth:.3f} {unit} ({note}); sweep load {sweep_load:g} s",
          flush=True)
    if a.budget_s is None:  # a quarter of the sweep as it ran (rates far above were skipped)
        a.budget_s = sweep_load / 4

    print(f"\nsearch x {a.repeats} (budget {a.budget_s:g} s, precision {a.precision:g}, "
          f"probes {a.probe_s:g}-{a.max_probe_s:g} s from "
          f"{a.start_users if a.loop == 'closed' else a.start_rps:g} {unit}):", flush=True)
    rows = []
    for k in range(a.repeats):
        seed = a.seed_base + 100 + k
        cfg = write_config(out, f"search-{seed}", seed, a, rates)
        run_dir = kvbench_run(cfg, "search", f"search-{seed}", out, a.reuse)
        res, f, slo = frame_of(run_dir)
        (cap,) = C.summarise(res.meta.stages, f, slo)
        probes = [s for s in res.meta.stages if s.get("search")]
        trail = " ".join(f"{C.level(s):g}{(s['search'].get('verdict') or 'void')[0].upper()}"
                         for s in probes)
        err = (cap.estimate_rps / truth - 1) if cap.estimate_rps else math.nan
        err_pass = (cap.capacity_rps / truth - 1) if cap.capacity_rps else math.nan
        frac = cap.load_s / sweep_load
        ok = abs(err) <= a.tolerance and frac <= 0.25
        rows.append((seed, cap, err, frac, ok, err_pass))
        est = f"{cap.estimate_rps:.3f}" if cap.estimate_rps is not None else "none"
        print(f"    seed {seed}: capacity {est} {unit}, error {err * 100:+.1f}% (bracket: "
              f"passed {cap.capacity_rps}, failed {cap.fail_rps}, {cap.status}; the highest "
              f"pass is {err_pass * 100:+.1f}%), load {cap.load_s:.1f} s = "
              f"{frac:.3f} of the sweep -> {'OK' if ok else 'MISS'}; probes {trail}  "
              f"({time.monotonic() - t0:.0f} s so far)", flush=True)
    good = sum(r[4] for r in rows)
    errs = np.array([r[2] for r in rows], float)
    errs_pass = np.array([r[5] for r in rows], float)
    print(f"\nRESULT: {good} of {len(rows)} repeats within +-{a.tolerance * 100:g}% using at most "
          f"a quarter of the sweep's load; errors {', '.join(f'{e * 100:+.1f}%' for e in errs)} "
          f"(the highest passing rate's: {', '.join(f'{e * 100:+.1f}%' for e in errs_pass)});"
          f" truth {truth:.3f} {unit}; {time.monotonic() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
