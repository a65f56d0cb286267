"""The streaming client's own costs at the edges: CPU time of the SSE parser on one huge line, and
memory held while a server sends an endless header block.

1. Parser: one ``data:`` line of 10 MB and 40 MB fed in socket-sized reads; prints the CPU
   seconds of each and their ratio (4x for a linear parser, 16x for a quadratic one).
   ``--parser FILE`` times another copy of the parser module (e.g. an older commit's
   ``git show REV:loadgen/sse.py > /tmp/old_sse.py``) on the same reads.
2. Header flood: a local server answers ``HTTP/1.1 200`` and then header lines without end for
   ``--flood-s`` seconds; prints the client's status, error and its RSS growth (the client
   should give up at its header limit, not buffer until the deadline).

3. ``--locust``: the path users run, end to end: ``locust -f loadgen/longctx.py`` headless
   against a local server whose every answer is one chat delta of ``--locust-mib`` MiB (a 10 MiB
   line, under the 16 MiB limit, and a 40 MiB one, over it); prints each request's status,
   E2E and error from the records, and the load process's CPU seconds.

Run: ``python bench/client_limits.py [--read-bytes 16384] [--parser FILE] [--flood-s 3]
[--locust]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import subprocess
import sys
import time

FLOOD_SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.recv(65536)
c.sendall(b"HTTP/1.1 200 OK\r\n")
line = b"X-Flood: " + b"a" * 990 + b"\r\n"
end = time.monotonic() + float(sys.argv[1])
try:
    while time.monotonic() < end:
        c.sendall(line * 64)
except OSError:
    pass
"""


BIG_LINE_SERVER = r"""
import socket, sys, threading
mib = int(sys.argv[1])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
chunk = (b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * (mib << 20)
         + b'"}}]}\n\ndata: [DONE]\n\n')
def serve(c):
    try:
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += c.recv(65536)
        head, _, body = buf.partition(b"\r\n\r\n")
        n = int([ln.split(b":")[1] for ln in head.split(b"\r\n")
                 if ln.lower().startswith(b"content-length")][0])
        while len(body) < n:
            body += c.recv(65536)
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                  b"connection: close\r\n\r\n" + chunk)
    except OSError:
        pass
    finally:
        c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def locust_big_line(mib: int) -> None:
    """``locust -f loadgen/longctx.py`` against answers of one ``mib`` MiB SSE line."""
    import os
    import tempfile

    import pyarrow.parquet as pq

    from kvbench.core.store import read_table as read_run_table

    srv = subprocess.Popen([sys.executable, "-c", BIG_LINE_SERVER, str(mib)],
                           stdout=subprocess.PIPE, text=True)
    port = int(srv.stdout.readline())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            p = subprocess.run(
                [sys.executable, "-m", "locust", "-f", "loadgen/longctx.py", "--headless",
                 "--host", f"http://127.0.0.1:{port}", "-u", "1", "-r", "1", "-t", "8s",
                 "--only-summary", "--kvbench-results", tmp, "--kvbench-run-id", "big",
                 "--kvbench-model", "m", "--kvbench-pacing", "constant", "--kvbench-rates",
                 "0.5", "--kvbench-stage-duration", "6", "--kvbench-tokenizer-check", "off"],
                cwd=root, capture_output=True, text=True, timeout=300)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            t = read_run_table(os.path.join(tmp, "big"), "requests").to_pylist()
    finally:
        srv.kill()
        srv.wait()
    statuses = sorted({r["status"] for r in t})
    e2e = sorted((r["e2e_ns"] or 0) / 1e6 for r in t)
    err = next((r["error"] for r in t if r["error"]), None)
    print(f"locust -f loadgen/longctx.py, answers of one {mib} MiB line: {len(t)} requests "
          f"{statuses}, E2E ms {[round(x) for x in e2e]}, load process {cpu:.1f} s CPU for "
          f"the whole run (rc {p.returncode}); error: {err}")


def load_parser(path: str | None):
    if path is None:
        from kvbench.loadgen.timing.sse import SSEParser

        return SSEParser, {"max_line_bytes": 1 << 30}
    spec = importlib.util.spec_from_file_location("other_sse", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SSEParser, {}


def parse_cpu_s(parser_cls, kwargs: dict, mbytes: int, read_bytes: int) -> float:
    """CPU seconds to feed one ``data:`` line of ``mbytes`` MiB in reads of ``read_bytes``."""
    line = b"data: " + b"x" * (mbytes << 20) + b"\n\n"
    p = parser_cls(**kwargs)
    events = 0
    t0 = time.process_time()
    for i in range(0, len(line), read_bytes):
        events += len(p.feed(line[i:i + read_bytes]))
    dt = time.process_time() - t0
    assert events == 1, events
    return dt


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def header_flood(flood_s: float) -> None:
    from kvbench.loadgen.timing.client import ConnectionPool, StreamingClient, Target

    srv = subprocess.Popen([sys.executable, "-c", FLOOD_SERVER, str(flood_s)],
                           stdout=subprocess.PIPE, text=True)
    port = int(srv.stdout.readline())
    try:
        client = StreamingClient(ConnectionPool(Target.parse(f"http://127.0.0.1:{port}"),
                                                read_timeout_s=30), deadline_s=flood_s + 5)
        before = rss_kib()
        t0 = time.monotonic()
        res = client.post_stream("/v1/completions", b"{}")
        dt = time.monotonic() - t0
        grew = rss_kib() - before
    finally:
        srv.kill()
        srv.wait()
    print(f"header flood ({flood_s:g} s of header lines): {res.status} after {dt:.2f} s, "
          f"RSS +{grew / 1024:.1f} MiB; error: {res.error}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--read-bytes", type=int, default=16384,
                    help="bytes per feed (a loopback recv returns 16-64 KiB)")
    ap.add_argument("--parser", default=None, help="time this sse.py instead of kvbench's")
    ap.add_argument("--flood-s", type=float, default=3.0)
    ap.add_argument("--skip-flood", action="store_true")
    ap.add_argument("--locust", action="store_true",
                    help="also run locust -f loadgen/longctx.py against 10 and 40 MiB lines")
    a = ap.parse_args(argv)
    cls, kw = load_parser(a.parser)
    small = parse_cpu_s(cls, kw, 10, a.read_bytes)
    big = parse_cpu_s(cls, kw, 40, a.read_bytes)
    print(f"SSE parser ({a.parser or 'kvbench.loadgen.timing.sse'}), reads of {a.read_bytes} B: "
          f"10 MiB line {small:.3f} s CPU, 40 MiB line {big:.3f} s CPU, ratio "
          f"{big / max(small, 1e-9):.1f}x (linear 4x, quadratic 16x)")
    if not a.skip_flood:
        header_flood(a.flood_s)
    if a.locust:
        for mib in (10, 40):
            locust_big_line(mib)


if __name__ == "__main__":
    main()
