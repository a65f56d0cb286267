"""The capacity search as an A/B instrument, over several seeds: per seed, the built-in
colocated endpoint searched twice (A and A', different seeds) and once made slower
(``options.slowdown``, 1.2 by default, same seed as A). Prints each search's shown interval
[highest pass its bootstrap showed, lowest failure it showed] (``Capacity.low_rps`` /
``high_rps``: a rate settled on its estimate lies inside), whether the A/A intervals overlap,
and whether the slowed endpoint's capacity (``Capacity.estimate_rps``, the crossing inside
its bracket) is at least 15% lower with its interval wholly below A's.

The setup is ``tests/test_search_aa.py``'s (its CONFIG): the test runs one seed, this runs
``--seeds`` of them to show how often each claim holds on this host.

Run: ``python bench/search_aa.py [--seeds 5] [--slowdown 1.2] [--out /tmp/kvbench-search-aa]``.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_search_aa import CONFIG  # noqa: E402

from kvbench.core.store import load_results  # noqa: E402
from kvbench.reports.analysis import capacity as C # noqa: E402
from kvbench.reports.statistics.metrics import request_frame  # noqa: E402


def search(out: Path, run_id: str, seed: int, slowdown: float, reuse: bool,
           spec: str | None = None) -> C.Capacity:
    cfg = out / "configs" / f"{run_id}.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    text = CONFIG.format(seed=seed, results=out / "results", slowdown=slowdown)
    if spec:  # the profile's search settings replaced (a finer search than the test's)
        text = re.sub(r"^search = \{.*\}$", "search = " + spec, text, count=1, flags=re.M)
    cfg.write_text(text)
    cmd = [sys.executable, "-m", "kvbench", "run", "--config", str(cfg), "--run-id", run_id]
    print("  $ " + shlex.join(["kvbench"] + cmd[3:]), flush=True)
    run_dir = out / "results" / run_id
    if not (reuse and (run_dir / "run.json").exists()):
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"{run_id} failed ({p.returncode}):\n{p.stdout[-2000:]}"
                             f"\n{p.stderr[-2000:]}")
    res = load_results(run_dir)
    slo = res.meta.config["slo"]
    (cap,) = C.summarise(res.meta.stages, request_frame(res.requests, stages=res.meta.stages,
                                                        slo=slo), slo)
    return cap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed-base", type=int, default=1)
    ap.add_argument("--slowdown", type=float, default=1.2)
    ap.add_argument("--out", default="/tmp/kvbench-search-aa")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--search", default=None, metavar="TOML",
                    help="the search settings as an inline table, instead of the test's quick "
                         "ones, e.g. '{ start_rps = 6.0, probe_s = 10, precision = 0.05, "
                         "budget_s = 110 }'")
    a = ap.parse_args()
    out = Path(a.out)
    t0 = time.monotonic()
    aa = slow_ok = paired = 0
    for k in range(a.seeds):
        s = a.seed_base + 10 * k
        ca = search(out, f"a-{s}", s, 1.0, a.reuse, a.search)
        cb = search(out, f"a2-{s}", s + 1, 1.0, a.reuse, a.search)
        cs = search(out, f"slow-{s}", s, a.slowdown, a.reuse, a.search)
        iv = {n: (c.low_rps, c.high_rps) for n, c in (("A", ca), ("A'", cb), ("slow", cs))}
        # an end the search never showed is open: no shown pass reaches down to 0, no shown
        # failure up to infinity
        num = {n: (lo or 0.0, math.inf if hi is None else hi) for n, (lo, hi) in iv.items()}
        overlap = max(num["A"][0], num["A'"][0]) <= min(num["A"][1], num["A'"][1])
        caps = {"A": ca, "A'": cb}
        # capacities compared: each search's capacity at SLO (Capacity.estimate_rps, the
        # crossing inside its bracket; the report ranks on it)
        apart = {n: num["slow"][1] < num[n][0] and cs.estimate_rps is not None
                 and caps[n].estimate_rps is not None
                 and cs.estimate_rps <= 0.85 * caps[n].estimate_rps for n in ("A", "A'")}
        below = apart["A"] and apart["A'"]
        paired += apart["A"]
        drop = (f"{cs.estimate_rps / ca.estimate_rps - 1:+.1%}"
                if cs.estimate_rps and ca.estimate_rps else "n/a")
        aa += overlap
        slow_ok += below
        print(f"seed {s}: " + ", ".join(f"{n} [{lo}, {hi}]" for n, (lo, hi) in iv.items())
              + f"; A/A overlap {'yes' if overlap else 'NO'}; slowdown {a.slowdown:g}: "
              f"capacity {drop} vs A, {'apart' if apart['A'] else 'NOT apart'} from A (paired), "
              f"{'apart' if below else 'NOT apart'} from both  ({time.monotonic() - t0:.0f} s)",
              flush=True)
    print(f"\nRESULT: A/A intervals overlap in {aa} of {a.seeds}; slowdown {a.slowdown:g} "
          f"at least 15% lower and wholly below A (same seed, the test's claim) in {paired} of "
          f"{a.seeds}, below both A and A' in {slow_ok} of {a.seeds}")


if __name__ == "__main__":
    main()
