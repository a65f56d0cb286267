"""The remote collector agent (``kvbench collect --listen``) and the puller the run uses.

The agent samples its host's GPUs with NVML into memory and serves them over HTTP:

* ``GET /clock``: ``{"t_ns": <agent epoch ns>, "host": ...}`` for clock-offset estimation;
* ``GET /status``: NVML status, rows held, rows dropped;
* ``GET /samples?after=<seq>[&format=arrow|parquet]``: ``kvbench.schema.GPU`` rows of every
  batch after sequence number ``seq`` (Arrow IPC stream by default), with the last sequence
  number in the ``X-Kvbench-Seq`` header.

When a token is set every request needs ``Authorization: Bearer <token>``; binding anything
other than a loopback address without a token is refused, and so is a weak token. Idle and
trickling connections are closed after a bound, and an aborted one is one log line
(collectors/agent_conn.py).
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import uuid
import urllib.parse
import urllib.request
from collections import deque
from http.server import ThreadingHTTPServer
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from kvbench.collectors.agent_conn import GuardedHandler, Limits, check_token, guarded_server
from kvbench.collectors.nvml import NvmlSampler
from kvbench.collectors.prometheus import read_bounded
from kvbench.collectors.roles import role_for
from kvbench.core.contract import Incomplete
from kvbench.core.errors import UserError
from kvbench.core.schema import GPU

ARROW_STREAM = "application/vnd.apache.arrow.stream"
DEFAULT_TOKEN_ENV = "KVBENCH_AGENT_TOKEN"
# One pull from an agent, whole: at most this many bytes (an hour of 8 GPUs sampled at 10 Hz
# is about 30 MB of rows), read within this many read timeouts, so an agent (or something else
# at its address) that sends without end is cut instead of filling the puller's memory
PULL_MAX_BYTES = 256 << 20
PULL_DEADLINES = 4


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class SampleBuffer:
    """Batches in arrival order, each with a sequence number; the oldest are dropped past
    ``max_rows`` (counted in ``dropped_rows``)."""

    def __init__(self, max_rows: int = 1_000_000):
        self.max_rows = max_rows
        self._batches: deque[tuple[int, pa.RecordBatch]] = deque()
        self._lock = threading.Lock()
        self.seq = 0
        self.rows = 0
        self.dropped_rows = 0

    def append(self, batch: pa.RecordBatch) -> None:
        with self._lock:
            self.seq += 1
            self._batches.append((self.seq, batch))
            self.rows += batch.num_rows
            while self.rows > self.max_rows and len(self._batches) > 1:
                _, old = self._batches.popleft()
                self.rows -= old.num_rows
                self.dropped_rows += old.num_rows

    def after(self, seq: int) -> tuple[list[pa.RecordBatch], int]:
        with self._lock:
            return [b for s, b in self._batches if s > seq], self.seq


class AgentServer:
    """NVML sampler + HTTP server in daemon threads. ``start()`` binds (port 0: any free port).

    ``token``: None for none (loopback only); a string is checked (``check_token``) and refused
    when weak, blank included. ``token_env`` only names the variable in that refusal."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 interval_s: float = 0.1, nvml=None, max_rows: int = 1_000_000,
                 log: Callable[[str], None] | None = None,
                 clock_ns: Callable[[], int] = time.time_ns,
                 token_env: str = DEFAULT_TOKEN_ENV, idle_timeout_s: float | None = None,
                 request_timeout_s: float | None = None, send_timeout_s: float | None = None):
        check_token(token, host=host, token_env=token_env)
        if token is None and not is_loopback(host):
            raise UserError(f"kvbench collect: refusing to listen on {host} without a token; "
                            f"set one in ${token_env} (or the variable named by "
                            "--token-env), or listen on 127.0.0.1")
        given = {"idle_timeout_s": idle_timeout_s, "request_timeout_s": request_timeout_s,
                 "send_timeout_s": send_timeout_s}
        self.limits = Limits(**{k: v for k, v in given.items() if v is not None})
        self.bind_host, self.port = host, port
        self.token = token
        self.clock_ns = clock_ns
        self.hostname = socket.gethostname()
        self.instance = uuid.uuid4().hex  # changes on restart, so pullers restart their seq
        self.buffer = SampleBuffer(max_rows)
        log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.log = log
        self.sampler = NvmlSampler(self.buffer.append, interval_s=interval_s, nvml=nvml,
                                   host=self.hostname, flush_every_s=0.5, log=log,
                                   clock_ns=clock_ns)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.bind_host if ":" not in self.bind_host else f"[{self.bind_host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> "AgentServer":
        self.sampler.start()
        server_cls = guarded_server(":" in self.bind_host, self.log)
        try:
            self._httpd = server_cls((self.bind_host, self.port), self._handler())
        except OSError as exc:
            self.sampler.stop()
            raise UserError(f"kvbench collect: cannot listen on {self.bind_host}:{self.port} "
                            f"({exc.strerror or exc}); choose another address or port") from None
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvbench-agent",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        self.sampler.stop()

    def _handler(self):
        agent = self

        class Handler(GuardedHandler):
            limits = agent.limits
            log = staticmethod(agent.log)

            def _send(self, code: int, body: bytes, ctype: str, headers: dict | None = None):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _json(self, code: int, obj: dict):
                self._send(code, json.dumps(obj).encode(), "application/json")

            def do_GET(self):  # noqa: N802 (http.server's name)
                if agent.token is not None:
                    got = self.headers.get("Authorization", "")
                    if not hmac.compare_digest(got.encode(), f"Bearer {agent.token}".encode()):
                        return self._json(401, {"error": "missing or wrong bearer token"})
                url = urllib.parse.urlsplit(self.path)
                q = urllib.parse.parse_qs(url.query)
                if url.path == "/clock":
                    return self._json(200, {"t_ns": agent.clock_ns(), "host": agent.hostname})
                if url.path == "/status":
                    s = agent.sampler
                    return self._json(200, {
                        "host": agent.hostname, "nvml": s.status, "gpus": len(s.devices),
                        "rows": agent.buffer.rows, "dropped_rows": agent.buffer.dropped_rows,
                        "seq": agent.buffer.seq, "errors": s.errors,
                        "unsupported": {str(k): v for k, v in s.unsupported.items()}})
                if url.path == "/samples":
                    try:
                        after = int(q.get("after", ["0"])[0])
                    except ValueError:
                        return self._json(400, {"error": "after must be an integer"})
                    fmt = q.get("format", ["arrow"])[0]
                    if fmt not in ("arrow", "parquet"):
                        return self._json(400, {"error": "format must be arrow or parquet"})
                    batches, seq = agent.buffer.after(after)
                    sink = io.BytesIO()
                    if fmt == "parquet":
                        pq.write_table(pa.Table.from_batches(batches, schema=GPU), sink)
                        ctype = "application/vnd.apache.parquet"
                    else:
                        with ipc.new_stream(sink, GPU) as w:
                            for b in batches:
                                w.write_batch(b)
                        ctype = ARROW_STREAM
                    return self._send(200, sink.getvalue(), ctype, {
                        "X-Kvbench-Seq": str(seq), "X-Kvbench-Host": agent.hostname,
                        "X-Kvbench-Agent": agent.instance})
                return self._json(404, {"error": "no such path; use /clock, /status, /samples"})

        return Handler


def serve_forever(agent: AgentServer, stop: threading.Event) -> None:
    """Runs ``agent`` until ``stop`` is set (the CLI sets it on SIGINT/SIGTERM)."""
    agent.start()
    try:
        stop.wait()
    finally:
        agent.stop()


class AgentPuller:
    """Pulls one agent's samples every ``interval_s`` (and once more on ``stop()``), shifting
    their timestamps by the clock offset estimated from ``/clock`` round trips.

    Offset (NTP-style, from the round trip with the smallest RTT): the agent's clock read at
    ``t_agent`` between local sends at ``t0`` and receipt at ``t1`` gives
    ``offset_add_ns = (t0 + t1) / 2 - t_agent``, the value to add to the agent's timestamps
    (``run.json`` ``clock_offsets_ns`` keeps it under the agent's host name).
    """

    PROBES = 8

    def __init__(self, url: str, *, emit: Callable[[pa.RecordBatch], None], token: str | None = None,
                 interval_s: float = 2.0, roles=(), timeout_s: float = 3.0,
                 log: Callable[[str], None] | None = None):
        self.url = url.rstrip("/")
        self.emit = emit
        self.token = token
        self.interval_s = interval_s
        self.roles = list(roles)
        self.timeout_s = timeout_s
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.host: str | None = None
        self.offset_add_ns: int | None = None
        self.rtt_ns: int | None = None
        self.seq = 0
        self.pulls = 0
        self.failures = 0
        self.rows = 0
        self.last_error: str | None = None
        self.restarts = 0
        self.instance: str | None = None
        self.agent_status: dict | None = None
        self.since_ns = time.time_ns()  # local epoch ns: rows sampled before are not wanted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one pull at a time (loop vs final pull)

    def _get(self, path: str):
        """(body, headers) of one GET; headers look up case-insensitively."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        req = urllib.request.Request(self.url + path, headers=headers)
        deadline = time.monotonic() + PULL_DEADLINES * self.timeout_s
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return read_bounded(resp, self.url + path, PULL_MAX_BYTES, deadline), resp.headers

    def _fail(self, exc: BaseException) -> None:
        self.failures += 1
        if isinstance(exc, urllib.error.HTTPError):
            self.last_error = f"HTTP {exc.code} {exc.reason}"
        else:
            self.last_error = f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}"
        self.last_error = self.last_error[:200]
        if self.failures == 1:
            self.log(f"kvbench: collector agent {self.url} failed: {self.last_error}; "
                     "will keep trying")

    def estimate_offset(self, probes: int = PROBES) -> bool:
        best = None
        for _ in range(probes):
            t0 = time.time_ns()
            body, _ = self._get("/clock")
            t1 = time.time_ns()
            clock = json.loads(body)
            rtt = t1 - t0
            if best is None or rtt < best[0]:
                best = (rtt, (t0 + t1) // 2 - int(clock["t_ns"]), clock.get("host"))
        self.rtt_ns, self.offset_add_ns, self.host = best
        return True

    def start(self) -> "AgentPuller":
        self._thread = threading.Thread(target=self._run, name="kvbench-agent-pull", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.pull_once():
            try:
                self.agent_status = json.loads(self._get("/status")[0])
            except (OSError, ValueError) as exc:
                self._fail(exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.pull_once()
            self._stop.wait(self.interval_s)

    def pull_once(self) -> bool:
        with self._lock:
            self.pulls += 1
            try:
                if self.offset_add_ns is None:
                    self.estimate_offset()
                    body, _ = self._get("/status")
                    self.agent_status = json.loads(body)
                    # skip the agent's history before this run (rows are also cut at since_ns)
                    self.seq = max(0, int(self.agent_status.get("seq", 1)) - 1)
                body, headers = self._get(f"/samples?after={self.seq}")
                table = ipc.open_stream(pa.py_buffer(body)).read_all()
            except (OSError, ValueError, KeyError, pa.ArrowInvalid) as exc:
                self._fail(exc)
                return False
            seq = int(headers.get("X-Kvbench-Seq", self.seq))
            instance = headers.get("X-Kvbench-Agent")
            if self.instance is None:
                self.instance = instance
            elif instance != self.instance:  # the agent restarted: its numbering began again
                self.instance = instance
                self.restarts += 1
                self.seq = 0
                return True
            if table.num_rows:
                table = self._align(table.cast(GPU))
                table = table.filter(pc.greater_equal(table.column("t_ns"),
                                                      pa.scalar(self.since_ns, pa.int64())))
                for b in table.to_batches():
                    self.emit(b)
                self.rows += table.num_rows
            self.seq = seq
            return True

    def _align(self, table: pa.Table) -> pa.Table:
        t = pc.add(table.column("t_ns"), pa.scalar(self.offset_add_ns, pa.int64()))
        table = table.set_column(table.schema.get_field_index("t_ns"), "t_ns", t)
        if self.roles:
            roles = [r if r not in (None, "unknown") else role_for(self.roles, h, g)
                     for r, h, g in zip(table.column("role").to_pylist(),
                                        table.column("host").to_pylist(),
                                        table.column("gpu").to_pylist())]
            table = table.set_column(table.schema.get_field_index("role"), "role",
                                     pa.array(roles, pa.string()))
        return table

    def telemetry(self) -> dict[str, str]:
        key = f"agent:{self.url}"
        if self.pulls - self.failures <= 0:
            return {key: f"no successful pull from {self.url} ({self.last_error or 'never pulled'})"}
        nvml = (self.agent_status or {}).get("nvml", "ok")
        return {key: "ok" if nvml == "ok" else f"agent reachable, but its NVML is off: {nvml}"}

    def incomplete(self) -> list[Incomplete]:
        out = []
        if self.failures:
            out.append(Incomplete(f"pulls from collector agent {self.url}",
                                  f"{self.failures} of {self.pulls} pulls failed; last: "
                                  f"{self.last_error}"))
        if self.restarts:
            out.append(Incomplete(f"collector agent {self.url}",
                                  f"restarted {self.restarts} time(s) during the run; samples "
                                  "it took before each restart and not yet pulled are lost"))
        dropped = (self.agent_status or {}).get("dropped_rows", 0)
        if dropped:
            out.append(Incomplete(f"samples on collector agent {self.url}",
                                  f"{dropped} oldest rows dropped at the agent's memory cap"))
        return out


def token_from_env(var: str | None) -> str | None:
    return os.environ.get(var) or None if var else None
