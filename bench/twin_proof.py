"""End-to-end proofs of the twin (issue 35): every step is the real CLI (``kvbench run``,
``kvbench calibrate``, ``kvbench predict``) in a child process; prints predicted against truth
with the % error, and each command run.

    python bench/twin_proof.py hidden [--seed 2] [--workloads mix longdoc] [--search]
    python bench/twin_proof.py whatif [--workloads mix longdoc] [--seeds 3] [--search]

hidden: the built-in colocated endpoint with options drawn as bench/calibrate_hidden.py draws
them (unknown to the fit), ``kvbench run --profile calibrate`` against it, ``kvbench calibrate``,
then ``kvbench predict`` on the twin for workloads it was not calibrated on; truth is
``kvbench predict`` on the endpoint's TRUE options (virtual time, same seed and settings) and,
with --search, a real-path ``kvbench run --profile search`` of that endpoint and workload.

whatif: a twin of bench.toml's own colocated endpoint, asked ``--topology disaggregated`` and
``--topology offloaded`` (with the options bench.toml gives those endpoints: none, so the
emulator's link and tier defaults, listed by predict as assumed), against ``kvbench predict``
of bench.toml's disaggregated and offloaded endpoints (virtual time = bakeoff_sim --precise)
and, with --search, their real-path searches.

Measured figures are in the README (section "Calibrate and predict").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KV = [sys.executable, "-m", "kvbench"]
COMMANDS: list[str] = []
REUSE = [False]
SEEDS = ["1"]  # predict --seeds (the median of seeds 1..N); --seeds
PRECISION = ["0.02"]  # predict's bisection (hi/lo - 1); --precision


def _hidden_draw(seed: int) -> dict:
    spec = importlib.util.spec_from_file_location("calibrate_hidden",
                                                  ROOT / "bench" / "calibrate_hidden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.draw(seed)


def sh(args: list[str], cwd: Path) -> str:
    """Run one kvbench command; record it (as typed) and its wall time."""
    shown = "kvbench " + " ".join(shlex.quote(str(a)) for a in args)
    t0 = time.monotonic()
    out = subprocess.run(KV + [str(a) for a in args], cwd=cwd, capture_output=True, text=True)
    dt = time.monotonic() - t0
    COMMANDS.append(f"{shown}   # {dt:.0f} s")
    print(f"[{dt:6.0f} s] {shown}", file=sys.stderr, flush=True)
    if out.returncode:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise SystemExit(f"failed ({out.returncode}): {shown}")
    return out.stdout


def config(work: Path, colocated_options: dict | None) -> Path:
    """bench.toml with its results under ``work`` and (optionally) the colocated endpoint's
    options extended by ``colocated_options``."""
    text = (ROOT / "bench.toml").read_text()
    if colocated_options:
        opts = ", ".join(f"{k} = {v}" for k, v in colocated_options.items())
        text = text.replace("options = { replicas = 1 }", "options = { replicas = 1, "
                            + opts + " }")
    text = text.replace('results_dir = "results"', f'results_dir = "{work / "results"}"')
    cfg = work / "bench.toml"
    cfg.write_text(text)
    return cfg


def capacity(args: list[str], cwd: Path) -> dict:
    """``kvbench predict ... --format json``: the first endpoint's capacity (req/s)."""
    res = json.loads(sh(["predict", *args, "--precision", PRECISION[0], "--seeds", SEEDS[0],
                         "--format", "json"], cwd))
    e = res["endpoints"][0]
    return {"capacity": e["capacity"]["median"], "per_gpu": e["capacity"].get("median_per_gpu"),
            "assumed": [f"{a['option']}={a['value']}" for a in e["assumed"] if a["unobserved"]]}


def searched(cfg: Path, endpoint: str, workload: str, cwd: Path, run_id: str) -> dict:
    """A real-path capacity search of one endpoint and workload; its claimed rate."""
    t0 = time.monotonic()
    sh(["run", "--config", cfg, "--profile", "search", "--endpoint", endpoint, "--workload",
        workload, "--run-id", run_id], cwd)
    found = None
    for path in (cwd / "results" / run_id).glob("search-*.json"):
        found = claimed(json.loads(path.read_text()).get("probes", []))
    return {"capacity": found, "wall_s": time.monotonic() - t0}


def claimed(probes: list[dict]) -> float | None:
    """The search's claim from its control file: the highest rate a 60-s hold passed (a ramp
    probe's pass is short and not claimed where holds ran), below any rate that failed."""
    judged = [p for p in probes if p.get("verdict") in ("pass", "fail") and p.get("rate_rps")
              and "void" not in (p.get("role") or "")]
    held = [p for p in judged if p.get("role") == "hold"]
    use = held or judged
    fails = [p["rate_rps"] for p in use if p["verdict"] == "fail"]
    return max((p["rate_rps"] for p in use if p["verdict"] == "pass"
                and p["rate_rps"] < min(fails, default=float("inf"))), default=None)


def calibrate(cfg: Path, work: Path, run_id: str) -> Path:
    twin = work / f"twin-{run_id}.toml"
    if REUSE[0] and twin.exists():  # --keep DIR of an earlier run: its twin again
        print(f"reusing {twin}", file=sys.stderr)
        return twin
    sh(["run", "--config", cfg, "--profile", "calibrate", "--endpoint", "colocated",
        "--run-id", run_id], work)
    sh(["calibrate", work / "results" / run_id, "--endpoint", "colocated", "-o", twin], work)
    return twin


def err(pred, truth):
    return None if pred is None or not truth else (pred - truth) / truth * 100


def hidden(a, work: Path) -> list[tuple]:
    true = _hidden_draw(a.seed)
    print(f"hidden options (seed {a.seed}): {true}", file=sys.stderr)
    cfg = config(work, true)
    twin = calibrate(cfg, work, f"hidden-{a.seed}")
    fit = tomllib.loads(twin.read_text())["twin"]["fit"]
    rows = [("fit " + k, fit.get(k, {}).get("value"), v, "calibrate") for k, v in true.items()]
    for w in a.workloads:
        p = capacity(["--config", twin, "--slo-config", cfg, "--workload", w], work)
        t = capacity(["--config", cfg, "--endpoint", "colocated", "--workload", w], work)
        rows.append((f"hidden seed {a.seed}: {w} capacity vs true-options predict",
                     p["capacity"], t["capacity"], "predict (virtual time)"))
        if a.search:
            s = searched(cfg, "colocated", w, work, f"search-hidden-{w}")
            rows.append((f"hidden seed {a.seed}: {w} capacity vs real-path search "
                         f"({s['wall_s']:.0f} s)", p["capacity"], s["capacity"], "kvbench run"))
    return rows


def whatif(a, work: Path) -> list[tuple]:
    cfg = config(work, None)
    twin = calibrate(cfg, work, "colocated")
    eps = {e["name"]: e for e in tomllib.loads((ROOT / "bench.toml").read_text())["endpoints"]}
    rows = []
    for w, topo in ((w, t) for w in a.workloads for t in ("disaggregated", "offloaded")):
        given = [f"{k}={json.dumps(v)}" for k, v in (eps[topo].get("options") or {}).items()]
        args = ["--config", twin, "--slo-config", cfg, "--workload", w,
                "--topology", topo] + (["--options", *given] if given else [])
        p = capacity(args, work)
        t = capacity(["--config", cfg, "--endpoint", topo, "--workload", w], work)
        rows.append((f"what-if colocated twin as {topo}: {w} capacity vs {topo}'s own "
                     f"predict (seeds 1-{a.seeds})", p["capacity"], t["capacity"],
                     "predict (virtual time)"))
        print(f"  {topo}: assumed (unobservable on colocated): {', '.join(p['assumed'])}",
              file=sys.stderr)
        if a.search:
            s = searched(cfg, topo, w, work, f"search-{topo}-{w}")
            rows.append((f"what-if as {topo}: {w} vs real-path search ({s['wall_s']:.0f} s)",
                         p["capacity"], s["capacity"], "kvbench run"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="proof", required=True)
    h = sub.add_parser("hidden")
    h.add_argument("--seed", type=int, default=2)
    h.add_argument("--workloads", nargs="+", default=["mix", "longdoc"])
    w = sub.add_parser("whatif")
    w.add_argument("--workloads", nargs="+", default=["mix"])
    for p in (h, w):
        p.add_argument("--search", action="store_true", help="also real-path searches (slow)")
        p.add_argument("--precision", default="0.02",
                       help="kvbench predict --precision (default 0.02, finer than its 0.05)")
        p.add_argument("--seeds", type=int, default=1,
                       help="kvbench predict --seeds: the median capacity of seeds 1..N")
        p.add_argument("--reuse", action="store_true",
                       help="with --keep: the twin calibrated there before, not a new run")
        p.add_argument("--keep", type=Path, default=None, help="keep runs and twins here")
    a = ap.parse_args()
    PRECISION[0] = a.precision
    REUSE[0] = a.reuse
    SEEDS[0] = str(a.seeds)
    work = a.keep or Path(tempfile.mkdtemp(prefix=f"twin-{a.proof}-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = (hidden if a.proof == "hidden" else whatif)(a, work)
    print(f"| proof | predicted | truth | error % | truth from |\n|---|---|---|---|---|")
    for name, pred, truth, how in rows:
        e = err(pred, truth)
        print(f"| {name} | {'-' if pred is None else f'{pred:.4g}'} | "
              f"{'-' if truth is None else f'{truth:.4g}'} | "
              f"{'-' if e is None else f'{e:+.1f}'} | {how} |")
    print("\ncommands (wall time on this host):")
    for c in COMMANDS:
        print("  " + c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
