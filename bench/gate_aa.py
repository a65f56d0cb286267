"""Gate calibration on the built-in endpoints: A/A pass rate, a 20% slowdown, sub-noise changes.

For each of ``--pairs`` seeds it runs ``kvbench run`` on one built-in colocated endpoint: a
baseline and a repeat of the same setup (same seed), then one run per ``--slowdowns`` factor
(``options = { slowdown = f }``), and gates every run against that seed's baseline with each
rule set: the ``[gate]`` rules of the repository's bench.toml, and the rules we propose for
short runs. It also gates each repeat against the *next* seed's baseline (A/A across seeds: a
different arrival schedule and request mix). Targets: A/A pass >= 95%, 20% slowdown fails,
a change smaller than the allowance never fails.

Run: ``python bench/gate_aa.py [--pairs 20] [--out /tmp/gate-aa]``; ``--reuse`` re-gates the
runs already in ``--out`` (to try other rules without running again).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test servers and fakes

from kvbench.config import GateConfig, GateRule, load_config  # noqa: E402
from kvbench.core.store import load_results  # noqa: E402
from kvbench.reports.analysis import gate # noqa: E402

CONFIG = """
[suite]
name = "gate-aa"
seed = {seed}
results_dir = "{results}"
workloads = ["chat"]
profile = "open"

[[endpoints]]
name = "emu"
kind = "builtin"
topology = "colocated"
options = {{ slowdown = {slowdown} }}

[workloads.chat]
kind = "chat"
requests = {requests}
prompt_tokens = {{ dist = "constant", mean = {prompt} }}
output_tokens = {{ dist = "constant", mean = {output} }}

[profiles.open]
pacing = "poisson"
stages = [ {{ rate_rps = {rate}, duration_s = {duration} }} ]

[slo.chat]
ttft_ms = 500
tpot_ms = 50

[collect]
nvml = false
"""

# What we propose for a nightly gate on short runs (a few hundred requests per endpoint):
# medians, whose bootstrap interval is narrow at that size, and no p99 (see the report).
PROPOSED = GateConfig(rules=[
    GateRule(metric="ttft_p50", max_increase_pct=10),
    GateRule(metric="tpot_p50", max_increase_pct=10),
    GateRule(metric="e2e_p50", max_increase_pct=10),
    GateRule(metric="goodput_rps", max_decrease_pct=5),
    GateRule(metric="error_rate", max_value=0.005),
])


def kvbench_run(out: Path, run_id: str, seed: int, slowdown: float, a) -> Path:
    run_dir = out / "results" / run_id
    if (run_dir / "run.json").exists():
        return run_dir
    cfg = out / "configs" / f"{run_id}.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(CONFIG.format(seed=seed, results=out / "results", slowdown=slowdown,
                                 requests=max(50, int(a.rate * a.duration * 3)),
                                 prompt=a.prompt_tokens, output=a.output_tokens, rate=a.rate,
                                 duration=a.duration))
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", run_id], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"kvbench run {run_id} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--slowdowns", default="1.2,1.05",
                    help="comma-separated slowdown factors gated against each baseline")
    ap.add_argument("--rate", type=float, default=60.0, help="Poisson arrivals, req/s")
    ap.add_argument("--duration", type=float, default=5.0, help="stage length, s")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--seed-base", type=int, default=100)
    ap.add_argument("--out", default="/tmp/gate-aa")
    ap.add_argument("--reuse", action="store_true", help="only gate runs already in --out")
    a = ap.parse_args()
    out = Path(a.out)
    slowdowns = [float(s) for s in a.slowdowns.split(",") if s.strip()]
    seeds = [a.seed_base + i for i in range(a.pairs)]

    runs: dict[tuple[int, str], Path] = {}
    t0 = time.monotonic()
    for k, seed in enumerate(seeds):
        for label, factor in [("base", 1.0), ("same", 1.0)] + [(f"x{s:g}", s) for s in slowdowns]:
            run_id = f"s{seed}-{label}"
            if a.reuse:
                runs[seed, label] = out / "results" / run_id
                continue
            runs[seed, label] = kvbench_run(out, run_id, seed, factor, a)
        if not a.reuse:
            print(f"seed {seed}: {2 + len(slowdowns)} runs, {time.monotonic() - t0:.0f} s so far",
                  flush=True)
    wall = time.monotonic() - t0

    loaded = {key: load_results(p) for key, p in runs.items()}
    default_cfg = load_config(ROOT / "bench.toml").gate
    rule_sets = {"bench.toml": default_cfg, "proposed": PROPOSED}
    # scenario -> [(baseline key, current key)]
    scenarios = {"A/A same seed": [((s, "base"), (s, "same")) for s in seeds],
                 "A/A next seed": [((seeds[(i + 1) % len(seeds)], "base"), (s, "same"))
                                   for i, s in enumerate(seeds)]}
    for f in slowdowns:
        scenarios[f"slowdown {f:g}"] = [((s, "base"), (s, f"x{f:g}")) for s in seeds]

    n_req = [loaded[s, "base"].requests.num_rows for s in seeds]
    print(f"\n{len(loaded)} runs in {wall:.0f} s; requests per run: median {np.median(n_req):.0f}"
          f" (min {min(n_req)}, max {max(n_req)}); {a.rate:g} req/s Poisson for {a.duration:g} s,"
          f" chat {a.prompt_tokens} -> {a.output_tokens} tokens")
    for rs_name, rs in rule_sets.items():
        print(f"\nrules: {rs_name} ({', '.join(_rule_text(r) for r in rs.rules)})")
        print(f"{'scenario':<16} {'pass':>5} {'inconcl':>8} {'fail':>5}   per rule "
              "(pass/inconclusive/fail; median ratio, median CI width)")
        for sc, pairs in scenarios.items():
            overall = Counter()
            per_rule: dict[str, Counter] = defaultdict(Counter)
            ratios: dict[str, list] = defaultdict(list)
            widths: dict[str, list] = defaultdict(list)
            for j, (bk, ck) in enumerate(pairs):
                res = gate.evaluate(loaded[bk], loaded[ck], rs, seed=j)
                overall[gate.overall(res)] += 1
                for r in res:
                    per_rule[r.metric][r.verdict] += 1
                    if r.kind == "relative" and r.baseline:
                        ratios[r.metric].append(r.current / r.baseline)
                        widths[r.metric].append(r.high - r.low)
                    else:
                        ratios[r.metric].append(r.current)
                        widths[r.metric].append(r.high - r.low)
            cells = []
            for m, c in per_rule.items():
                cells.append(f"{m} {c['pass']}/{c['inconclusive']}/{c['fail']} "
                             f"({np.nanmedian(ratios[m]):.3f}, {np.nanmedian(widths[m]):.3f})")
            print(f"{sc:<16} {overall['pass']:>5} {overall['inconclusive']:>8} "
                  f"{overall['fail']:>5}   " + "; ".join(cells))


def _rule_text(r) -> str:
    if r.max_value is not None:
        return f"{r.metric} <= {r.max_value:g}"
    if r.max_increase_pct is not None:
        return f"{r.metric} +{r.max_increase_pct:g}%"
    return f"{r.metric} -{r.max_decrease_pct:g}%"


if __name__ == "__main__":
    main()
