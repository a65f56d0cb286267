"""A soak's load process: does its memory stay flat while requests go by (issue 34, "Long runs")?

Starts the built-in colocated endpoint (``kvbench serve``, a small ``time_scale`` so it answers
fast) and a plain ``locust -f loadgen/chat.py`` against it, open loop (Poisson) at ``--rate``
requests/s for ``--minutes``, both on 127.0.0.1. Every ``--every`` seconds it samples the load
process's RSS (``/proc/<pid>/status`` VmRSS), its CPU time (``/proc/<pid>/stat``) and the
requests it recorded so far (its sidecar ``proc-*.json``, refreshed with each flush). Printed:
RSS at the start of the load and at its end, the least-squares growth of RSS per 1,000
requests over the load after ``--warmup`` seconds, the requests sent, and the CPU per
request in the first and the last third of the load (the live view derives every record in
this process, so a cost that grew with the run shows there). ``--live-hours`` replays hours of
the live view's since-start structures in seconds instead (memory held, CPU of a summary).

    python bench/soak_memory.py --minutes 5 --rate 150
    python bench/soak_memory.py --minutes 2 --rate 100 --time-scale 0.02
    python bench/soak_memory.py --live-hours 6 --rate 200   # the live view alone, replayed
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCUST = str(Path(sys.executable).with_name("locust"))
CLK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_endpoint(time_scale: float) -> tuple[subprocess.Popen, str]:
    """The built-in colocated endpoint on a free port of 127.0.0.1; (process, url)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbench", "serve", "--topology", "colocated", "--host",
         "127.0.0.1", "--port", str(port), "--options-json",
         json.dumps({"time_scale": time_scale})],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the endpoint did not start: {line}{proc.stdout.read()[-2000:]}")
    return proc, f"http://127.0.0.1:{port}"


def served(url: str) -> int:
    """Requests the endpoint finished (its own counter: vllm:request_success_total)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return int(sum(float(m) for m in re.findall(
        r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (its own, not its children's)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK


def recorded(run_dir: Path) -> tuple[int, int]:
    """(requests started, records written) of the run's load processes, per their sidecars."""
    started = written = 0
    for p in run_dir.glob("proc-*.json"):
        try:
            c = json.loads(p.read_text()).get("counts") or {}
        except (OSError, ValueError):
            continue
        started += int(c.get("requests_started") or 0)
        written += int(c.get("records_written") or 0)
    return started, written


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


def live_replay(hours: float, rate: float, bounded: bool = True) -> None:
    """The live view's side of a soak, replayed fast: one endpoint x class fed a batch of
    finished requests per sink flush (0.5 s) for ``hours`` at ``rate``; at each checkpoint,
    the bytes its since-start structures hold and the CPU of one summary whose since-start
    figures are due (what a watched web UI pays every 10 s). ``bounded=False``: every value
    kept, as before issue 34's fix."""
    import numpy as np

    from kvbench.loadgen.liveview import live_quantiles as LQ

    if not bounded:
        LQ.SinceStart.__init__.__defaults__ = (1 << 62,)
    rng = np.random.default_rng(3)
    ks, per = LQ.KeyStats(), max(1, int(rate / 2))
    marks = sorted({max(1, int(h * 7200)) for h in (hours / 8, hours / 4, hours / 2, hours)})
    t, flushes = 0, 0
    label = "bounded" if bounded else "every value kept"
    due_ns = int(LQ.SINCE_EVERY_S * 1e9) + 1

    def feed(upto: int) -> None:
        nonlocal t, flushes
        while flushes < upto:
            t += 500_000_000
            flushes += 1
            arrays = {"ttft": rng.lognormal(4.4, 0.5, per), "tpot": rng.lognormal(2.7, 0.3, per),
                      "lateness": rng.exponential(0.3, per),
                      "itl_us": rng.integers(5_000, 40_000, per * 8)}
            ks.add(t, arrays, {"done": per, "ok": per})
            ks.trim(t, 30.0)

    for mark in marks:
        feed(mark - 20)
        t += due_ns
        ks.summary(30.0, t, t / 1e9)  # watched: merged up to 10 s ago
        feed(mark)  # the last 10 s of values wait, as they do between two due summaries
        t += due_ns
        held = sum(x.sorted.nbytes + sum(p.nbytes for p in x.pending) +
                   (x.bins.counts.nbytes if x.bins is not None else 0)
                   for x in ks.since.values())
        c0 = time.thread_time()
        ks.summary(30.0, t, t / 1e9)
        ms = (time.thread_time() - c0) * 1e3
        print(f"  live view, {label}: {flushes / 7200:5.2f} h ({flushes * per:,} requests): "
              f"since-start values hold {held / 2**20:7.1f} MB, a due summary {ms:6.1f} ms CPU")
    if not bounded:
        LQ.SinceStart.__init__.__defaults__ = (LQ.EXACT_MAX,)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=150.0, help="open-loop requests/s")
    ap.add_argument("--time-scale", type=float, default=0.02,
                    help="the endpoint's wall seconds per model second")
    ap.add_argument("--every", type=float, default=3.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds of load left out of the fit (imports, caches, the live "
                         "view's histograms filling, allocator arenas); default: half the load")
    ap.add_argument("--locustfile", default="loadgen/chat.py")
    ap.add_argument("--keep", action="store_true", help="keep the results folder")
    ap.add_argument("--live-hours", type=float, default=0.0,
                    help="instead: replay this many hours of the live view at --rate, bounded "
                         "and with every value kept (no load, no endpoint)")
    a = ap.parse_args()
    if a.live_hours:
        for bounded in (False, True):
            live_replay(a.live_hours, a.rate, bounded)
        return 0
    seconds = int(a.minutes * 60)
    if a.warmup is None:
        a.warmup = seconds / 2
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    ep, url = start_endpoint(a.time_scale)
    load = None
    samples = []  # (t since load start, rss kB, cpu s, started, written)
    try:
        load = subprocess.Popen(
            [LOCUST, "-f", a.locustfile, "--host", url, "--headless", "-u", "1", "-r", "1",
             "-t", f"{seconds + 5}s", "--only-summary", "--kvbench-config", "none",
             "--kvbench-results", str(tmp), "--kvbench-run-id", "soak",
             "--kvbench-pacing", "poisson", "--kvbench-rates", f"{a.rate:g}",
             "--kvbench-stage-duration", str(seconds)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp / "locust.log", "w"))
        run_dir = tmp / "soak"
        t0 = None
        while load.poll() is None:
            time.sleep(a.every)
            started, written = recorded(run_dir)
            if t0 is None:
                if started == 0:
                    continue
                t0 = time.monotonic()
            rss, cpu = rss_kb(load.pid), cpu_s(load.pid)
            if rss is None or cpu is None:
                break
            samples.append((time.monotonic() - t0, rss, cpu, started, written))
            if len(samples) % 10 == 0:
                print(f"  t={samples[-1][0]:6.0f}s  rss={rss / 1024:7.1f} MB  "
                      f"records={written:,}", flush=True)
        load.wait(timeout=120)
        total_served = served(url)
    finally:
        if load is not None and load.poll() is None:
            load.kill()
            load.wait()
        ep.terminate()
        try:
            ep.wait(timeout=10)
        except subprocess.TimeoutExpired:
            ep.kill()
    started, written = recorded(tmp / "soak")
    load_samples = [s for s in samples if s[0] <= seconds]
    fit = [s for s in load_samples if s[0] >= a.warmup]
    if len(fit) < 3:
        print("too few samples: run longer (--minutes) or sample more often (--every)")
        return 1
    slope_kb = fit_slope([s[4] for s in fit], [s[1] for s in fit])  # kB per record
    third = len(load_samples) // 3

    def cpu_per_req(part) -> float:
        d_req = part[-1][4] - part[0][4]
        return (part[-1][2] - part[0][2]) / d_req * 1e6 if d_req > 0 else float("nan")

    first, last = load_samples[:third + 1], load_samples[-(third + 1):]
    span = load_samples[-1][0] - load_samples[0][0]
    print(f"load: locust -f {a.locustfile}, poisson {a.rate:g} req/s for {seconds} s, "
          f"endpoint time_scale {a.time_scale:g}")
    print(f"requests sent {started:,}, records written {written:,}, the endpoint served "
          f"{total_served:,} ({written / span if span else 0:.1f} records/s achieved)")
    print(f"RSS at the load's start {load_samples[0][1] / 1024:.1f} MB, after the warm-up "
          f"{fit[0][1] / 1024:.1f} MB, at the load's end {load_samples[-1][1] / 1024:.1f} MB "
          f"(peak during the load {max(s[1] for s in load_samples) / 1024:.1f} MB, with the "
          f"end's compaction {max(s[1] for s in samples) / 1024:.1f} MB)")
    print(f"RSS growth after {a.warmup:g} s of warm-up: {slope_kb * 1000:.1f} kB per 1k "
          f"requests ({slope_kb * 1000 * 3600 * a.rate / 1000 / 1024:.1f} MB per hour at "
          f"{a.rate:g} req/s), fitted over {len(fit)} samples")
    print(f"load process CPU per request: first third {cpu_per_req(first):.0f} us, last third "
          f"{cpu_per_req(last):.0f} us (ratio {cpu_per_req(last) / cpu_per_req(first):.2f})")
    if a.keep:
        print(f"results kept in {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
