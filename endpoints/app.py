"""The emulator's aiohttp application: the OpenAI routes, ``/v1/models``, ``/tokenize``,
``/health`` and ``/metrics``, with the cluster started and stopped with the app.

A completion is read, validated, given its faults, routed into the cluster, and answered as
JSON or as an SSE stream (``stream.py``) once its first token is out. Bad requests get
OpenAI-style error JSON.
"""

from __future__ import annotations

import asyncio
import re

import orjson
from aiohttp import web

from kvbench.endpoints.cluster import Cluster
from kvbench.endpoints.config import EmulatorConfig
from kvbench.endpoints.faults import HEADER as FAULT_HEADER
from kvbench.endpoints.faults import faults_for
from kvbench.endpoints.kvcache import block_hashes
from kvbench.endpoints.metrics import render
from kvbench.endpoints.protocol import (
    JSON, ApiError, State, completion_body, error_response, parse_request, timing_headers)
from kvbench.endpoints.router import RoutingError
from kvbench.endpoints.seq import Seq, wait
from kvbench.endpoints.stream import stream_reply

_RID_OK = re.compile(r"[A-Za-z0-9._:#@/+=-]+")

CLUSTER_KEY = web.AppKey("cluster", Cluster)
STATE_KEY = web.AppKey("state", State)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    st = request.app[STATE_KEY]
    cluster = request.app[CLUSTER_KEY]
    cfg = st.cfg
    t_arrival = asyncio.get_running_loop().time()
    try:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
        text, max_tokens, stream, include_usage = parse_request(body, chat, st)
        faults = faults_for(request.headers.get(FAULT_HEADER), st.rng, cfg)
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
    seq = Seq(_request_id(request) or st.next_id(), n_prompt, block_hashes(tokens, cfg.block_tokens), max_tokens,
              t_arrival)
    del tokens
    try:
        try:
            await cluster.submit(seq, request.headers.get("x-kvbench-region"),
                                 request.headers.get("x-kvbench-residency"),
                                 request.headers.get(cfg.pin_header) if cfg.pin_header else None)
        except RoutingError as e:
            return error_response(400, str(e), param="x-kvbench-region")
        await wait(seq, lambda: seq.generated > 0 or seq.finished)
        if seq.error is not None:
            status, etype, msg = seq.error
            return error_response(status, msg, etype)
        if faults.stall_before_ms:
            await asyncio.sleep(faults.stall_before_ms / 1e3)
        if faults.slow_headers_ms:
            await asyncio.sleep(faults.slow_headers_ms / 1e3)
        if stream:
            return await stream_reply(request, st, seq, chat, include_usage, faults)
        await wait(seq, lambda: seq.finished)
        if seq.error is not None:
            status, etype, msg = seq.error
            return error_response(status, msg, etype)
        return web.Response(body=orjson.dumps(completion_body(st, seq, chat)),
                            content_type=JSON, headers=timing_headers(seq, st))
    finally:
        if not seq.finished:
            seq.cancelled = True


def _request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id, used as the request's id when it is a plain token (as vLLM
    does), so the answer's ``x-request-id`` and ids join the client's records."""
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 128 and _RID_OK.fullmatch(rid):
        return rid
    return None


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def handle_models(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
    cfg = st.cfg
    body = {"object": "list", "data": [{
        "id": cfg.model_name, "object": "model", "created": st.created, "owned_by": "kvbench",
        "root": cfg.model_name, "parent": None, "max_model_len": cfg.max_model_len,
        "kvbench": {"topology": cfg.topology, "hardware": cfg.hardware, "model": cfg.model,
                    "kv_dtype": cfg.kv_dtype, "time_scale": cfg.time_scale}}]}
    return web.Response(body=orjson.dumps(body), content_type=JSON)


async def handle_tokenize(request: web.Request) -> web.Response:
    st = request.app[STATE_KEY]
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


async def handle_reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's dev-mode route: empty the prefix cache. Refused (409) while requests are in
    flight, whose blocks cannot be dropped; kvbench resets between runs, when idle."""
    dropped = request.app[CLUSTER_KEY].reset_prefix_cache()
    if dropped is None:
        return error_response(409, "requests are in flight; reset the prefix cache when the "
                                   "endpoint is idle", "ConflictError")
    return web.Response(body=orjson.dumps({"reset": True, "blocks_dropped": dropped}),
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
    app.router.add_post("/reset_prefix_cache", handle_reset_prefix_cache)
    app.router.add_get("/metrics", handle_metrics)
    return app
