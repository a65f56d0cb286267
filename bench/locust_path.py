"""Per-chunk timing of the path users run, `locust -f loadgen/chat.py`, beside three others.

The server (``tests/stream_server.py``, pinned to cpu 0) logs the CLOCK_MONOTONIC send time of
every chunk, keyed by the request's ``X-Request-Id``; each client runs in a fresh process pinned
to cpu 1, ``--streams`` concurrent streams of ``--tokens`` tokens at one token per ``--itl-ms``,
each stream sending its next request when one ends, for ``--seconds``. Clients:

* ``locust``: ``locust -f loadgen/chat.py`` headless, closed loop, the records read back from
  the run's ``requests.parquet`` and matched to the server's log by request id (X-Request-Id):
  the whole path (workload, Locust users and events, record sink, hooks);
* ``client``: kvbench's streaming client alone, in gevent greenlets;
* ``plain``: a plain locustfile reading the stream with Locust's ``FastHttpUser``
  (``iter_lines``, ``json.loads`` per line), run by ``locust -f`` too;
* ``lean``: an asyncio protocol client doing the minimum (timestamp each read, count the
  token-carrying events in it): the host's floor.

Per client, printed with its ratio to ``lean`` measured in the same run: per-chunk lag (client
arrival - server send) p50/p99/max, TTFT error (first chunk's lag, median and p99), ITL p99
error (client ITL p99 - server ITL p99), CPU per chunk (process CPU during the load window /
chunks in it), RSS during load and at its peak, and the largest lags on a timeline (seconds
since the first send) so a stall shows where it is. ``locust`` also prints the largest event
loop pause its loop-lag monitor saw per stage (run.json). ``--mix-rss`` adds the RSS of
``locust -f loadgen/mix.py`` with the default bench.toml beside the plain locustfile's.

    python bench/locust_path.py [--streams 64,128,256] [--seconds 6] [--tokens 128]
        [--itl-ms 10] [--clients locust,client,plain,lean] [--mix-rss]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the logging test server
CLIENT_CPU, SERVER_CPU = 1, 0
LOCUST = str(Path(sys.executable).with_name("locust"))
CLK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def pin(cpu: int) -> None:
    try:
        os.sched_setaffinity(0, {cpu % (os.cpu_count() or 1)})
    except (AttributeError, OSError):
        pass


def _body(tokens: int, rid: str) -> bytes:
    return json.dumps({"model": "test-model", "prompt": f"x {rid}", "max_tokens": tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()


# --------------------------------------------------------------------------- the clients

def client_alone(a) -> None:
    """kvbench's StreamingClient in gevent greenlets; arrivals as CLOCK_MONOTONIC ns."""
    from gevent import monkey

    monkey.patch_all()
    import gevent

    from kvbench.loadgen.timing.client import ConnectionPool, StreamingClient, Target

    pool = ConnectionPool(Target.parse(a.url))
    pool.warm(a.streams)
    client = StreamingClient(pool, deadline_s=60)
    arrivals: dict[str, list[int]] = {}
    stop_at = time.monotonic() + a.seconds

    def loop(k):
        i = 0
        while time.monotonic() < stop_at:
            rid = f"client-{k}-{i}"
            r = client.post_stream("/v1/completions", _body(a.tokens, rid), request_id=rid)
            arrivals[rid] = [r.t_sent_mono_ns + o for o in r.offsets_ns]
            i += 1

    from kvbench.loadgen.timing.looplag import LoopLag

    lag = LoopLag().start()  # the same monitor the Locust path runs
    gevent.joinall([gevent.spawn(loop, k) for k in range(a.streams)])
    _write_out(a.out, arrivals, lag.total_max_ns / 1e6)


def _write_out(path: str, arrivals: dict, pause_max_ms: float) -> None:
    Path(path).write_text(json.dumps(arrivals))
    Path(path + ".pause").write_text(f"{pause_max_ms:.2f}")


def lean(a) -> None:
    """The floor: one asyncio protocol per connection, a timestamp per read, token events
    counted by their ``finish_reason`` key (every token chunk has one, the usage chunk not)."""
    mono = time.monotonic_ns
    host, port = a.url.split("//", 1)[1].split(":")
    arrivals: dict[str, list[int]] = {}
    stop_at = time.monotonic() + a.seconds
    open_streams: set = set()
    finished: list = []  # the future main() waits on

    class Stream(asyncio.Protocol):
        def __init__(self, k: int) -> None:
            self.k, self.i, self.got, self.rid, self.head = k, 0, [], "", True

        def connection_made(self, tr) -> None:
            self.tr = tr
            self.send()

        def send(self) -> None:
            if time.monotonic() >= stop_at:
                self.tr.close()
                return
            self.rid = f"lean-{self.k}-{self.i}"
            self.i += 1
            self.got = arrivals[self.rid] = []
            body = _body(a.tokens, self.rid)
            self.head = True
            self.tr.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nX-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
                          % (self.rid.encode(), len(body), body))

        def data_received(self, data: bytes) -> None:
            t = mono()
            n = data.count(b'"finish_reason"')
            if n:
                self.got.extend([t] * n)
            if data.endswith(b"\r\n0\r\n\r\n"):
                self.send()

        def connection_lost(self, exc) -> None:
            open_streams.discard(self)
            if not open_streams and not finished[0].done():
                finished[0].set_result(None)

    pause = {"last": 0, "max": 0}
    tick_ns = 2_000_000  # as loadgen/looplag.py: a timer every 2 ms, its lateness is the pause

    def tick() -> None:
        now = mono()
        pause["max"] = max(pause["max"], now - pause["last"] - tick_ns)
        pause["last"] = now
        asyncio.get_running_loop().call_later(tick_ns / 1e9, tick)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pause["last"] = mono()
        loop.call_later(tick_ns / 1e9, tick)
        finished.append(loop.create_future())
        for k in range(a.streams):
            _, p = await loop.create_connection(lambda k=k: Stream(k), host, int(port))
            open_streams.add(p)
        pause["max"] = 0  # from here on: load (the connections are up)
        await finished[0]

    asyncio.run(main())
    _write_out(a.out, arrivals, pause["max"] / 1e6)


PLAIN_LOCUSTFILE = '''
"""A plain locustfile reading an SSE stream the way Locust's helpers make it easy to."""
import json, os, time
from locust import FastHttpUser, events, task

ARRIVALS = {}
BODY = {"model": "test-model", "max_tokens": int(os.environ["BENCH_TOKENS"]), "stream": True,
        "stream_options": {"include_usage": True}}


class Plain(FastHttpUser):
    n = 0

    @task
    def go(self):
        Plain.n += 1
        rid = f"plain-{id(self)}-{Plain.n}"
        got = ARRIVALS[rid] = []
        body = json.dumps(dict(BODY, prompt=f"x {rid}"))
        for line in self.client.iter_lines("/v1/completions", method="POST", data=body,
                                           headers={"X-Request-Id": rid,
                                                    "Content-Type": "application/json"}):
            t = time.monotonic_ns()
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("choices"):
                    got.append(t)


@events.quitting.add_listener
def _dump(environment, **kw):
    with open(os.environ["BENCH_OUT"], "w") as f:
        json.dump(ARRIVALS, f)
'''


def kvbench_config(tmp: Path, url: str, streams: int, seconds: float, tokens: int) -> Path:
    cfg = tmp / "bench.toml"
    cfg.write_text(f"""
[suite]
name = "locust-path"
tokenizer = "builtin"
workloads = ["chat"]
profile = "closed"

[[endpoints]]
name = "bench"
kind = "openai"
url = "{url}"
model = "test-model"

[workloads.chat]
kind = "chat"
api = "completions"
requests = 20000
prompt_tokens = {{ dist = "constant", mean = 24 }}
output_tokens = {{ dist = "constant", mean = {tokens} }}

[profiles.closed]
pacing = "closed"
stages = [{{ users = {streams}, duration_s = {seconds} }}]
drain_s = 10
""")
    return cfg


# --------------------------------------------------------------------------- sampling

class Sampler:
    """CPU seconds and RSS of one process every 20 ms, from /proc (Linux)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.samples, self.hwm = pid, [], 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                f = open(f"/proc/{self.pid}/stat").read().rsplit(")", 1)[1].split()
                cpu = (int(f[11]) + int(f[12])) / CLK
                rss = int(f[21]) * PAGE
                for ln in open(f"/proc/{self.pid}/status"):
                    if ln.startswith("VmHWM:"):
                        self.hwm = max(self.hwm, int(ln.split()[1]) * 1024)
                self.samples.append((time.monotonic_ns(), cpu, rss))
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def cpu_between(self, t0: int, t1: int) -> float:
        import numpy as np

        s = np.array(self.samples, dtype=float)
        if len(s) < 2:
            return float("nan")
        return float(np.interp(t1, s[:, 0], s[:, 1]) - np.interp(t0, s[:, 0], s[:, 1]))

    def rss_between(self, t0: int, t1: int) -> float:
        r = [rss for t, _, rss in self.samples if t0 <= t <= t1]
        return max(r) if r else float("nan")


def _popen(cmd, env=None, **kw):
    return subprocess.Popen(cmd, cwd=ROOT, env=env, preexec_fn=lambda: pin(CLIENT_CPU), **kw)


def run_client(kind: str, url: str, a, streams: int, tmp: Path) -> tuple[dict, Sampler, dict]:
    """Run one client; returns (rid -> arrival mono ns list, sampler, extra)."""
    out = tmp / f"{kind}-{streams}.json"
    extra: dict = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if kind in ("client", "lean"):
        cmd = [sys.executable, __file__, "--role", kind, "--url", url, "--streams",
               str(streams), "--seconds", str(a.seconds), "--tokens", str(a.tokens),
               "--out", str(out)]
    elif kind == "plain":
        lf = tmp / "plain_locustfile.py"
        lf.write_text(PLAIN_LOCUSTFILE)
        env.update(BENCH_OUT=str(out), BENCH_TOKENS=str(a.tokens))
        cmd = [LOCUST, "-f", str(lf), "--headless", "-u", str(streams), "-r", str(streams),
               "-t", f"{a.seconds}s", "--host", url, "--only-summary", "--stop-timeout", "10"]
    else:
        cfg = kvbench_config(tmp, url, streams, a.seconds, a.tokens)
        results = tmp / f"results-{streams}"
        cmd = [LOCUST, "-f", a.locustfile, "--headless", "-u", str(streams), "-r",
               str(streams), "-t", f"{a.seconds}s", "--host", url, "--only-summary",
               "--kvbench-config", str(cfg), "--kvbench-results", str(results),
               "--kvbench-run-id", "run", "--kvbench-endpoint", "bench",
               "--kvbench-tokenizer-check", "off"]
    p = _popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(p.pid)
    _, err = p.communicate(timeout=a.seconds * 10 + 120)
    sampler.stop()
    if a.stderr and err:
        print(f"--- {kind} stderr:\n{err}")
    if p.returncode != 0:
        raise RuntimeError(f"{kind} client failed (rc {p.returncode}): {err[-3000:]}")
    if kind != "locust":
        pause = Path(str(out) + ".pause")
        if pause.exists():  # the host's floor for the Locust path's loop-lag monitor
            extra["loop_pause_ms"] = [float(pause.read_text())]
        return json.loads(out.read_text()), sampler, extra
    import pyarrow.parquet as pq
    from kvbench.core.store import read_table as read_run_table

    run = tmp / f"results-{streams}" / "run"
    t = read_run_table(run, "requests",
                      columns=["request_id", "t_sent", "chunk_offsets_ns", "status"]).to_pylist()
    epoch_minus_mono = _epoch_minus_mono()
    arrivals = {r["request_id"]: [r["t_sent"] - epoch_minus_mono + o
                                  for o in (r["chunk_offsets_ns"] or [])]
                for r in t if r["status"] == "ok"}
    meta = json.loads((run / "run.json").read_text())
    extra["loop_pause_ms"] = [s.get("loop_pause_max_ms") for s in meta.get("stages", [])]
    extra["loop_pause_offcpu_ms"] = [s.get("loop_pause_max_offcpu_ms")
                                     for s in meta.get("stages", [])]
    return arrivals, sampler, extra


def _epoch_minus_mono() -> int:
    """Unix epoch ns minus CLOCK_MONOTONIC ns on this host (the records' ``t_sent`` is epoch,
    the server's log monotonic): the tightest of many back-to-back readings."""
    best = None
    for _ in range(2000):
        a = time.monotonic_ns()
        e = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, e - (a + b) // 2)
    return best[1]


# --------------------------------------------------------------------------- analysis

def analyse(arrivals: dict, log: dict, sampler: Sampler) -> dict:
    import numpy as np

    lags, first, times, c_itl, s_itl = [], [], [], [], []
    for rid, arr in arrivals.items():
        truth = log.get(rid, {}).get("sends_ns")
        if not truth or not arr:
            continue
        n = min(len(truth), len(arr))
        t = np.array(truth[:n], dtype=np.int64)
        c = np.array(arr[:n], dtype=np.int64)
        lags.append(c - t)
        times.append(c)
        first.append(c[0] - t[0])
        if n > 1:
            c_itl.append(np.diff(c))
            s_itl.append(np.diff(t))
    if not lags:
        raise RuntimeError("no request of this client matched the server's log")
    lag = np.concatenate(lags) / 1e6
    when = np.concatenate(times)
    t0, t1 = int(when.min()), int(when.max())
    chunks = len(lag)
    cpu = sampler.cpu_between(t0, t1)
    ci, si = np.concatenate(c_itl) / 1e6, np.concatenate(s_itl) / 1e6
    # the largest lags on a timeline: clusters of chunks late together (within 20 ms)
    order = np.argsort(when)
    w, lg = when[order], lag[order]
    spikes = []
    for i in np.argsort(-lg)[:400]:
        if lg[i] < 5.0:
            break
        if any(abs(int(w[i]) - s[0]) < 20_000_000 for s in spikes):
            continue
        near = np.abs(w - w[i]) < 20_000_000
        spikes.append((int(w[i]), float(lg[i]), int(near.sum())))
        if len(spikes) == 5:
            break
    return {"chunks": chunks, "chunks_s": chunks / ((t1 - t0) / 1e9),
            "lag_p50": float(np.percentile(lag, 50)), "lag_p99": float(np.percentile(lag, 99)),
            "lag_max": float(lag.max()),
            "ttft_err_p50": float(np.median(first)) / 1e6,
            "ttft_err_p99": float(np.percentile(first, 99)) / 1e6,
            "itl_p99_err": float(np.percentile(ci, 99) - np.percentile(si, 99)),
            "cpu_us_chunk": cpu / chunks * 1e6,
            "rss_mb": sampler.rss_between(t0, t1) / 2**20, "peak_mb": sampler.hwm / 2**20,
            "spikes": [((t - t0) / 1e9, lag_ms, n) for t, lag_ms, n in spikes]}


def fetch_log(url: str) -> dict:
    import urllib.request

    return json.loads(urllib.request.urlopen(url + "/log", timeout=60).read())


def mix_rss(a, url_unused: str, tmp: Path) -> None:
    """RSS of `locust -f loadgen/mix.py` (default bench.toml, built-in endpoints are not
    needed: it sends to a stream server) beside the plain locustfile's, 10 users."""
    import stream_server as testing

    proc, url = testing.start(ttft_ms=20, itl_ms=a.itl_ms)
    try:
        rows = []
        for kind, cmd, env in (
            ("plain locustfile", [LOCUST, "-f", str(tmp / "plain_locustfile.py")],
             dict(os.environ, BENCH_OUT=str(tmp / "mixplain.json"), BENCH_TOKENS="64")),
            ("loadgen/mix.py, default bench.toml",
             [LOCUST, "-f", "loadgen/mix.py", "--kvbench-results", str(tmp / "mixres"),
              "--kvbench-run-id", "mix",
              "--kvbench-tokenizer-check", "off",
              "--kvbench-profile", "closed"], dict(os.environ))):
            (tmp / "plain_locustfile.py").write_text(PLAIN_LOCUSTFILE)
            p = _popen(cmd + ["--headless", "-u", "10", "-r", "10", "-t", "8s", "--host", url,
                              "--only-summary"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
            s = Sampler(p.pid)
            _, err = p.communicate(timeout=120)
            s.stop()
            if p.returncode != 0:
                print(f"  {kind}: failed: {err[-800:]}")
                continue
            # while the load runs: from 1 s after the first sample to the planned end (the
            # kvbench run's finalize, after the load, imports pandas to compact its records)
            t0 = s.samples[0][0]
            mid = [rss for t, _, rss in s.samples if t0 + 1e9 <= t <= t0 + 8e9] or [
                rss for _, _, rss in s.samples]
            rows.append((kind, max(mid) / 2**20, s.hwm / 2**20))
        for kind, rss, hwm in rows:
            print(f"  {kind:<36} RSS during the load {rss:6.1f} MB, peak (VmHWM, "
                  f"finalize included) {hwm:6.1f} MB")
        if len(rows) == 2:
            print(f"  ratio (kvbench / plain): running {rows[1][1] / rows[0][1]:.2f}x, "
                  f"peak {rows[1][2] / rows[0][2]:.2f}x")
    finally:
        testing.stop(proc)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="main", choices=["main", "client", "lean"])
    p.add_argument("--url")
    p.add_argument("--out")
    p.add_argument("--streams", default="64,128,256")
    p.add_argument("--seconds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--clients", default="locust,client,plain,lean")
    p.add_argument("--mix-rss", action="store_true")
    p.add_argument("--locustfile", default="loadgen/chat.py",
                   help="the kvbench locustfile the 'locust' client runs")
    p.add_argument("--stderr", action="store_true", help="print each client's stderr")
    a = p.parse_args()
    if a.role != "main":
        a.streams = int(a.streams)
        pin(CLIENT_CPU)
        return client_alone(a) if a.role == "client" else lean(a)

    import stream_server as testing

    clients = a.clients.split(",")
    proc, url = testing.start(ttft_ms=20, itl_ms=a.itl_ms)
    try:
        os.sched_setaffinity(proc.pid, {SERVER_CPU})
    except (AttributeError, OSError):
        pass
    print(f"server {url} on cpu {SERVER_CPU}, clients on cpu {CLIENT_CPU} ({os.cpu_count()} "
          f"cpus, shared); {a.tokens}-token streams at 1 token / {a.itl_ms:g} ms, "
          f"{a.seconds:g} s per client; ratios are to 'lean' in the same run")
    hdr = (f"  {'client':<7}{'chunks/s':>9}{'lag p50':>8}{'p99':>7}{'max':>7}{'TTFT err':>9}"
           f"{'p99':>7}{'ITL p99 err':>12}{'CPU us/chunk':>13}{'RSS MB':>8}{'peak':>6}")
    try:
        with tempfile.TemporaryDirectory(prefix="kvbench-locust-path-") as d:
            tmp = Path(d)
            for streams in [int(x) for x in a.streams.split(",")]:
                print(f"\n{streams} streams ({streams * 1000 / a.itl_ms:.0f} chunks/s offered):")
                print(hdr)
                res = {}
                for kind in clients:
                    fetch_log(url)  # clear
                    arr, sampler, extra = run_client(kind, url, a, streams, tmp)
                    time.sleep(0.3)
                    m = analyse(arr, fetch_log(url), sampler)
                    m.update(extra)
                    res[kind] = m
                    print(f"  {kind:<7}{m['chunks_s']:>9.0f}{m['lag_p50']:>8.2f}"
                          f"{m['lag_p99']:>7.2f}{m['lag_max']:>7.1f}{m['ttft_err_p50']:>9.2f}"
                          f"{m['ttft_err_p99']:>7.2f}{m['itl_p99_err']:>12.2f}"
                          f"{m['cpu_us_chunk']:>13.1f}{m['rss_mb']:>8.1f}{m['peak_mb']:>6.0f}",
                          flush=True)
                if "lean" in res:
                    base = res["lean"]
                    for kind, m in res.items():
                        if kind == "lean":
                            continue
                        print(f"  {kind} / lean: lag p99 {m['lag_p99'] / base['lag_p99']:.2f}x, "
                              f"CPU per chunk {m['cpu_us_chunk'] / base['cpu_us_chunk']:.2f}x")
                if "locust" in res and "client" in res:
                    print(f"  locust / client: lag p99 "
                          f"{res['locust']['lag_p99'] / res['client']['lag_p99']:.2f}x, CPU per "
                          f"chunk {res['locust']['cpu_us_chunk'] / res['client']['cpu_us_chunk']:.2f}x")
                for kind, m in res.items():
                    sp = ", ".join(f"{t:.2f} s: {lg:.1f} ms ({n} chunks)"
                                   for t, lg, n in m["spikes"]) or "none over 5 ms"
                    print(f"  largest lags, {kind}: {sp}")
                    if m.get("loop_pause_ms"):
                        src = "per stage (run.json)" if kind == "locust" else "(its own timer)"
                        off = m.get("loop_pause_offcpu_ms")
                        print(f"  {kind}: largest event-loop pause {src}: "
                              f"{m['loop_pause_ms']} ms"
                              + (f", of which the process was not running {off} ms"
                                 if off else ""))
            if a.mix_rss:
                print("\nmemory of the default mix (10 users, 8 s):")
                (tmp / "plain_locustfile.py").write_text(PLAIN_LOCUSTFILE)
                mix_rss(a, url, tmp)
    finally:
        testing.stop(proc)


if __name__ == "__main__":
    main()
