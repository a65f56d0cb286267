"""A server that streams without end, as fast as the socket takes it, cannot hold a request or
a Locust run past its limits (issue 33): the stream is cut at the caps derived from the
request's max_tokens (a protocol_error, the connection dropped), the request deadline fires on
time although a read never finds the socket empty, and a plain ``locust -t 10s`` ends on time
with the load process's memory bounded.

The server is a separate process (so it competes with the client only for the cores, as a real
one does) that writes pre-built blocks of events with ``sendall`` until the client goes away or
its own limit (``LIMIT_S``) passes; the limit only keeps a failing run from going on forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

from kvbench.loadgen.timing.client import ConnectionPool, StreamingClient, Target
from kvbench.loadgen.timing.openai import stream_caps

ROOT = Path(__file__).resolve().parent.parent

# header x-flood: "tokens" (default; one token a chat delta), "role" (chat deltas that carry
# no token: parsed and dropped, so memory stays flat and only the deadline can end it), "json"
# (a 200 that is not an event stream, its body without end)
SERVER = r"""
import socket, ssl, sys, threading, time
limit_s = float(sys.argv[1])
tls = None
if len(sys.argv) > 2:  # certificate and key files: answer over TLS
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(sys.argv[2], sys.argv[3])
ev = {b"tokens": b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n',
      b"role": b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'}
blocks = {k: b"%x\r\n%s\r\n" % (len(v) * 2000, v * 2000) for k, v in ev.items()}
blocks[b"json"] = b"%x\r\n%s\r\n" % (65536, b"1," * 32768)
def serve(c):
    try:
        if tls is not None:
            c = tls.wrap_socket(c, server_side=True)
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = c.recv(65536)
            if not got:
                return
            buf += got
        head = buf.split(b"\r\n\r\n", 1)[0].lower()
        if head.startswith(b"get /v1/models"):
            body = b'{"data":[{"id":"m"}]}'
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            return
        mode = b"tokens"
        for line in head.split(b"\r\n"):
            if line.startswith(b"x-flood:"):
                mode = line.split(b":", 1)[1].strip()
        ctype = b"application/json" if mode == b"json" else b"text/event-stream"
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype +
                  b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = blocks[mode]
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            c.sendall(block)
        c.sendall(b"0\r\n\r\n")  # the server's own limit: a failing client is not held forever
    except OSError:
        pass
    finally:
        c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(64)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def flood_server(limit_s: float, *tls_files: str):
    p = subprocess.Popen([sys.executable, "-c", SERVER, str(limit_s), *tls_files],
                         stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    return p, f"{'https' if tls_files else 'http'}://127.0.0.1:{port}"


@pytest.fixture
def server(request):
    p, url = flood_server(getattr(request, "param", 30.0))
    yield url
    p.kill()
    p.wait()


def client(url: str, deadline_s: float = 60.0) -> StreamingClient:
    return StreamingClient(ConnectionPool(Target.parse(url), read_timeout_s=deadline_s,
                                          verify_tls=False), deadline_s=deadline_s)


@pytest.mark.parametrize("server", [3.0], indirect=True)
def test_an_endless_stream_is_cut_at_the_max_tokens_cap(server):
    """On main's client the whole stream is read (3 s of it here, the server's limit) and
    every chunk kept: hundreds of thousands of offsets for a request of 100 tokens."""
    chunks, _, _ = stream_caps(100)
    assert chunks == 2 * 100 + 16
    r = client(server).post_stream("/v1/chat/completions", b"{}", max_tokens=100)
    assert r.status == "protocol_error", (r.status, r.error)
    assert "more than max_tokens=100 allows" in r.error
    assert f"{chunks:,} token-carrying chunks" in r.error
    assert 0 < len(r.offsets_ns) <= chunks and len(r.tokens) == len(r.offsets_ns)
    assert r.ttft_ns is not None and r.e2e_ns is not None


@pytest.mark.parametrize("server", [3.0], indirect=True)
def test_an_endless_stream_without_a_max_tokens_is_still_bounded(server):
    chunks, nbytes, _ = stream_caps(None)
    assert nbytes < 4 << 30
    r = client(server).post_stream("/v1/chat/completions", b"{}")
    assert r.status == "protocol_error", (r.status, r.error)
    assert "no max_tokens" in r.error
    assert len(r.offsets_ns) <= chunks


def test_the_deadline_fires_while_the_server_never_pauses(server):
    """Chunks that carry no token are parsed and dropped, so no cap applies: only the request
    deadline (1 s) can end it. On main's client the reader never went back to the hub while
    reads came back full, so the deadline's timer could not run: it read until the server's
    limit (30 s)."""
    t0 = time.monotonic()
    r = client(server, deadline_s=1.0).post_stream(
        "/v1/chat/completions", b"{}", headers={"x-flood": "role"}, max_tokens=1 << 20)
    took = time.monotonic() - t0
    assert r.status == "timeout", (r.status, r.error, took)
    assert "did not end within 1 s (the request deadline)" in r.error
    assert took < 1.0 + 10.0  # generous for a busy host; main's client took the server's 30 s


def test_the_deadline_fires_over_tls_too(tmp_path):
    """TLS reads go through gevent's own recv, which returns without yielding while bytes are
    buffered: the same flood, the same deadline (on main's client: the server's 30 s)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("openssl cannot make a test certificate here")
    p, url = flood_server(30.0, str(cert), str(key))
    try:
        t0 = time.monotonic()
        r = client(url, deadline_s=1.0).post_stream(
            "/v1/chat/completions", b"{}", headers={"x-flood": "role"}, max_tokens=1 << 20)
        took = time.monotonic() - t0
    finally:
        p.kill()
        p.wait()
    assert r.status == "timeout", (r.status, r.error, took)
    assert took < 1.0 + 10.0


def test_an_endless_body_that_is_not_a_stream_is_not_read_to_its_end(server):
    t0 = time.monotonic()
    r = client(server, deadline_s=20.0).post_stream(
        "/v1/completions", b"{}", headers={"x-flood": "json"}, max_tokens=16)
    assert r.status == "protocol_error" and "instead of an event stream" in r.error
    assert time.monotonic() - t0 < 10.0  # cut after the first 64 KiB, not at the deadline


MB = 1 << 20
# Runs the load process and prints its own peak RSS. Measured from here, a child's ru_maxrss
# would start at this test process's size: exec records the forked copy's high-water mark (the
# kernel's setmax_mm_hiwater_rss), so the load process is the launcher's child, not pytest's.
LAUNCHER = r"""
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(p.pid, 0)
print("kvbench-test: load process peak RSS kB", usage.ru_maxrss, flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_plain_locust_against_an_endless_stream_ends_on_time_in_bounded_memory(tmp_path):
    """The issue's run: plain ``locust -f loadgen/chat.py -t 10s`` against a server streaming
    without end. Measured on main: 117 s and 5.4 GB; here the run must end well within 60 s
    and the load process's peak RSS stay under 450 MB. A watchdog kills the run past 1 GB or
    100 s so that a failing run cannot take the host's memory (the test then fails)."""
    p_srv, url = flood_server(90.0)
    killed = []
    try:
        t0 = time.monotonic()
        p = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, sys.executable, "-m", "locust", "-f",
             "loadgen/chat.py", "--headless", "--host", url, "-u", "4", "-r", "4", "-t", "10s",
             "--only-summary", "--kvbench-model", "m", "--kvbench-timeout", "60",
             "--kvbench-results", str(tmp_path), "--kvbench-run-id", "flood"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)

        def watchdog():
            while p.poll() is None:
                rss_kb = 0
                try:
                    kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
                    for kid in kids:
                        status = Path(f"/proc/{kid}/status").read_text()
                        rss_kb = max(rss_kb, int(status.split("VmRSS:")[1].split()[0]))
                except (OSError, IndexError, ValueError):
                    pass
                if rss_kb > 1 << 20 or time.monotonic() - t0 > 100:
                    killed.append(f"killed at {rss_kb >> 10} MB after "
                                  f"{time.monotonic() - t0:.0f} s")
                    os.killpg(p.pid, signal.SIGKILL)
                    return
                time.sleep(0.1)

        threading.Thread(target=watchdog, daemon=True).start()
        text = p.communicate()[0]
        wall = time.monotonic() - t0
    finally:
        p_srv.kill()
        p_srv.wait()
    peak = [ln for ln in text.splitlines() if ln.startswith("kvbench-test: load process peak")]
    assert not killed and peak, (killed, text[-3000:])
    peak_mb = int(peak[0].split()[-1]) / 1024
    print(f"plain locust -t 10s against an endless stream: {wall:.1f} s wall, "
          f"peak RSS {peak_mb:.0f} MB")
    assert wall < 60, (wall, text[-3000:])
    # The stream itself holds the process at ~90 MB; the peak is the end-of-run Parquet step in
    # the same process: 271 MB on stop 39's install, 332-369 MB on a fresh one of 2026-12-07
    # (the landed commit d030b68 measured alike). Unbounded reading reached 5.4 GB.
    assert peak_mb < 450, (peak_mb, text[-3000:])
    t = read_run_table(tmp_path / "flood", "requests")
    status = t.column("status").to_pylist()
    assert status.count("protocol_error") >= 1, (status, text[-3000:])
    errors = {e for e, s in zip(t.column("error").to_pylist(), status) if s == "protocol_error"}
    assert all("the server sent more than max_tokens=" in e for e in errors), errors
    assert set(status) <= {"protocol_error", "cancelled"}, set(status)


# -- the other reads of a load process or ``kvbench run``: /metrics scrapes, the model lookup


class Endless(BaseHTTPRequestHandler):
    """``/fast``: 40 MiB as fast as the socket takes it (more than any cap; the end only keeps
    a failing client from filling memory); ``/drip``: two bytes every 50 ms for 20 s."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        drip = "drip" in self.path
        chunk = b"1," if drip else b"1," * 32768
        end = time.monotonic() + 20
        sent = 0
        try:
            while sent < 40 * MB and time.monotonic() < end:
                self.wfile.write(chunk)
                self.wfile.flush()
                sent += len(chunk)
                if drip:
                    time.sleep(0.05)
        except OSError:
            pass  # the client went away

    def log_message(self, *args):
        pass


@pytest.fixture
def endless():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def scraper(url: str, timeout_s: float = 5.0):
    from kvbench.collectors.prometheus import PrometheusScraper

    got = []
    return PrometheusScraper("e", url, engine_emit=got.append, timeout_s=timeout_s,
                             log=lambda msg: None)


def test_a_metrics_page_without_end_is_cut_at_16_mib(endless):
    from kvbench.collectors.prometheus import METRICS_MAX_BYTES

    s = scraper(endless + "/metrics/fast")
    assert s.scrape_once() is False
    assert f"more than {METRICS_MAX_BYTES:,} bytes" in s.last_error
    assert METRICS_MAX_BYTES == 16 * MB


def test_a_metrics_page_that_trickles_is_cut_at_the_scrape_deadline(endless):
    """Each wait for bytes is 50 ms, so urllib's own timeout (1 s) never fires; the scrape's
    deadline does. On main's scraper the read lasted the server's 20 s."""
    s = scraper(endless + "/metrics/drip", timeout_s=1.0)
    t0 = time.monotonic()
    assert s.scrape_once() is False
    assert time.monotonic() - t0 < 10
    assert "still answering" in s.last_error


def test_the_model_lookup_of_plain_locust_is_bounded(endless):
    from kvbench.core.errors import UserError
    from kvbench.runs.job import first_model

    with pytest.raises(UserError, match="more than 1,048,576 bytes"):
        first_model(endless + "/fast")
    t0 = time.monotonic()
    with pytest.raises(UserError, match="still answering"):
        first_model(endless + "/drip")
    assert time.monotonic() - t0 < 10 + 10  # its deadline is 10 s; the server drips for 20
