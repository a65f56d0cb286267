"""The streaming client's own costs at the edges: CPU time of the SSE parser on one huge line, and
memory held while a server sends an endless header block.

1. Parser: one ``data:`` line of 10 MB and 40 MB fed in socket-sized reads; prints the CPU
   seconds of each and their ratio (4x for a linear parser, 16x for a quadratic one).
   ``--parser FILE`` times another copy of the parser module (e.g. an older commit's
   ``git show REV:loadgen/sse.py > /tmp/old_sse.py``) on the same reads.
2. Header flood: a local server answers ``HTTP/1.1 200`` and then header lines without end for
   ``--flood-s`` seconds; prints the client's status, error and its RSS growth (the client
   should give up at its header limit, not buffer until the deadline).

Run: ``python bench/client_limits.py [--read-bytes 16384] [--parser FILE] [--flood-s 3]``.
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


def load_parser(path: str | None):
    if path is None:
        from kvbench.loadgen.sse import SSEParser

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
    from kvbench.loadgen.client import ConnectionPool, StreamingClient, Target

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
    a = ap.parse_args(argv)
    cls, kw = load_parser(a.parser)
    small = parse_cpu_s(cls, kw, 10, a.read_bytes)
    big = parse_cpu_s(cls, kw, 40, a.read_bytes)
    print(f"SSE parser ({a.parser or 'kvbench.loadgen.sse'}), reads of {a.read_bytes} B: "
          f"10 MiB line {small:.3f} s CPU, 40 MiB line {big:.3f} s CPU, ratio "
          f"{big / max(small, 1e-9):.1f}x (linear 4x, quadratic 16x)")
    if not a.skip_flood:
        header_flood(a.flood_s)


if __name__ == "__main__":
    main()
