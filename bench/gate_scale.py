"""Time and peak RSS of `kvbench gate`'s evaluation on two synthetic runs of N requests each:
the old path (both runs loaded whole: core.store.load_results, then gate.evaluate) against the
bounded one (gate.load_bounded: a run over gate.MAX_REQUESTS judged on a seeded sample of that
many for its intervals, its figures exact over every request by
statistics.columnar_groups.exact_figures), each in its own process; the verdicts of both are
printed side by side. Synthesis (not timed) reuses bench/reports_columnar.py's streaming
writer; its disk use is printed.

Usage: python bench/gate_scale.py [--rows 1000000] [--keep DIR] [--skip-old]
(--skip-old for 10M: the old path needs ~12 GB per run)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1] / "tests"))

RULES = [{"metric": "ttft_p99", "max_increase_pct": 10},
         {"metric": "tpot_p50", "max_increase_pct": 10},
         {"metric": "itl_p99", "max_increase_pct": 10},
         {"metric": "e2e_p99", "max_increase_pct": 10},
         {"metric": "throughput_rps", "max_decrease_pct": 10},
         {"metric": "error_rate", "max_value": 0.05}]


def child(which: str, base: Path, cur: Path) -> None:
    import resource

    from kvbench.config import GateConfig
    from kvbench.reports.analysis import gate

    cfg = GateConfig.model_validate({"rules": RULES, "bootstrap_resamples": 1000})
    t = time.perf_counter()
    if which == "old":
        from kvbench.core.store import load_results

        b, c = load_results(base), load_results(cur)
    else:
        b, c = gate.load_bounded(base), gate.load_bounded(cur)
    loaded = time.perf_counter() - t
    res = gate.evaluate(b, c, cfg, slo={})
    secs = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print(json.dumps({"seconds": secs, "load_seconds": loaded, "peak_gb": peak,
                      "rules": [f"{r.verdict:>12} {r.name}: {r.describe()}" for r in res]}))


def measure(which: str, base: Path, cur: Path) -> dict:
    proc = subprocess.run([sys.executable, str(HERE), "--child", which, "--keep",
                           str(base.parent)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"seconds": float("nan"), "peak_gb": float("nan")}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{which:4s}: {got['seconds']:7.2f} s (loading {got['load_seconds']:.2f} s), "
          f"peak RSS {got['peak_gb']:.2f} GB")
    for line in got["rules"]:
        print("      " + line)
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, default=None, help="write both runs here and keep them")
    ap.add_argument("--skip-old", action="store_true")
    ap.add_argument("--child", choices=("old", "new"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.keep / "baseline", args.keep / "current")
        return 0
    from reports_columnar import synthesise

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for seed, name in enumerate(("baseline", "current")):
            if not (root / name / "run.json").exists():
                t = time.perf_counter()
                synthesise(root / name, args.rows, seed=seed)
                print(f"synthesis of {name} took {time.perf_counter() - t:.1f} s (not timed)")
        new = measure("new", root / "baseline", root / "current")
        if not args.skip_old:
            old = measure("old", root / "baseline", root / "current")
            print(f"ratios old/new: time {old['seconds'] / new['seconds']:.2f}x, "
                  f"peak RSS {old['peak_gb'] / new['peak_gb']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
