"""What the collector agent (collectors/agent.py) asks of a token and of each connection.

* A token must be at least ``MIN_TOKEN_CHARS`` printable ASCII characters without spaces (it
  travels in an ``Authorization`` header); anything weaker is refused before the agent listens.
* A connection's reads run under deadlines: a connection that sends no request within
  ``idle_timeout_s`` (a new one, or a kept-alive one between requests) is closed quietly; a
  request whose line and headers do not all arrive within ``request_timeout_s`` of its first byte
  (a client trickling a byte at a time) is closed with one log line. Sending a response must end
  within ``send_timeout_s``. The agent serves only GETs: a request body is never read, so a
  request that announces one is answered and its connection closed.
* A connection the client aborts (reset, broken pipe) is one log line, not a traceback; any other
  exception while serving keeps its traceback (that is a bug in the agent).
"""

from __future__ import annotations

import io
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from kvbench.core.errors import UserError

MIN_TOKEN_CHARS = 16
IDLE_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 86_400.0


def check_token(token: str | None, *, host: str, token_env: str) -> None:
    """Raises a one-sentence UserError for a token set but too weak to protect anything."""
    if token is None:
        return
    if not token.strip():
        what = "a blank token"
    elif len(token) < MIN_TOKEN_CHARS:
        what = f"a {len(token)}-character token"
    elif not all(33 <= ord(c) <= 126 for c in token):
        what = "a token with spaces or characters outside printable ASCII"
    else:
        return
    raise UserError(
        f"kvbench collect: refusing to listen on {host} with {what} in ${token_env}; set it to "
        f"at least {MIN_TOKEN_CHARS} characters of printable ASCII without spaces, e.g. "
        f"export {token_env}=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')")


class _TimedReader(io.RawIOBase):
    """The socket's reads, each under the handler's current deadline."""

    def __init__(self, sock: socket.socket, handler: "GuardedHandler"):
        self._sock, self._h = sock, handler

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        h = self._h
        if h.deadline is None:
            self._sock.settimeout(h.limits.send_timeout_s)
            return self._sock.recv_into(buf)
        remaining = h.deadline - time.monotonic()
        if remaining <= 0:
            raise h.timed_out()
        self._sock.settimeout(remaining)
        try:
            n = self._sock.recv_into(buf)
        except TimeoutError:
            raise h.timed_out() from None
        if n and h.waiting:  # the request's first byte: its line and headers are now due
            h.waiting = False
            h.deadline = time.monotonic() + h.limits.request_timeout_s
        return n


class Limits:
    def __init__(self, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 request_timeout_s: float = REQUEST_TIMEOUT_S,
                 send_timeout_s: float = SEND_TIMEOUT_S):
        for name, v in (("idle_timeout_s", idle_timeout_s),
                        ("request_timeout_s", request_timeout_s),
                        ("send_timeout_s", send_timeout_s)):
            if not 0 < v <= MAX_TIMEOUT_S:
                raise UserError(f"kvbench collect: {name} {v} must be above 0 and at most "
                                f"{MAX_TIMEOUT_S:g} (one day)")
        self.idle_timeout_s = idle_timeout_s
        self.request_timeout_s = request_timeout_s
        self.send_timeout_s = send_timeout_s


class GuardedHandler(BaseHTTPRequestHandler):
    """A request handler whose reads run under deadlines; subclasses set ``limits`` and ``log``."""

    protocol_version = "HTTP/1.1"
    limits = Limits()
    deadline: float | None = None
    waiting = True

    @staticmethod
    def log(message: str) -> None:  # replaced by the agent's log
        pass

    def log_message(self, *args):  # no per-request logging
        pass

    def setup(self):
        super().setup()
        self.rfile.close()
        self.rfile = io.BufferedReader(_TimedReader(self.connection, self), 65536)

    def peer(self) -> str:
        return _peer(self.client_address)

    def log_error(self, format, *args):  # noqa: A002 (http.server's name)
        if format.startswith("Request timed out") and self.deadline is None:
            self.log(f"kvbench collect: connection from {self.peer()} closed: response not "
                     f"taken within {self.limits.send_timeout_s:g} s")

    def timed_out(self) -> TimeoutError:
        if self.waiting:
            return TimeoutError("idle")  # a quiet close: keep-alive clients do this routinely
        self.log(f"kvbench collect: connection from {self.peer()} closed: request not complete "
                 f"within {self.limits.request_timeout_s:g} s")
        return TimeoutError("slow request")

    def handle_one_request(self):
        self.waiting = True
        self.deadline = time.monotonic() + self.limits.idle_timeout_s
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.deadline = None  # the request is in; sending the response is bounded instead
        self.connection.settimeout(self.limits.send_timeout_s)
        if ok and (self.headers.get("Transfer-Encoding")
                   or self.headers.get("Content-Length", "0").strip() not in ("", "0")):
            self.close_connection = True  # its body is never read: it cannot be followed
        return ok


def _peer(address) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def guarded_server(ipv6: bool, log: Callable[[str], None]) -> type[ThreadingHTTPServer]:
    """A threading HTTP server class that logs an aborted connection as one line."""

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ipv6 else socket.AF_INET
        daemon_threads = True

        def handle_error(self, request, client_address):
            exc = sys.exc_info()[1]
            if not isinstance(exc, OSError):
                return super().handle_error(request, client_address)
            log(f"kvbench collect: connection from {_peer(client_address)} aborted "
                f"({type(exc).__name__}: {exc.strerror or exc})")

    return Server
