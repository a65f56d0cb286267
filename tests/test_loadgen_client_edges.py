"""The streaming client at the edges, against scripted servers on 127.0.0.1 (real sockets, one
thread a connection): stale pooled connections are resent once, header floods and huge SSE lines
stop at their limits, Retry-After is recorded, a proxy's HTML page is stored as its title, a
refused connection logs one line instead of a traceback a greenlet, and one fault reads as one
text whichever timer noticed it."""

from __future__ import annotations

import email.utils
import logging
import socket
import threading
import time
from types import SimpleNamespace

import gevent
import orjson
import pytest

from kvbench.loadgen.timing import client as client_mod
from kvbench.loadgen.timing.client import ConnectionPool, StreamingClient, Target, retry_after_s

BODY = orjson.dumps({"model": "m", "prompt": "a b c", "max_tokens": 2, "stream": True})


class Script:
    """A TCP server whose every connection runs ``handler(sock, server)`` in its own thread;
    it counts connections and logs each request body with its connection's number."""

    def __init__(self, handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.handler = handler
        self.conns = 0
        self.requests: list[tuple[int, bytes]] = []
        self.closed_ns: list[int] = []  # monotonic time of each idle close
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self.handler, args=(s, self), daemon=True).start()

    def read_request(self, s) -> bytes | None:
        """The next request's body on ``s`` (None at EOF), logged."""
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = s.recv(65536)
            if not data:
                return None
            buf += data
        head, _, body = buf.partition(b"\r\n\r\n")
        n = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                n = int(v)
        while len(body) < n:
            body += s.recv(65536)
        self.requests.append((self.conns, body))
        return body

    def close(self) -> None:
        self.sock.close()


def sse_ok(tokens: int = 2) -> bytes:
    ev = b"".join(b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
                  for _ in range(tokens))
    ev += (b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'
           b"data: [DONE]\n\n" % tokens)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
            % len(ev)) + ev


def idle_closer(idle_s: float):
    """Keep-alive like llama-server: answers requests, closes a connection idle for idle_s."""

    def handle(s, srv):
        s.settimeout(idle_s)
        try:
            while True:
                if srv.read_request(s) is None:
                    break
                s.sendall(sse_ok())
        except socket.timeout:
            srv.closed_ns.append(time.monotonic_ns())
        finally:
            s.close()

    return handle


@pytest.fixture
def script():
    servers = []

    def make(handler):
        srv = Script(handler)
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


def client(url, **kw) -> StreamingClient:
    pool = ConnectionPool(Target.parse(url), read_timeout_s=kw.pop("read_timeout_s", 5))
    return StreamingClient(pool, deadline_s=kw.pop("deadline_s", 5), **kw)


@pytest.mark.parametrize("warmed", [True, False])
def test_stale_pooled_connection_is_resent_once_on_a_fresh_one(script, warmed):
    srv = script(idle_closer(0.05))
    c = client(srv.url)
    if warmed:
        assert c.pool.warm(1) == 1  # a pooled connection never used yet
    else:
        assert c.post_stream("/v1/completions", BODY).status == "ok"
    while not srv.closed_ns:  # the server closes the idle connection
        gevent.sleep(0.01)
    r = c.post_stream("/v1/completions", BODY)
    assert (r.status, r.error, r.resent) == ("ok", None, True)
    assert srv.conns == 2  # the stale connection, then the fresh one
    assert len(srv.requests) == (1 if warmed else 2)  # the stale send never reached a handler
    # t_sent is the resend's: after the server closed the first connection, with its setup
    assert r.t_sent_mono_ns > srv.closed_ns[0] and r.connect_ns > 0
    assert len(c.pool.idle) == 1


def test_fresh_connection_closed_without_a_reply_is_not_resent(script):
    def slam(s, srv):
        srv.read_request(s)
        s.close()

    srv = script(slam)
    c = client(srv.url)
    r = c.post_stream("/v1/completions", BODY)  # fresh connection: the server saw the request
    assert (r.status, r.resent) == ("disconnected", False)
    assert r.error == "EOFError: connection closed before the response headers"
    assert srv.conns == 1 and len(srv.requests) == 1
    c.pool.warm(1)
    gevent.sleep(0.05)
    r = c.post_stream("/v1/completions", BODY)  # pooled: resent once, then it is an error
    assert (r.status, r.resent) == ("disconnected", True)
    assert srv.conns == 3 and len(srv.requests) == 3


def test_endless_header_block_stops_at_the_header_limit(script):
    stop = threading.Event()

    def flood(s, srv):
        srv.read_request(s)
        try:
            s.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.is_set():
                s.sendall(b"X-Flood: " + b"a" * 1000 + b"\r\n")
        except OSError:
            pass
        s.close()

    srv = script(flood)
    try:
        r = client(srv.url).post_stream("/v1/completions", BODY)
        assert r.status == "protocol_error"
        assert r.error == ("the response headers exceeded 65,536 bytes without ending (the "
                           "client's limit, max_header_bytes)")
        r = client(srv.url, max_header_bytes=4096).post_stream("/v1/completions", BODY)
        assert r.status == "protocol_error" and "exceeded 4,096 bytes" in r.error
    finally:
        stop.set()


def test_header_block_in_many_small_reads_and_interim_responses(script):
    def dribble(s, srv):
        srv.read_request(s)
        wire = b"HTTP/1.1 100 Continue\r\n\r\n" + sse_ok()
        for i in range(0, len(wire), 7):
            s.sendall(wire[i:i + 7])
            time.sleep(0.001)
        s.close()

    srv = script(dribble)
    r = client(srv.url).post_stream("/v1/completions", BODY)
    assert (r.status, r.http_status, r.completion_tokens) == ("ok", 200, 2)
    # the interim response and the real one in a single read
    def at_once(s, srv):
        srv.read_request(s)
        s.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" + sse_ok())
        s.close()

    srv = script(at_once)
    r = client(srv.url, deadline_s=2).post_stream("/v1/completions", BODY)
    assert (r.status, r.http_status, r.completion_tokens) == ("ok", 200, 2)


def test_sse_line_over_the_limit_is_a_protocol_error(script):
    def huge(s, srv):
        srv.read_request(s)
        try:
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                      b"data: " + b"x" * (3 << 20))
            time.sleep(1)
        except OSError:
            pass
        s.close()

    srv = script(huge)
    r = client(srv.url, max_line_bytes=1 << 20).post_stream("/v1/completions", BODY)
    assert r.status == "protocol_error"
    assert "a line longer than 1,048,576 bytes" in r.error and "max_line_bytes" in r.error


def reply(status_line: bytes, headers: bytes, body: bytes):
    def handle(s, srv):
        srv.read_request(s)
        s.sendall(b"HTTP/1.1 " + status_line + b"\r\n" + headers +
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        s.close()

    return handle


def test_retry_after_is_recorded_in_seconds_or_from_a_date(script):
    srv = script(reply(b"429 Too Many Requests", b"Retry-After: 7\r\n"
                       b"Content-Type: application/json\r\n",
                       b'{"error": {"message": "slow down", "code": 429}}'))
    r = client(srv.url).post_stream("/v1/completions", BODY)
    assert (r.status, r.http_status, r.retry_after_s) == ("http_error", 429, 7.0)
    assert r.error == "HTTP 429: slow down (code 429)"
    when = email.utils.formatdate(time.time() + 120, usegmt=True)
    srv = script(reply(b"503 Service Unavailable", b"Retry-After: " + when.encode() + b"\r\n",
                       b"busy"))
    r = client(srv.url).post_stream("/v1/completions", BODY)
    assert r.status == "http_error" and 110 <= r.retry_after_s <= 121


def test_retry_after_values():
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 30, usegmt=True).encode()
    assert retry_after_s(b"120") == 120.0
    assert retry_after_s(b" 1.5 ") == 1.5
    assert retry_after_s(date, now_s=now) == 30.0
    assert retry_after_s(email.utils.formatdate(now - 30, usegmt=True).encode(), now_s=now) == 0
    assert retry_after_s(b"-3") == 0.0
    for bad in (b"soon", b"", b"nan", b"inf", b"Mon, 99 Foo 2024"):
        assert retry_after_s(bad) is None, bad


NGINX_502 = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>"
             b"502 Bad Gateway</h1></center>\r\n<hr><center>nginx/1.18.0</center>\r\n</body>\r\n"
             b"</html>\r\n" + b"<!-- padding -->\r\n" * 6)


def test_proxy_html_error_page_is_stored_as_its_title(script):
    srv = script(reply(b"502 Bad Gateway", b"Content-Type: text/html\r\n", NGINX_502))
    r = client(srv.url).post_stream("/v1/completions", BODY)
    assert (r.status, r.http_status) == ("http_error", 502)
    assert r.error == "HTTP 502: 502 Bad Gateway (an HTML page)"


def test_refused_connection_logs_one_line_not_a_traceback_per_greenlet(caplog, capfd):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    client_mod._LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="kvbench.loadgen"):
        for _ in range(10):  # ten users, each warming its pool
            assert ConnectionPool(Target.parse(url)).warm(1) == 0
        r = client(url).post_stream("/v1/completions", BODY)
    gevent.sleep(0)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "failed with" not in err
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines == [f"kvbench: cannot open a connection to {url}: "
                     "ConnectionRefusedError: [Errno 111] Connection refused"]
    assert (r.status, r.error) == ("disconnected",
                                   "ConnectionRefusedError: [Errno 111] Connection refused")


# -- one fault, one text: the emulator's stall, with the read timeout equal to the deadline (as
# the Locust path sets them), where either timer may notice the silence first

@pytest.fixture(scope="module")
def emulator():
    from kvbench.runs import builtin

    proc, url = builtin.start(SimpleNamespace(name="emu", topology="colocated", options={}))
    try:
        import urllib.request

        model = orjson.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
        yield url, model
    finally:
        builtin.stop(proc)


@pytest.mark.parametrize("fault,text", [
    ("stall_before=800", "no response within 0.3 s of the send"),
    ("slow_headers=800", "no response within 0.3 s of the send"),
    ("stall_mid=800", "the response did not end within 0.3 s (the request deadline)"),
])
def test_a_stall_reads_as_one_text_whichever_timer_fires(emulator, fault, text):
    url, model = emulator
    body = orjson.dumps({"model": model, "prompt": "alpha beta gamma", "max_tokens": 40,
                         "stream": True})
    c = client(url, read_timeout_s=0.3, deadline_s=0.3)
    texts = {(r.status, r.error) for r in (
        c.post_stream("/v1/completions", body, headers={"x-kvbench-fault": fault})
        for _ in range(6))}
    assert texts == {("timeout", text)}


def test_read_timeout_shorter_than_the_deadline_names_the_read_timeout(emulator):
    url, model = emulator
    body = orjson.dumps({"model": model, "prompt": "alpha beta gamma", "max_tokens": 40,
                         "stream": True})
    c = client(url, read_timeout_s=0.2, deadline_s=5)
    r = c.post_stream("/v1/completions", body, headers={"x-kvbench-fault": "stall_mid=800"})
    assert (r.status, r.error) == ("timeout", "the response stopped: no bytes for 0.2 s (the "
                                              "read timeout)")
    assert r.offsets_ns  # the tokens before the stall are kept


def test_connect_that_never_completes_reads_as_no_connection(monkeypatch):
    # a connect that hangs (a black-holed address): the deadline, then the connect timeout
    def hang(*a, **k):
        gevent.sleep(10)

    monkeypatch.setattr(client_mod, "connect", hang)
    r = client("http://127.0.0.1:9", deadline_s=0.2).post_stream("/v1/completions", BODY)
    assert (r.status, r.error) == ("timeout", "no connection within 0.2 s")

    def slow(*a, **k):
        raise socket.timeout("timed out")

    monkeypatch.setattr(client_mod, "connect", slow)
    pool = ConnectionPool(Target.parse("http://127.0.0.1:9"), connect_timeout_s=3)
    r = StreamingClient(pool, deadline_s=5).post_stream("/v1/completions", BODY)
    assert (r.status, r.error) == ("timeout", "no connection within 3 s")


def test_locust_against_a_refused_port_prints_no_traceback(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadgen/longctx.py", "--headless", "--host",
         f"http://127.0.0.1:{port}", "-u", "10", "-r", "10", "-t", "2s", "--only-summary",
         "--kvbench-model", "m", "--kvbench-results", str(tmp_path)],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out  # was one gevent traceback per user (10)
    assert out.count("kvbench: cannot open a connection to") == 1, out
    assert "disconnected: ConnectionRefusedError: [Errno 111] Connection refused" in out


def test_addresses_are_resolved_once_and_rotated(monkeypatch):
    # one lookup shared by every connection of the process (gevent hands each lookup to a
    # native thread), rotating over the addresses as round-robin DNS would
    calls = []

    def lookup(host, port, *a):
        calls.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.2", port))]

    monkeypatch.setattr(client_mod.gsocket, "getaddrinfo", lookup)
    monkeypatch.setattr(client_mod, "_ADDRS", {})
    got = [client_mod.resolve("svc.example", 8000)[4][0] for _ in range(4)]
    assert got == ["192.0.2.1", "192.0.2.2", "192.0.2.1", "192.0.2.2"]
    assert calls == ["svc.example"]
    monkeypatch.setattr(client_mod, "ADDR_TTL_S", 0.0)  # expired: looked up again
    client_mod.resolve("svc.example", 8000)
    assert calls == ["svc.example", "svc.example"]
