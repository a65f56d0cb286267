"""How many concurrent streams and SSE chunks per second one emulator process serves on one
core while its engine steps stay within 1 ms of the modelled step time.

The server runs as ``kvbench serve`` pinned to one core; a client process (pinned to another
core when there is one) holds N streams open with raw asyncio sockets and counts SSE events.
Each level runs ``--seconds``; the server's own step lateness comes from /metrics, and its CPU
time per chunk from /proc (steadier than chunks/s on a shared, noisy host).

    /work/venv/bin/python bench/endpoints_capacity.py --streams 500 1000 2000 3000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time

import orjson

LATE_RE = re.compile(r'^kvbench:step_lateness_seconds_(sum|count)\{engine="r0"\} (\S+)$', re.M)
BUCKET_RE = re.compile(
    r'^kvbench:step_lateness_seconds_bucket\{engine="r0",le="([^"]+)"\} (\S+)$', re.M)
STEPS_RE = re.compile(r'^kvbench:steps_total\{engine="r0"\} (\S+)$', re.M)


async def _http_get(host: str, port: int, path: str) -> str:
    r, w = await asyncio.open_connection(host, port)
    w.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = await r.read()
    w.close()
    return data.split(b"\r\n\r\n", 1)[1].decode()


def _lateness(text: str) -> tuple[float, float, dict]:
    vals = {k: float(v) for k, v in LATE_RE.findall(text)}
    buckets = {float(le) if le != "+Inf" else float("inf"): float(v)
               for le, v in BUCKET_RE.findall(text)}
    steps = float(STEPS_RE.search(text).group(1))
    return vals.get("sum", 0.0), vals.get("count", 0.0), buckets | {"steps": steps}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p99(b0: dict, b1: dict) -> float:
    edges = sorted(k for k in b1 if k != "steps")
    total = b1[float("inf")] - b0.get(float("inf"), 0.0)
    if total <= 0:
        return 0.0
    for e in edges:
        if (b1[e] - b0.get(e, 0.0)) >= 0.99 * total:
            return e
    return float("inf")


async def _stream(host: str, port: int, body: bytes, counts: list, stop: asyncio.Event,
                  opened: list) -> None:
    r, w = await asyncio.open_connection(host, port)
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    first = True
    try:
        while not stop.is_set():
            data = await r.read(65536)
            if not data:
                break
            n = data.count(b"data: {")
            counts[0] += n
            if first and n:
                first = False
                opened[0] += 1  # streaming: its first token arrived
    finally:
        w.close()


async def client(host: str, port: int, streams: int, seconds: float, pid: int) -> dict:
    body = orjson.dumps({"prompt": " ".join(["lorem"] * 32), "max_tokens": 100_000,
                         "stream": True})
    counts, opened = [0], [0]
    stop = asyncio.Event()
    tasks = []
    for i in range(streams):
        tasks.append(asyncio.create_task(_stream(host, port, body, counts, stop, opened)))
        if i % 50 == 49:
            await asyncio.sleep(0.01)
    while opened[0] < streams:  # every stream has its first token
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    m0 = _lateness(await _http_get(host, port, "/metrics"))
    c0, t0, cpu0 = counts[0], time.perf_counter(), _cpu_s(pid)
    await asyncio.sleep(seconds)
    c1, t1, cpu1 = counts[0], time.perf_counter(), _cpu_s(pid)
    m1 = _lateness(await _http_get(host, port, "/metrics"))
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    n_steps = m1[1] - m0[1]
    return {"streams": streams, "chunks_per_s": (c1 - c0) / (t1 - t0),
            "steps_per_s": (m1[2]["steps"] - m0[2]["steps"]) / (t1 - t0),
            "lateness_mean_ms": 1e3 * (m1[0] - m0[0]) / n_steps if n_steps else 0.0,
            "lateness_p99_ms_le": min(1e3 * _p99(m0[2], m1[2]), 1e9),
            "server_cpu_pct": 100 * (cpu1 - cpu0) / (t1 - t0),
            "server_cpu_us_per_chunk": 1e6 * (cpu1 - cpu0) / max(1, c1 - c0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[500, 1000, 2000, 3000])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--step-ms", type=float, default=100.0,
                    help="modelled decode step (via slowdown): 2,000 streams at 100 ms = 20K/s")
    ap.add_argument("--client", nargs=4, metavar=("HOST", "PORT", "STREAMS", "SERVER_PID"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        res = asyncio.run(client(args.client[0], int(args.client[1]), int(args.client[2]),
                                 args.seconds, int(args.client[3])))
        print(orjson.dumps(res).decode(), flush=True)
        return 0
    cores = sorted(os.sched_getaffinity(0))
    srv_core, cli_core = cores[0], cores[-1]
    from kvbench.model import costmodel as cm

    print(f"emulator on core {srv_core}, client on core {cli_core}; {args.seconds:.0f} s per "
          f"level; decode steps slowed to about {args.step_ms:.0f} ms")
    print(f"{'streams':>8} {'chunks/s':>10} {'steps/s':>8} {'model chunks/s':>15} "
          f"{'late mean ms':>13} {'late p99 ms <=':>15} {'srv cpu %':>10} {'cpu us/chunk':>13}")
    for n in args.streams:
        # A decode-only step of n streams (about 60 tokens of context each), slowed to step_ms;
        # a token budget that admits all streams quickly.
        model_ms = cm.decode_step_ms(n, 60)
        opts = {"replicas": 1, "max_num_seqs": 100_000, "slowdown": args.step_ms / model_ms,
                "kv_capacity_tokens": 50_000_000, "step_token_budget": n + 8192}
        srv = subprocess.Popen(["taskset", "-c", str(srv_core), sys.executable, "-m", "kvbench",
                                "serve", "--port", "0", "--options-json", orjson.dumps(opts)],
                               stdout=subprocess.PIPE, text=True)
        try:
            line = srv.stdout.readline()
            host, port = line.split("http://")[1].split(" ")[0].split(":")
            out = subprocess.run(["taskset", "-c", str(cli_core), sys.executable, __file__,
                                  "--seconds", str(args.seconds), "--client", host, port,
                                  str(n), str(srv.pid)], capture_output=True, text=True,
                                 timeout=300)
            if out.returncode != 0:
                print(out.stderr[-2000:])
                return 1
            r = orjson.loads(out.stdout.strip().splitlines()[-1])
            print(f"{n:>8} {r['chunks_per_s']:>10.0f} {r['steps_per_s']:>8.1f} "
                  f"{r['steps_per_s'] * n:>15.0f} {r['lateness_mean_ms']:>13.3f} "
                  f"{r['lateness_p99_ms_le']:>15.2f} {r['server_cpu_pct']:>10.0f} "
                  f"{r['server_cpu_us_per_chunk']:>13.1f}")
        finally:
            srv.terminate()
            srv.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
