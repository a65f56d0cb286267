"""The OpenAI-compatible aiohttp server in front of a ``Cluster``.

Streams are paced by the engines: each step's tokens are written as one SSE event per token
(several events share a write when a stream lags). Headers go out with the first token and
carry the server's timing. Bad requests get OpenAI-style error JSON; faults are injected only
when configured or asked for with ``x-kvbench-fault``.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from dataclasses import dataclass

import orjson
from aiohttp import web

from kvbench.endpoints.cluster import Cluster
from kvbench.endpoints.config import EmulatorConfig
from kvbench.endpoints.engine import Seq
from kvbench.endpoints.kvcache import block_hashes
from kvbench.endpoints.metrics import render
from kvbench.endpoints.router import RoutingError
from kvbench.workloads.tokenizer import get_tokenizer

JSON = "application/json"
CLUSTER_KEY = web.AppKey("cluster", Cluster)
STATE_KEY = web.AppKey("state", object)


class ApiError(Exception):
    def __init__(self, status: int, message: str, etype: str = "BadRequestError",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype
        self.param = param
        self.headers = headers or {}


def error_response(status: int, message: str, etype: str = "BadRequestError",
                   param: str | None = None, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type=JSON,
                        headers=headers)


@dataclass
class Faults:
    error: int | None = None
    rate_limit: bool = False
    stall_before_ms: float = 0.0
    stall_mid_ms: float = 0.0
    reset: bool = False
    malformed: bool = False
    slow_headers_ms: float = 0.0


def parse_fault_header(value: str, cfg: EmulatorConfig) -> Faults:
    """``x-kvbench-fault: error=503, stall_mid=500, reset, malformed, rate_limit,
    stall_before=ms, slow_headers=ms`` (comma-separated)."""
    f = Faults()
    fc = cfg.faults
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, arg = part.partition("=")
        name = name.strip().lower().replace("-", "_")
        arg = arg.strip()
        try:
            if name == "error":
                f.error = int(arg) if arg else fc.error_statuses[0]
                if not 400 <= f.error <= 599:
                    raise ValueError
            elif name in ("rate_limit", "429"):
                f.rate_limit = True
            elif name == "stall_before":
                f.stall_before_ms = float(arg) if arg else fc.stall_ms
            elif name == "stall_mid":
                f.stall_mid_ms = float(arg) if arg else fc.stall_ms
            elif name == "reset":
                f.reset = True
            elif name == "malformed":
                f.malformed = True
            elif name == "slow_headers":
                f.slow_headers_ms = float(arg) if arg else fc.slow_headers_ms
            else:
                raise KeyError
        except (ValueError, KeyError):
            raise ApiError(400, f"header x-kvbench-fault: cannot read {part!r}; use error=CODE, "
                                "rate_limit, stall_before=MS, stall_mid=MS, reset, malformed "
                                "or slow_headers=MS", param="x-kvbench-fault") from None
    return f


def draw_faults(rng: random.Random, cfg: EmulatorConfig) -> Faults:
    fc = cfg.faults
    f = Faults()
    if fc.error_rate and rng.random() < fc.error_rate:
        f.error = rng.choice(fc.error_statuses)
    if fc.rate_limit_rate and rng.random() < fc.rate_limit_rate:
        f.rate_limit = True
    if fc.stall_before_rate and rng.random() < fc.stall_before_rate:
        f.stall_before_ms = fc.stall_ms
    if fc.stall_mid_rate and rng.random() < fc.stall_mid_rate:
        f.stall_mid_ms = fc.stall_ms
    if fc.reset_rate and rng.random() < fc.reset_rate:
        f.reset = True
    if fc.malformed_rate and rng.random() < fc.malformed_rate:
        f.malformed = True
    if fc.slow_headers_rate and rng.random() < fc.slow_headers_rate:
        f.slow_headers_ms = fc.slow_headers_ms
    return f


class State:
    def __init__(self, cfg: EmulatorConfig):
        self.cfg = cfg
        self.res = cfg.resolved()
        self.tok = get_tokenizer("builtin")
        words = self.tok.single_token_words()
        self.word_bytes = [(" " + w).encode() for w in words]
        self.words = [" " + w for w in words]
        self.rng = random.Random(cfg.seed)
        self.counter = 0
        self.created = int(time.time())

    def next_id(self) -> str:
        self.counter += 1
        return f"{self.counter:x}{self.rng.getrandbits(32):08x}"


def _int_field(body: dict, name: str, default: int | None, lo: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ApiError(400, f"field {name} must be an integer >= {lo}, got {v!r}", param=name)
    return v


def _parse(body, chat: bool, st: State) -> tuple[str, int, bool, bool]:
    """(prompt text, max_tokens, stream, include_usage) or ApiError."""
    cfg = st.cfg
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != cfg.model_name:
        raise ApiError(404, f"The model `{model}` does not exist; use {cfg.model_name!r}",
                       "NotFoundError", "model")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "field n: only n = 1 is supported", param="n")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "field messages is required: a non-empty list of "
                                "{role, content} objects", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"field messages[{i}] needs a string role",
                               param="messages")
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise ApiError(400, f"field messages[{i}].content must be a string or a list "
                                    "of parts", param="messages")
        text = st.tok.render_chat(msgs)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _int_field({"max_tokens": mt}, "max_tokens", None, 1)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "field prompt is required and must be a string", param="prompt")
        text = prompt
        max_tokens = _int_field(body, "max_tokens", 16, 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "field stream must be true or false", param="stream")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise ApiError(400, "field stream_options must be an object", param="stream_options")
    include_usage = bool(so.get("include_usage", False))
    return text, max_tokens, stream, include_usage


def _timing_headers(seq: Seq, st: State) -> dict:
    t0 = seq.t_arrival
    ts = seq.t_scheduled or t0
    tp = seq.t_prefill_done or ts
    tt = seq.t_transfer_done or tp
    tf = seq.t_first or tt
    return {
        "x-kvbench-queue-ms": f"{(ts - t0) * 1e3:.3f}",
        "x-kvbench-prefill-ms": f"{(tp - ts) * 1e3:.3f}",
        "x-kvbench-kv-transfer-ms": f"{(tt - tp) * 1e3:.3f}",
        "x-kvbench-first-decode-ms": f"{(tf - tt) * 1e3:.3f}",
        "x-kvbench-network-ms": f"{seq.network_ms * st.cfg.time_scale:.3f}",
        "x-kvbench-cached-tokens": str(seq.cached_tokens),
        "x-kvbench-replica": seq.replica,
        "x-kvbench-region": seq.region,
        "x-kvbench-time-scale": repr(st.cfg.time_scale),
        "x-request-id": seq.rid,
    }


async def _wait(seq: Seq, cond) -> None:
    loop = asyncio.get_running_loop()
    while not cond():
        seq.waiter = loop.create_future()
        try:
            await seq.waiter
        finally:
            seq.waiter = None


def _usage(seq: Seq) -> dict:
    return {"prompt_tokens": seq.n_prompt, "total_tokens": seq.n_prompt + seq.generated,
            "completion_tokens": seq.generated,
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    st: State = request.app[STATE_KEY]
    cluster: Cluster = request.app[CLUSTER_KEY]
    cfg = st.cfg
    loop = asyncio.get_running_loop()
    t_arrival = loop.time()
    try:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
        text, max_tokens, stream, include_usage = _parse(body, chat, st)
        fh = request.headers.get("x-kvbench-fault")
        faults = parse_fault_header(fh, cfg) if fh else draw_faults(st.rng, cfg)
        tokens = st.tok.tokens(text)
        n_prompt = len(tokens)
        if n_prompt == 0:
            raise ApiError(400, "the prompt is empty; send at least one token", param="prompt")
        if max_tokens is None:
            max_tokens = max(1, min(cfg.default_max_tokens, cfg.max_model_len - n_prompt))
        if n_prompt + max_tokens > cfg.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {cfg.max_model_len} "
                                f"tokens. However, you requested {n_prompt + max_tokens} tokens "
                                f"({n_prompt} in the prompt, {max_tokens} in the completion). "
                                "Please reduce the length of the prompt or completion.",
                           param="max_tokens")
    except ApiError as e:
        return error_response(e.status, e.message, e.etype, e.param, e.headers)
    if faults.rate_limit:
        return error_response(429, "rate limit reached (injected fault); retry after the "
                                   "Retry-After delay", "RateLimitError",
                              headers={"Retry-After": f"{cfg.faults.retry_after_s:g}"})
    if faults.error is not None:
        return error_response(faults.error, f"injected fault: HTTP {faults.error}",
                              "InternalServerError" if faults.error >= 500 else
                              "BadRequestError")
    rid = st.next_id()
    seq = Seq(rid, n_prompt, block_hashes(tokens, cfg.block_tokens), max_tokens, t_arrival)
    del tokens
    try:
        try:
            await cluster.submit(seq, request.headers.get("x-kvbench-region"),
                                 request.headers.get("x-kvbench-residency"))
        except RoutingError as e:
            return error_response(400, str(e), param="x-kvbench-region")
        await _wait(seq, lambda: seq.generated > 0 or seq.finished)
        if seq.error is not None:
            status, etype, msg = seq.error
            return error_response(status, msg, etype)
        if faults.stall_before_ms:
            await asyncio.sleep(faults.stall_before_ms / 1e3)
        if faults.slow_headers_ms:
            await asyncio.sleep(faults.slow_headers_ms / 1e3)
        if stream:
            return await _stream(request, st, seq, chat, include_usage, faults)
        await _wait(seq, lambda: seq.finished)
        if seq.error is not None:
            status, etype, msg = seq.error
            return error_response(status, msg, etype)
        out = "".join(_words(st, seq, 0, seq.generated))
        created = st.created
        if chat:
            body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
                    "model": cfg.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": out},
                                 "logprobs": None, "finish_reason": "length"}],
                    "usage": _usage(seq)}
        else:
            body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                    "model": cfg.model_name,
                    "choices": [{"index": 0, "text": out, "logprobs": None,
                                 "finish_reason": "length", "stop_reason": None}],
                    "usage": _usage(seq)}
        return web.Response(body=orjson.dumps(body), content_type=JSON,
                            headers=_timing_headers(seq, st))
    finally:
        if not seq.finished:
            seq.cancelled = True


def _words(st: State, seq: Seq, a: int, b: int):
    base = zlib.crc32(seq.rid.encode())
    w = st.words
    return [w[(base + i * 2654435761) & 4095] for i in range(a, b)]


async def _stream(request: web.Request, st: State, seq: Seq, chat: bool, include_usage: bool,
                  faults: Faults) -> web.StreamResponse:
    cfg = st.cfg
    rid = seq.rid
    created = st.created
    model = orjson.dumps(cfg.model_name).decode()
    if chat:
        head = (f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                f'"created":{created},"model":{model},"choices":[{{"index":0,')
        pre = (head + '"delta":{"content":"').encode()
        mid = b'"},"logprobs":null,"finish_reason":'
        first = (head + '"delta":{"role":"assistant","content":""},"logprobs":null,'
                 '"finish_reason":null}]}\n\n').encode()
    else:
        head = (f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
                f'"created":{created},"model":{model},"choices":[{{"index":0,')
        pre = (head + '"text":"').encode()
        mid = b'","logprobs":null,"finish_reason":'
        first = b""
    tail_open = b'null}]}\n\n'
    tail_last = b'"length"}]}\n\n'
    headers = _timing_headers(seq, st)
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    resp = web.StreamResponse(status=200, headers=headers)
    base = zlib.crc32(rid.encode())
    words = st.word_bytes
    loop = asyncio.get_running_loop()
    def pending(a: int, b: int) -> bytes:
        last = seq.max_tokens
        parts = []
        for i in range(a, b):
            parts.append(pre)
            parts.append(words[(base + i * 2654435761) & 4095])
            parts.append(mid)
            parts.append(tail_last if i + 1 == last else tail_open)
        return b"".join(parts)

    fast = not (faults.malformed or faults.reset or faults.stall_mid_ms)
    try:
        await resp.prepare(request)
        sent = seq.generated
        await resp.write(first + pending(0, sent))  # the headers go out with it
        writer = getattr(resp, "_payload_writer", None)
        if fast and writer is not None and hasattr(writer, "_write_chunked_payload"):
            # Fast path: the engine's step writes each stream's new events straight to its
            # socket (aiohttp's chunked framing, no task wake-up per token).
            state = [sent]

            def sink(s: Seq) -> None:
                n = s.generated
                if n > state[0]:
                    data = pending(state[0], n)
                    state[0] = n
                    try:
                        if writer.chunked:
                            writer._write_chunked_payload(data)
                        else:
                            writer._write(data)
                    except Exception:
                        s.cancelled = True
                        s.sink = None
                    else:
                        if writer.buffer_size > 0x10000:  # slow reader: the handler drains
                            s.sink = None
                if s.finished:
                    s.sink = None
                if s.sink is None:  # hand back to the handler task
                    w = s.waiter
                    if w is not None and not w.done():
                        w.set_result(None)

            while not seq.finished and not seq.cancelled:
                seq.sink = sink
                await _wait(seq, lambda: seq.finished or seq.sink is None or seq.cancelled)
                seq.sink = None
                if seq.cancelled:
                    return resp
                if writer.buffer_size > 0x10000:
                    writer.buffer_size = 0
                    await writer.drain()
                if seq.generated > state[0]:
                    await resp.write(pending(state[0], seq.generated))
                    state[0] = seq.generated
            sent = state[0]
        half = max(1, seq.max_tokens // 2)
        mid_done = False
        while True:
            n = seq.generated
            if n > sent:
                await resp.write(pending(sent, n))
                sent = n
            if not mid_done and sent >= half and sent < seq.max_tokens:
                mid_done = True
                if faults.malformed:
                    await resp.write(f'data: {{"id":"cmpl-{rid}","choices":[{{"text": '
                                     'broken\n\n'.encode())
                if faults.reset:
                    seq.cancelled = True
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if faults.stall_mid_ms:
                    await asyncio.sleep(faults.stall_mid_ms / 1e3)
                    continue
            if seq.finished and sent >= seq.generated:
                break
            w = loop.create_future()
            seq.waiter = w
            if seq.generated == sent and not seq.finished:
                await w
            seq.waiter = None
        if seq.error is not None and sent < seq.max_tokens:
            status, etype, msg = seq.error
            err = {"error": {"message": msg, "type": etype, "param": None, "code": status}}
            await resp.write(b"data: " + orjson.dumps(err) + b"\n\n")
        if include_usage:
            u = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                 "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": created, "model": cfg.model_name, "choices": [],
                 "usage": _usage(seq)}
            await resp.write(b"data: " + orjson.dumps(u) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:  # the client went away
        seq.cancelled = True
    except asyncio.CancelledError:
        seq.cancelled = True
        raise
    return resp


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def handle_models(request: web.Request) -> web.Response:
    st: State = request.app[STATE_KEY]
    cfg = st.cfg
    body = {"object": "list", "data": [{
        "id": cfg.model_name, "object": "model", "created": st.created, "owned_by": "kvbench",
        "root": cfg.model_name, "parent": None, "max_model_len": cfg.max_model_len,
        "kvbench": {"topology": cfg.topology, "hardware": cfg.hardware, "model": cfg.model,
                    "kv_dtype": cfg.kv_dtype, "time_scale": cfg.time_scale}}]}
    return web.Response(body=orjson.dumps(body), content_type=JSON)


async def handle_tokenize(request: web.Request) -> web.Response:
    st: State = request.app[STATE_KEY]
    try:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise ApiError(400, "field messages must be a list of {role, content} objects",
                               param="messages")
            text = st.tok.render_chat(msgs)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise ApiError(400, "give prompt (a string) or messages", param="prompt")
    except ApiError as e:
        return error_response(e.status, e.message, e.etype, e.param)
    ids = st.tok.encode(text)
    return web.Response(body=orjson.dumps({"count": len(ids), "max_model_len":
                                           st.cfg.max_model_len, "tokens": ids}),
                        content_type=JSON)


async def handle_health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def handle_metrics(request: web.Request) -> web.Response:
    text = render(request.app[CLUSTER_KEY])
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status >= 400:
            etype = "NotFoundError" if exc.status == 404 else "BadRequestError"
            return error_response(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                  etype)
        raise
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:  # a bug: report it, keep serving
        request.app.logger.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}",
                              "InternalServerError")


def create_app(cfg: EmulatorConfig) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    st = State(cfg)
    cluster = Cluster(st.res)
    app[STATE_KEY] = st
    app[CLUSTER_KEY] = cluster

    async def on_startup(app):
        cluster.start()

    async def on_cleanup(app):
        await cluster.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/tokenize", handle_tokenize)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    return app


class EmulatorServer:
    """An emulator on ``host:port`` inside the running event loop (tests, benchmarks)."""

    def __init__(self, cfg: EmulatorConfig, host: str = "127.0.0.1", port: int = 0):
        self.cfg = cfg
        self.host = host
        self.port = port
        self.app = create_app(cfg)
        self._runner: web.AppRunner | None = None

    @property
    def cluster(self) -> Cluster:
        return self.app[CLUSTER_KEY]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> "EmulatorServer":
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096)
        await site.start()
        sock = site._server.sockets[0]  # the real port when 0 was asked for
        self.port = sock.getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()
