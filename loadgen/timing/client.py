"""The streaming HTTP/1.1 client: a lean reader on gevent sockets with per-read timestamps.
(Over 400 lines: pool, chunked decoder and reader form one hot path, read best together.)

Why not Locust's ``iter_lines``/``iter_content``: they buffer about 1 KB, which added about 60 ms
to TTFT and lumped ITLs when measured (issue 4). Here the monotonic clock is read the moment a
``recv`` returns, before any parsing; chunks that arrived in one read share its timestamp (they
did arrive together). Connection setup is timed apart (``connect_ns``) and never inside TTFT.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

import _socket

import gevent
from gevent import socket as gsocket
from gevent.hub import get_hub

from kvbench.loadgen.timing.result import Result  # noqa: F401 - importers take it from here
from kvbench.loadgen.timing.openai import StreamState, error_message, settle_answer, stream_caps
from kvbench.loadgen.timing.sse import MAX_LINE_BYTES, SSEParser

log = logging.getLogger("kvbench.loadgen")
_mono = time.perf_counter_ns
_epoch = time.time_ns
# Under glibc's 128 KiB mmap threshold: a 256 KiB recv buffer cost an mmap, mremap and munmap
# per read (13 us a chunk, measured with strace); 64 KiB still holds ~500 chunks.
RECV_BYTES = 65536
ERROR_BODY_BYTES = 65536
# Limits on what a server may make the client hold (over them: a protocol_error, never a
# buffer that grows until the deadline). ``StreamingClient(max_header_bytes=...,
# max_line_bytes=...)`` changes them; the SSE line limit (16 MiB) is ``sse.MAX_LINE_BYTES``.
MAX_HEADER_BYTES = 64 << 10  # status line and headers together; real servers send < 2 KiB
MAX_CHUNK_LINE_BYTES = 4096  # a chunk-size line (hex size plus extensions)
# Back to the hub after this long of reads that each filled the buffer (a server sending
# without pause): the request deadline, Locust's -t and stop, and the other users then run.
YIELD_NS = 2_000_000

# Response headers of the built-in endpoints (ms floats) -> record columns (ns).
SERVER_MS_HEADERS = {
    b"x-kvbench-queue-ms": "server_queue_ns",
    b"x-kvbench-prefill-ms": "server_prefill_ns",
    b"x-kvbench-kv-transfer-ms": "server_kv_transfer_ns",
    b"x-kvbench-first-decode-ms": "server_first_decode_ns",
}


class DeadlineExceeded(gevent.Timeout):
    """The whole-request deadline (connect, prefill and the full stream) ran out."""


class _Stale(Exception):
    """A keep-alive connection taken from the pool was closed by the server before it sent a
    byte of the response (servers close idle ones: llama-server does): the request was not
    started, so it is sent again, once, on a fresh connection."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int
    base_path: str  # "" or "/prefix" (no trailing slash)

    @classmethod
    def parse(cls, url: str) -> "Target":
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        port = u.port or (443 if u.scheme == "https" else 80)
        return cls(u.scheme, u.hostname, port, u.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


class Connection:
    """One keep-alive connection. On plain TCP, reads bypass gevent's socket layer: ``raw`` is
    the non-blocking kernel socket under the gevent one, ``rwatch`` a libev read watcher made
    once and started for each response, so a read is one hub switch and one ``recv``: no failed
    ``recv`` (EAGAIN exception), no Waiter or watcher start/stop, no timer per wait (the read
    timeout is ``_IdleTimer``)."""

    __slots__ = ("sock", "pooled", "raw", "rwatch", "hub")

    def __init__(self, sock) -> None:
        self.sock = sock
        self.pooled = False  # True once it has waited in the pool (the server may close it)
        raw = getattr(sock, "_sock", None)  # gevent keeps the kernel socket here (non-blocking)
        if isinstance(raw, _socket.socket) and raw.gettimeout() == 0.0:
            self.hub = get_hub()
            self.raw = raw
            self.rwatch = self.hub.loop.io(raw.fileno(), 1)  # 1: EV_READ
        else:  # TLS or a foreign socket: gevent's own recv
            self.hub = self.raw = self.rwatch = None

    def close(self) -> None:
        if self.rwatch is not None:
            self.rwatch.close()
            self.rwatch = self.raw = None
        try:
            self.sock.close()
        except OSError:
            pass


class _IdleTimer:
    """The socket read timeout (no bytes for ``timeout_s``) with one libev timer a request:
    when it fires it re-arms for the time left since ``last_ns`` (the latest read, which the
    reader stores) or throws ``socket.timeout`` into the reading greenlet."""

    __slots__ = ("loop", "glet", "timeout_ns", "last_ns", "timer")

    def __init__(self, loop, timeout_s: float, now_ns: int) -> None:
        self.loop = loop
        self.glet = gevent.getcurrent()
        self.timeout_ns = int(timeout_s * 1e9)
        self.last_ns = now_ns
        self.timer = loop.timer(timeout_s)
        self.timer.start(self._fire)

    def _fire(self) -> None:
        left_ns = self.last_ns + self.timeout_ns - _mono()
        self.timer.close()
        if left_ns > 0:
            self.timer = self.loop.timer(left_ns / 1e9)
            self.timer.start(self._fire)
        else:
            self.glet.throw(socket.timeout("timed out"))

    def close(self) -> None:
        self.timer.close()


_ADDRS: dict[tuple[str, int], tuple[float, list, list]] = {}  # (host, port) -> resolution
ADDR_TTL_S = 30.0  # how long a resolution is reused (DNS changes are seen after this)


def resolve(host: str, port: int) -> tuple:
    """One address of ``host``, from a resolution shared by every pool of the process and
    renewed after ``ADDR_TTL_S``; successive calls rotate over the addresses (round-robin DNS
    spreads as before). gevent's resolver hands each lookup to a native thread: done per
    connection, hundreds of users opening theirs together held the loop for milliseconds."""
    now = time.monotonic()
    got = _ADDRS.get((host, port))
    if got is None or now - got[0] > ADDR_TTL_S:
        infos = gsocket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"no address for {host}")
        got = _ADDRS[(host, port)] = (now, infos, [0])
    infos, turn = got[1], got[2]
    info = infos[turn[0] % len(infos)]
    turn[0] += 1
    return info


def connect(host: str, port: int, timeout_s: float):
    """A gevent socket connected to ``host:port`` (an address from ``resolve``)."""
    family, kind, proto, _, addr = resolve(host, port)
    sock = gsocket.socket(family, kind, proto)
    try:
        sock.settimeout(timeout_s)
        sock.connect(addr)
    except BaseException:
        sock.close()
        raise
    return sock


class ConnectionPool:
    """Keep-alive connections to one target; ``acquire`` reports the setup time it paid."""

    def __init__(self, target: Target, *, connect_timeout_s: float = 30.0,
                 read_timeout_s: float = 600.0, verify_tls: bool = True,
                 cold: bool = False) -> None:
        self.target = target
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.cold = cold  # a fresh connection per request (charged to each request)
        self.idle: list[Connection] = []
        self._ssl = None
        if target.scheme == "https":
            from gevent import ssl as gssl

            self._ssl = gssl.create_default_context()
            if not verify_tls:
                self._ssl.check_hostname = False
                self._ssl.verify_mode = gssl.CERT_NONE

    def open(self) -> Connection:
        t = self.target
        sock = connect(t.host, t.port, self.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is not None:
            sock = self._ssl.wrap_socket(sock, server_hostname=t.host)
        sock.settimeout(self.read_timeout_s)
        return Connection(sock)

    def acquire(self) -> tuple[Connection, int]:
        if self.idle and not self.cold:
            return self.idle.pop(), 0
        t0 = _mono()
        conn = self.open()
        return conn, _mono() - t0

    def release(self, conn: Connection) -> None:
        if self.cold:
            conn.close()
        else:
            conn.pooled = True
            self.idle.append(conn)

    def warm(self, n: int) -> int:
        """Open up to ``n`` idle connections now, before measurement; returns how many. A
        failure is logged once per distinct error (the requests then fail and are recorded),
        never as a traceback per greenlet."""
        if self.cold:
            return 0
        jobs = [gevent.spawn(self._try_open) for _ in range(max(0, n - len(self.idle)))]
        gevent.joinall(jobs)
        ok = []
        for j in jobs:
            if isinstance(j.value, Connection):
                j.value.pooled = True
                ok.append(j.value)
            elif j.value is not None:
                _log_once(f"kvbench: cannot open a connection to {self.target.scheme}://"
                          f"{self.target.host_header}: {_os_error_text(j.value)}")
        self.idle.extend(ok)
        return len(ok)

    def _try_open(self) -> Connection | Exception:
        try:
            return self.open()
        except (OSError, ValueError) as exc:  # ValueError: TLS setup refused the target
            return exc

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


class ChunkedDecoder:
    """Incremental HTTP/1.1 chunked transfer decoding (RFC 9112 section 7.1)."""

    __slots__ = ("_buf", "_rem", "done")

    def __init__(self) -> None:
        self._buf = b""
        self._rem = 0  # >0: data bytes left; 0: want a size line; -1: want CRLF; -2: trailers
        self.done = False

    def feed(self, data: bytes) -> bytes:
        if self._rem == 0 and not self._buf:
            # Fast path: ``data`` is exactly one whole chunk (how a server writes each event).
            i = data.find(b"\r\n")
            if i > 0 and data[-2:] == b"\r\n" and b";" not in data[:i]:
                size = int(data[:i], 16)
                if size and len(data) == i + size + 4:
                    return data[i + 2:-2]
        buf = self._buf + data if self._buf else data
        out = []
        pos, n = 0, len(buf)
        rem = self._rem
        while pos < n:
            if rem > 0:
                take = rem if rem < n - pos else n - pos
                out.append(buf[pos:pos + take])
                pos += take
                rem -= take
                if rem == 0:
                    rem = -1
            elif rem == 0:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    if n - pos > MAX_CHUNK_LINE_BYTES:
                        raise ValueError("chunked encoding: a chunk-size line longer than "
                                         f"{MAX_CHUNK_LINE_BYTES} bytes")
                    break
                size = int(buf[pos:i].split(b";", 1)[0], 16)
                pos = i + 2
                rem = size if size else -2
            elif rem == -1:
                if n - pos < 2:
                    break
                pos += 2
                rem = 0
            else:  # trailer lines, then the empty line that ends the message
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    if n - pos > MAX_HEADER_BYTES:
                        raise ValueError("chunked encoding: a trailer line longer than "
                                         f"{MAX_HEADER_BYTES} bytes")
                    break
                empty = i == pos
                pos = i + 2
                if empty:
                    self.done = True
                    break
        self._rem = rem
        self._buf = buf[pos:]
        return out[0] if len(out) == 1 else b"".join(out)


def _header_block(head: bytes) -> tuple[int, dict[bytes, bytes]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP response: {lines[0][:60]!r}")
    status = int(parts[1])
    headers = {}
    for ln in lines[1:]:
        name, _, value = ln.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if parts[0] == b"HTTP/1.0" and headers.get(b"connection", b"").lower() != b"keep-alive":
        headers[b"connection"] = b"close"
    return status, headers


class StreamingClient:
    """Sends one streaming request at a time per call; share it between greenlets freely."""

    def __init__(self, pool: ConnectionPool, *, headers: dict[str, str] | None = None,
                 deadline_s: float = 600.0, tokenizer=None,
                 max_header_bytes: int = MAX_HEADER_BYTES,
                 max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.pool = pool
        self.deadline_s = deadline_s
        self.max_header_bytes = max_header_bytes
        self.max_line_bytes = max_line_bytes  # one SSE line or event
        self.tokenizer = tokenizer  # estimates tokens of multi-token chunks (None: built-in)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head_tail = (f"Host: {pool.target.host_header}\r\n"
                           "Content-Type: application/json\r\n"
                           "Accept: text/event-stream\r\n"
                           "Accept-Encoding: identity\r\n"
                           "User-Agent: kvbench-loadgen\r\n" + extra)

    def post_stream(self, path: str, body: bytes, *, keep_text: bool = False,
                    headers: dict[str, str] | None = None, res: Result | None = None,
                    request_id: str | None = None, max_tokens: int | None = None,
                    stream: bool = True) -> Result:
        """POST ``body`` to ``path`` and read the SSE response to its end (or failure);
        a stream longer than ``max_tokens`` allows (``openai.stream_caps``) is cut as a
        ``protocol_error``. ``stream=False``: the body asked for one JSON answer, read whole
        (no chunks, no TTFT: ``e2e_ns`` is its last byte), held to the same byte cap.

        Never raises for request failures (they become the result's status); re-raises
        ``GreenletExit`` after marking ``res`` (pass your own) cancelled so the caller can
        still record it.
        """
        res = Result() if res is None else res
        res.streamed = stream
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        # so records join the server's logs (vLLM uses it as its own id); an id that cannot
        # be a header value (from a trace file: control characters, non-ASCII) is not sent
        if request_id is not None and request_id.isascii() and request_id.isprintable():
            extra += f"X-Request-Id: {request_id}\r\n"
        head = (f"POST {self.pool.target.base_path}{path} HTTP/1.1\r\n{self._head_tail}{extra}"
                f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
        payload = head + body
        caps = stream_caps(max_tokens)
        timer = DeadlineExceeded.start_new(self.deadline_s)
        conn = None
        try:
            conn, res.connect_ns = self.pool.acquire()
            try:
                conn = self._exchange(conn, payload, res, keep_text, caps)
            except _Stale:
                # The server closed the pooled connection before answering; ``t_sent`` becomes
                # the resend's and ``connect_ns`` adds the new connection's setup.
                conn = _drop(conn)
                res.t_sent_ns = res.t_sent_mono_ns = 0
                res.resent = True
                t0 = _mono()
                conn = self.pool.open()
                res.connect_ns += _mono() - t0
                conn = self._exchange(conn, payload, res, keep_text, caps)
        except DeadlineExceeded as exc:
            if exc is not timer:
                raise
            res.status, res.error = "timeout", _timeout_text(res, self.deadline_s, True)
            conn = _drop(conn)
        except (socket.timeout, TimeoutError):
            res.status = "timeout"
            res.error = _timeout_text(res, self.pool.connect_timeout_s if res.t_sent_ns == 0
                                      else self.pool.read_timeout_s, False)
            conn = _drop(conn)
        except (OSError, EOFError) as exc:
            res.status = "disconnected"
            res.error = _os_error_text(exc)[:200]
            conn = _drop(conn)
        except ValueError as exc:  # a malformed HTTP response
            res.status, res.error = "protocol_error", str(exc)[:200]
            conn = _drop(conn)
        except BaseException:  # GreenletExit and friends: the caller records "cancelled"
            res.status, res.error = "cancelled", "stopped before the response ended"
            _drop(conn)
            _partial(res)
            raise
        finally:
            timer.close()
        _partial(res)
        if conn is not None:
            self.pool.release(conn)
        return res

    def _exchange(self, conn: Connection, payload: bytes, res: Result, keep_text: bool,
                  caps: tuple[int, int, str]) -> Connection | None:
        """One request/response on ``conn``; returns the connection if it can be reused."""
        sock = conn.sock
        reused = conn.pooled
        res.t_sent_ns = _epoch()
        t0 = res.t_sent_mono_ns = _mono()
        try:
            sock.sendall(payload)
        except OSError:
            if reused:
                raise _Stale() from None
            raise
        rwatch = conn.rwatch
        if rwatch is None:  # TLS: gevent's recv (a timer per wait is its read timeout)
            return self._read(conn, res, keep_text, t0, reused, sock.recv, None, None, caps)
        # The watcher stays started for the whole response and resumes this greenlet when the
        # socket is readable; the loop below yields only through ``wait`` (the hub), so no
        # other wakeup can reach it. Cheaper than a Waiter and a watcher start/stop a read.
        rwatch.start(gevent.getcurrent().switch)
        idle = _IdleTimer(conn.hub.loop, self.pool.read_timeout_s, t0)
        try:
            return self._read(conn, res, keep_text, t0, reused, conn.raw.recv, conn.hub.switch,
                              idle, caps)
        finally:
            rwatch.stop()
            idle.close()

    def _read(self, conn, res, keep_text, t0, reused, recv, wait, idle, caps):  # noqa: C901
        """Reads and accounts for the response; ``wait`` (None for TLS) yields until the raw
        socket is readable, ``recv`` then never blocks."""
        buf = b""
        got = False  # any byte of a response yet (a stale connection sends none)
        limit = self.max_header_bytes
        while True:  # status line and headers
            try:
                if wait is not None:
                    wait()
                data = recv(RECV_BYTES)
            except BlockingIOError:  # a spurious wakeup
                continue
            except TimeoutError:
                raise
            except OSError:  # reset by the peer (or, for TLS, an EOF in the TLS layer)
                if reused and not got:
                    raise _Stale() from None
                raise
            t = _mono()
            if idle is not None:
                idle.last_ns = t
            if not data:
                if reused and not got:
                    raise _Stale()
                raise EOFError("connection closed before the response headers")
            got = True
            scan = max(0, len(buf) - 3)  # only the new bytes (and 3 before) can end the block
            buf += data
            i = buf.find(b"\r\n\r\n", scan)
            while 0 <= i <= limit:
                status, headers = _header_block(buf[:i])
                buf = buf[i + 4:]
                if not 100 <= status < 200:
                    break
                i = buf.find(b"\r\n\r\n")  # an interim response; the real one follows
            else:
                if len(buf) > limit:
                    raise ValueError(f"the response headers exceeded {limit:,} bytes without "
                                     "ending (the client's limit, max_header_bytes)")
                continue
            break
        rest = buf
        res.http_status = status
        for name, col in SERVER_MS_HEADERS.items():
            v = headers.get(name)
            if v is not None:
                try:
                    setattr(res, col, int(float(v) * 1e6))
                except ValueError:
                    pass
        if b"x-kvbench-replica" in headers:
            res.server_replica = headers[b"x-kvbench-replica"].decode("latin-1")
        if b"x-kvbench-region" in headers:
            res.server_region = headers[b"x-kvbench-region"].decode("latin-1")
        if b"x-request-id" in headers:
            res.server_request_id = headers[b"x-request-id"][:256].decode("latin-1")
        if b"retry-after" in headers:
            res.retry_after_s = retry_after_s(headers[b"retry-after"])

        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        length = None if chunked else headers.get(b"content-length")
        left = int(length) if length is not None else -1  # -1: body ends at close
        keep = headers.get(b"connection", b"").lower() != b"close" and (chunked or left >= 0)
        dechunk = ChunkedDecoder() if chunked else None
        ctype = headers.get(b"content-type", b"").lower()
        streaming = status == 200 and b"text/event-stream" in ctype
        answer = not res.streamed and status == 200 and not streaming  # one JSON body
        if streaming:
            res.streamed = True  # a server may stream what was asked without
        parser = SSEParser(self.max_line_bytes)
        state = StreamState(t0, keep_text, self.tokenizer, caps)
        res.offsets_ns, res.tokens = state.offsets_ns, state.tokens  # kept if it fails midway
        errbody = []
        complete = False
        data = rest
        got_bytes, streak = 0, 0  # body bytes so far; when the current run of full reads began
        while True:
            if data:
                if dechunk is not None:
                    body = dechunk.feed(data)
                    complete = dechunk.done
                elif left >= 0:
                    body = data[:left]
                    left -= len(body)
                    complete = left == 0
                else:
                    body = data
                if body:
                    got_bytes += len(body)
                    if streaming:
                        evs = parser.feed(body)
                        if evs:
                            state.on_events(evs, t)
                        if state.cut or got_bytes > caps[1]:
                            state.cut_at(got_bytes)  # the rest is not read: the link is dropped
                            complete = keep = False
                            break
                    elif answer:
                        if got_bytes > caps[1]:
                            res.status, res.error = "protocol_error", f"the answer exceeded " \
                                f"{caps[1]:,} bytes (the client's cut for {caps[2]})"
                            complete = keep = False
                            break
                        errbody.append(body)
                    elif got_bytes - len(body) < ERROR_BODY_BYTES:
                        errbody.append(body)
                    else:  # a non-stream body past what its message needs: not read further
                        complete = keep = False
                        break
            elif left == 0 and dechunk is None:
                complete = True
            if complete:
                break
            if wait is not None and len(data) < RECV_BYTES:  # drained: sleep until readable
                streak = 0
                wait()
            elif not streak:  # (TLS reads return a record at most: timed from every read)
                streak = t
            elif t - streak > YIELD_NS:  # a server sending without pause: let the hub run
                streak = 0
                (wait or gevent.sleep)()
            if wait is not None:
                try:
                    data = recv(RECV_BYTES)
                except BlockingIOError:  # a spurious wakeup
                    data = _recv_when_readable(recv, wait)
                t = idle.last_ns = _mono()
            else:
                data = recv(RECV_BYTES)
                t = _mono()
            if not data:
                complete = left < 0 and dechunk is None  # read-until-close body
                keep = False
                break
        res.e2e_ns = t - t0
        if streaming:
            tail = parser.finish()
            if tail:
                state.on_events(tail, t)
            res.status, res.error = state.settle(complete)
            res.offsets_ns = state.offsets_ns
            res.tokens = state.tokens
            if state.offsets_ns:
                res.ttft_ns = state.offsets_ns[0]
            res.prompt_tokens = state.prompt_tokens
            res.completion_tokens_client = state.completion_tokens_client
            res.completion_tokens = (state.completion_tokens if state.completion_tokens
                                     is not None else len(state.tokens))
            res.cached_tokens = state.cached_tokens
            if keep_text:
                res.text = state.text
        elif answer:
            if res.error is None:  # (not cut at the byte cap)
                settle_answer(res, b"".join(errbody) if complete else None, keep_text,
                              self.tokenizer)
        elif status != 200:
            res.status = "http_error"
            res.error = f"HTTP {status}: {error_message(b''.join(errbody))}"[:300]
        else:
            res.status = "protocol_error"
            res.error = (f"answered {ctype.decode('latin-1') or 'without a content type'} "
                         "instead of an event stream")
        if not (keep and complete):
            conn.close()
            return None
        return conn


def retry_after_s(value: bytes, now_s: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait: delay-seconds or an HTTP-date (RFC 9110
    section 10.2.3); a date in the past is 0; None when it is neither."""
    text = value.decode("latin-1").strip()
    try:
        secs = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None or when.tzinfo is None:
            return None
        secs = when.timestamp() - (time.time() if now_s is None else now_s)
    if secs != secs or secs in (float("inf"), float("-inf")):
        return None
    return max(0.0, secs)


def _timeout_text(res: Result, limit_s: float, deadline: bool) -> str:
    """One text per kind of silence, whichever timer noticed it: the read timeout and the
    request deadline are often equal, and a stall must read the same either way."""
    if res.t_sent_ns == 0:
        return f"no connection within {limit_s:g} s"
    if res.http_status is None:
        return f"no response within {limit_s:g} s of the send"
    if deadline:
        return f"the response did not end within {limit_s:g} s (the request deadline)"
    return f"the response stopped: no bytes for {limit_s:g} s (the read timeout)"


def _os_error_text(exc: BaseException) -> str:
    """``ConnectionRefusedError: [Errno 111] Connection refused`` (no gevent internals)."""
    return f"{type(exc).__name__}: {exc}"


_LOGGED: set[str] = set()


def _log_once(line: str) -> None:
    """Log ``line`` the first time this process sees it (many users fail alike)."""
    if line not in _LOGGED:
        _LOGGED.add(line)
        log.warning(line)


def _recv_when_readable(recv, wait) -> bytes:
    while True:
        wait()
        try:
            return recv(RECV_BYTES)
        except BlockingIOError:
            continue


def _partial(res: Result) -> None:
    if res.ttft_ns is None and res.offsets_ns:
        res.ttft_ns = res.offsets_ns[0]
        res.completion_tokens_client = len(res.tokens)


def _drop(conn: Connection | None) -> None:
    if conn is not None:
        conn.close()
    return None
