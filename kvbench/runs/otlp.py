"""A local OTLP/HTTP trace receiver for the duration of a run: engines that export per-request
spans (vLLM with ``--otlp-traces-endpoint http://HOST:PORT/v1/traces`` and
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``) post them here; each span carrying a
request id and latency attributes becomes a row of the run's ``spans`` table, which the report
joins to the records by request id (``reports.server_traces``).

Decoding is the OpenTelemetry project's own protobuf bindings (``opentelemetry-proto``). The
attribute names are vLLM's (``vllm/tracing.py`` SpanAttributes), in seconds."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
import zlib

import pyarrow as pa

from kvbench.core.errors import DiskFull
from kvbench.core.schema import SPANS
from kvbench.core.store import ShardWriter, compact

TRACES_PATH = "/v1/traces"
MAX_BODY_BYTES = 64 * 1024 * 1024  # one export batch; exporters send a few MB at most
# span attribute -> spans column, seconds converted to ns (vLLM's names)
LATENCIES = {"gen_ai.latency.time_in_queue": "queue_ns",
             "gen_ai.latency.time_in_model_prefill": "prefill_ns",
             "gen_ai.latency.time_in_model_decode": "decode_ns",
             "gen_ai.latency.time_to_first_token": "ttft_ns",
             "gen_ai.latency.e2e": "e2e_ns"}
TOKENS = {"gen_ai.usage.prompt_tokens": "prompt_tokens",
          "gen_ai.usage.completion_tokens": "completion_tokens"}
REQUEST_ID = "gen_ai.request.id"


def _value(v):
    """An OTLP AnyValue's scalar (None for lists, maps and bytes)."""
    kind = v.WhichOneof("value")
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(v, kind)
    return None


def rows_of(body: bytes) -> list[dict]:
    """The request spans of one ExportTraceServiceRequest (protobuf bytes); raises ValueError
    on bytes that are not one."""
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as exc:
        raise ValueError(f"not an OTLP ExportTraceServiceRequest ({exc})") from None
    out = []
    for rs in req.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes
                        if a.key == "service.name"), None)
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = {a.key: _value(a.value) for a in span.attributes}
                if attrs.get(REQUEST_ID) is None:
                    continue
                row = {"t_ns": int(span.start_time_unix_nano) or None,
                       "service": None if service is None else str(service),
                       "span_name": span.name, "trace_request_id": str(attrs[REQUEST_ID])}
                for key, col in LATENCIES.items():
                    v = attrs.get(key)
                    row[col] = round(float(v) * 1e9) if isinstance(v, (int, float)) else None
                for key, col in TOKENS.items():
                    v = attrs.get(key)
                    row[col] = int(v) if isinstance(v, (int, float)) else None
                out.append(row)
    return out


class OtlpReceiver:
    """``start()`` listens on ``host:port`` (0: a free port) and writes spans to ``run_dir``
    as they come; ``stop()`` closes, compacts the table and returns what it saw."""

    def __init__(self, run_dir, host: str = "127.0.0.1", port: int = 4318):
        self.run_dir = run_dir
        self.host, self.port = host, port
        self.spans = 0
        self.exports = 0
        self.rejected: list[str] = []
        self.last_export = 0.0  # time.monotonic() of the last export received
        self._lock = threading.Lock()
        self._writer: ShardWriter | None = None
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    def start(self) -> "OtlpReceiver":
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                receiver._post(self)

            def log_message(self, *args):
                pass

        self._writer = ShardWriter(self.run_dir, "spans", tag="otlp")
        self._server = http.server.ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="kvbench-otlp",
                         daemon=True).start()
        return self

    def _post(self, h: http.server.BaseHTTPRequestHandler) -> None:
        if h.path.split("?", 1)[0] != TRACES_PATH:
            return self._answer(h, 404, f"only {TRACES_PATH} is served here")
        ctype = (h.headers.get("Content-Type") or "").split(";", 1)[0].strip()
        if ctype != "application/x-protobuf":
            return self._answer(h, 415, "send OTLP/HTTP protobuf (application/x-protobuf); "
                                        "set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf")
        n = int(h.headers.get("Content-Length") or 0)
        if n > MAX_BODY_BYTES:
            return self._answer(h, 413, "export batch too large")
        body = h.rfile.read(n)
        try:
            enc = (h.headers.get("Content-Encoding") or "").lower()
            if enc == "gzip":
                body = gzip.decompress(body)
            elif enc == "deflate":
                body = zlib.decompress(body)
            rows = rows_of(body)
        except (ValueError, OSError, zlib.error, EOFError) as exc:
            with self._lock:
                self.rejected.append(str(exc)[:200])
            return self._answer(h, 400, str(exc)[:200])
        with self._lock:
            self.exports += 1
            self.last_export = time.monotonic()
            if rows:
                try:
                    self._writer.write(pa.RecordBatch.from_pylist(rows, schema=SPANS))
                except DiskFull as exc:  # noted for the run (it stops its load and says so)
                    return self._answer(h, 507, str(exc)[:200])
                self.spans += len(rows)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        self._answer(h, 200, ExportTraceServiceResponse().SerializeToString(), proto=True)

    @staticmethod
    def _answer(h, status: int, body, proto: bool = False) -> None:
        data = body if isinstance(body, bytes) else body.encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/x-protobuf" if proto else "text/plain")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def drain(self, quiet_s: float = 8.0, max_s: float = 20.0) -> None:
        """Wait until no export came for ``quiet_s`` (exporters batch spans for a few seconds:
        the OpenTelemetry SDK's BatchSpanProcessor every 5 s, later on a busy host), at most
        ``max_s``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < max_s:
            with self._lock:
                last = max(self.last_export, t0)
            if time.monotonic() - last >= quiet_s:
                return
            time.sleep(0.2)

    def stop(self) -> dict:
        """Close the listener and the shard, fold it into ``spans.parquet``; returns
        {spans, exports, rejected}."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        if self.spans:
            compact(self.run_dir, "spans")
        return {"spans": self.spans, "exports": self.exports, "rejected": list(self.rejected)}
