"""Capacity and accuracy of the streaming client, ours beside the naive Locust reader.

Against ``loadgen.testing`` (a server logging the send time of every chunk on CLOCK_MONOTONIC),
each measurement runs the client in a fresh process pinned to one core (the server on another):

* highest chunks/s per process with per-chunk lag p99 < 5 ms (lag = client arrival - server
  send), and CPU per chunk (client process CPU time / chunks) at each load level;
* light-load TTFT bias: client TTFT minus (server first send - client send), median;
* open loop (our dispatcher, Poisson): achieved rate, inter-arrival CV of the actual sends and
  schedule lag (t_sent - t_scheduled) at 50, 200 and 500 req/s.

The naive reader is what a locustfile written with Locust's helpers does: ``FastHttpSession``
``iter_lines(url, method="POST")`` (``iter_content`` in 1 KB pieces) and ``json.loads`` per chunk.

    python bench/loadgen_capacity.py [--seconds 4] [--itl-ms 10] [--levels 50,100,200]
        [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test servers and fakes


def pin(cpu: int) -> None:
    try:
        n = os.cpu_count() or 1
        os.sched_setaffinity(0, {cpu % n})
    except (AttributeError, OSError):
        pass


# --------------------------------------------------------------------------- client side

def client_main(a) -> None:
    from gevent import monkey

    monkey.patch_all()
    import gevent
    import orjson

    pin(0)
    body = orjson.dumps({"model": "test-model", "prompt": "x", "max_tokens": a.tokens,
                         "stream": True, "stream_options": {"include_usage": True}})
    arrivals: dict[str, list[int]] = {}
    sent: dict[str, int] = {}
    stop_at = time.monotonic() + a.seconds
    counter = [0]

    if a.client == "ours":
        from kvbench.loadgen.timing.client import ConnectionPool, StreamingClient, Target

        pool = ConnectionPool(Target.parse(a.url))
        pool.warm(a.streams)
        client = StreamingClient(pool, deadline_s=60)

        def one(rid):
            r = client.post_stream("/v1/completions", body, headers={"x-request-id": rid})
            sent[rid] = r.t_sent_mono_ns
            arrivals[rid] = [r.t_sent_mono_ns + o for o in r.offsets_ns]
            return r.status
    else:
        import json as stdjson

        from locust.contrib.fasthttp import FastHttpSession
        from locust.env import Environment

        env = Environment()
        sess = FastHttpSession(a.url, env.events.request, None, concurrency=a.streams + 4)

        def one(rid):
            t0 = time.perf_counter_ns()
            got = []
            for line in sess.iter_lines("/v1/completions", method="POST", data=body,
                                        headers={"x-request-id": rid,
                                                 "Content-Type": "application/json"}):
                t = time.perf_counter_ns()
                if line.startswith("data: ") and line != "data: [DONE]":
                    obj = stdjson.loads(line[6:])
                    if obj.get("choices"):
                        got.append(t)
            sent[rid] = t0
            arrivals[rid] = got
            return "ok"

    def loop(k):
        i = 0
        while time.monotonic() < stop_at:
            one(f"{a.client}-{k}-{i}")
            counter[0] += 1
            i += 1

    cpu0 = time.process_time()
    t0 = time.monotonic()
    gevent.joinall([gevent.spawn(loop, k) for k in range(a.streams)])
    wall = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    json.dump({"arrivals": arrivals, "sent": sent, "cpu_s": cpu, "wall_s": wall}, sys.stdout)


def open_loop_main(a) -> None:
    from gevent import monkey

    monkey.patch_all()
    import gevent
    import numpy as np
    import orjson

    from kvbench.loadgen.timing.client import ConnectionPool, StreamingClient, Target
    from kvbench.loadgen.plan.pacing import OpenLoopDispatcher, StagePlan

    pin(0)
    body = orjson.dumps({"model": "test-model", "prompt": "x", "max_tokens": 4, "stream": True})
    pool = ConnectionPool(Target.parse(a.url))
    pool.warm(min(256, int(a.rate * 0.1) + 8))
    client = StreamingClient(pool, deadline_s=30)
    sched, sent, status = [], [], []

    class R:
        arrival_offset_s = None

    def send(req, t_sched, stage):
        r = client.post_stream("/v1/completions", body)
        sched.append(t_sched)
        sent.append(r.t_sent_ns)
        status.append(r.status)

    d = OpenLoopDispatcher(send, iter(R, None), [StagePlan(0, a.seconds, a.rate)],
                           pacing="poisson", max_in_flight=2048, seed=7)
    g = gevent.spawn(d.run)
    g.join()
    d.wait_idle(10)
    s = np.sort(np.array(sent, dtype=np.int64))
    gaps = np.diff(s) / 1e9
    lag = (np.array(sent) - np.array(sched)) / 1e6
    json.dump({"achieved_rps": len(s) / a.seconds, "cv": float(gaps.std() / gaps.mean()),
               "lag_p50_ms": float(np.percentile(lag, 50)),
               "lag_p99_ms": float(np.percentile(lag, 99)),
               "ok": status.count("ok"), "n": len(status), "dropped": d.dropped_at_cap},
              sys.stdout)


# --------------------------------------------------------------------------- orchestration

def run_client(url, client, streams, seconds, tokens) -> dict:
    out = subprocess.run([sys.executable, __file__, "--role", "client", "--url", url,
                          "--client", client, "--streams", str(streams), "--seconds",
                          str(seconds), "--tokens", str(tokens)],
                         capture_output=True, text=True, cwd=ROOT, timeout=seconds * 10 + 60)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout)


def fetch_log(url) -> dict:
    import urllib.request

    return json.loads(urllib.request.urlopen(url + "/log").read())


def server_cpu_s(pid: int | None) -> float:
    """User+system CPU seconds of the load server so far (Linux /proc), 0 elsewhere."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, ValueError, IndexError):
        return 0.0


def measure(url, client, streams, seconds, tokens, server_pid=None) -> dict:
    import numpy as np

    fetch_log(url)
    srv0 = server_cpu_s(server_pid)
    res = run_client(url, client, streams, seconds, tokens)
    srv_cpu = server_cpu_s(server_pid) - srv0
    log = fetch_log(url)
    lags, first, gaps = [], [], []
    chunks = 0
    for rid, arr in res["arrivals"].items():
        truth = log.get(rid, {}).get("sends_ns", [])
        n = min(len(truth), len(arr))
        chunks += len(arr)
        if n == 0:
            continue
        lags += [arr[k] - truth[k] for k in range(n)]
        gaps += [truth[k] - truth[k - 1] for k in range(1, len(truth))]
        first.append(arr[0] - truth[0])
    lag = np.array(lags) / 1e6
    nan = float("nan")
    return {"client": client, "streams": streams, "chunks_s": chunks / res["wall_s"],
            "cpu_us_per_chunk": res["cpu_s"] / max(1, chunks) * 1e6,
            "lag_p50_ms": float(np.percentile(lag, 50)) if len(lag) else nan,
            "lag_p99_ms": float(np.percentile(lag, 99)) if len(lag) else nan,
            "ttft_bias_ms": float(np.median(first)) / 1e6 if first else nan,
            # the server keeps pace if its send gaps stay at the ITL (it is not the bottleneck)
            "server_gap_p99_ms": float(np.percentile(gaps, 99)) / 1e6 if gaps else nan,
            "server_us_per_chunk": srv_cpu / max(1, chunks) * 1e6}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="main", choices=["main", "client", "open"])
    p.add_argument("--url")
    p.add_argument("--client", default="ours")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--rate", type=float, default=50)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--levels", default="50,100,200,300,400,500")
    p.add_argument("--repeat", type=int, default=1, help="runs per level (median is used)")
    a = p.parse_args()
    if a.role == "client":
        return client_main(a)
    if a.role == "open":
        return open_loop_main(a)

    import stream_server as testing

    proc, url = testing.start(ttft_ms=20, itl_ms=a.itl_ms)
    try:
        os.sched_setaffinity(proc.pid, {1 % (os.cpu_count() or 1)})
    except (AttributeError, OSError):
        pass
    print(f"server: {url}, ITL {a.itl_ms} ms, client pinned to cpu 0, server to cpu 1; "
          f"{os.cpu_count()} cpus on this host (shared)")
    try:
        print("\nlight load (1 stream, 100 tokens):")
        for client in ("ours", "naive"):
            m = measure(url, client, 1, a.seconds, a.tokens, proc.pid)
            print(f"  {client:<6} TTFT bias {m['ttft_bias_ms']:7.2f} ms   per-chunk lag p50 "
                  f"{m['lag_p50_ms']:6.2f} p99 {m['lag_p99_ms']:6.2f} ms")
        print(f"\nload sweep (streams x 1 chunk per ITL), {a.repeat} run(s) a level; the "
              "server keeps pace while its send-gap p99 stays near the ITL:")
        print(f"  {'client':<6} {'streams':>7} {'chunks/s':>9} {'lag p50':>8} {'lag p99':>8} "
              f"{'CPU us/chunk':>13} {'srv gap p99':>12} {'srv us/chunk':>13}")
        best = {}
        for client in ("ours", "naive"):
            for n in [int(x) for x in a.levels.split(",")]:
                runs = []
                for _ in range(a.repeat):
                    m = measure(url, client, n, a.seconds, a.tokens, proc.pid)
                    runs.append(m)
                    print(f"  {client:<6} {n:>7} {m['chunks_s']:>9.0f} {m['lag_p50_ms']:>8.2f} "
                          f"{m['lag_p99_ms']:>8.2f} {m['cpu_us_per_chunk']:>13.1f} "
                          f"{m['server_gap_p99_ms']:>12.2f} {m['server_us_per_chunk']:>13.1f}",
                          flush=True)
                p99 = statistics.median(m["lag_p99_ms"] for m in runs)
                if p99 < 5.0:  # the median run of the level (the host is shared: noise)
                    cps = statistics.median(m["chunks_s"] for m in runs)
                    cpu = statistics.median(m["cpu_us_per_chunk"] for m in runs)
                    best[client] = max(best.get(client, (0, 0, 0)), (cps, cpu, p99))
        for client in ("ours", "naive"):
            if client in best:
                cps, cpu, p99 = best[client]
                print(f"  highest with lag p99 < 5 ms: {client}: {cps:.0f} chunks/s (lag p99 "
                      f"{p99:.2f} ms, {cpu:.1f} us CPU per chunk there)")
            else:
                print(f"  highest with lag p99 < 5 ms: {client}: none of the levels")
        print("\nopen loop (Poisson, our dispatcher, 4-token responses):")
        for rate in (50, 200, 500):
            out = subprocess.run([sys.executable, __file__, "--role", "open", "--url", url,
                                  "--rate", str(rate), "--seconds", str(a.seconds)],
                                 capture_output=True, text=True, cwd=ROOT, timeout=120)
            if out.returncode != 0:
                print(out.stderr[-1500:])
                continue
            r = json.loads(out.stdout)
            print(f"  {rate:>4} req/s: achieved {r['achieved_rps']:7.1f} req/s, inter-arrival "
                  f"CV {r['cv']:.2f} (Poisson: 1), schedule lag p50 {r['lag_p50_ms']:.2f} ms "
                  f"p99 {r['lag_p99_ms']:.2f} ms, ok {r['ok']}/{r['n']}, dropped {r['dropped']}")
    finally:
        testing.stop(proc)


if __name__ == "__main__":
    main()
