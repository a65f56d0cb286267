"""The OpenAI-compatible wire format the emulator speaks: request validation, error and JSON
bodies, usage, the server-timing headers, and the per-server state they read."""

from __future__ import annotations

import random
import time
import zlib

import orjson
from aiohttp import web

from kvbench.endpoints.config import EmulatorConfig
from kvbench.endpoints.seq import Seq
from kvbench.workloads.tokenizer import get_tokenizer

JSON = "application/json"
WORD_MULT = 2654435761  # Knuth's multiplicative hash: token i of a reply is word (crc + i*M) & 4095


class ApiError(Exception):
    def __init__(self, status: int, message: str, etype: str = "BadRequestError",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype
        self.param = param
        self.headers = headers or {}


def error_body(status: int, message: str, etype: str = "BadRequestError",
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}


def error_response(status: int, message: str, etype: str = "BadRequestError",
                   param: str | None = None, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(error_body(status, message, etype,
                                                                    param)),
                        content_type=JSON, headers=headers)


class State:
    """What the handlers share: settings, tokenizer, the reply word table, ids."""

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


def parse_request(body, chat: bool, st: State) -> tuple[str, int | None, bool, bool]:
    """(prompt text, max_tokens or None for the default, stream, include_usage); raises
    ApiError."""
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


def timing_headers(seq: Seq, st: State) -> dict:
    """The server's own timing of ``seq`` (wall milliseconds), its replica and region."""
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
        # the TTFT the model planned (front end, network, KV transfer, its steps), without
        # waits behind other requests or a loaded host's late wake-ups: what a check of the
        # model can assert on a busy machine
        "x-kvbench-model-ttft-ms": f"{seq.model_first_s * 1e3:.3f}",
        "x-kvbench-network-ms": f"{seq.network_ms * st.cfg.time_scale:.3f}",
        "x-kvbench-cached-tokens": str(seq.cached_tokens),
        "x-kvbench-replica": seq.replica,
        "x-kvbench-region": seq.region,
        "x-kvbench-time-scale": repr(st.cfg.time_scale),
        "x-request-id": seq.rid,
    }


def usage(seq: Seq) -> dict:
    return {"prompt_tokens": seq.n_prompt, "total_tokens": seq.n_prompt + seq.generated,
            "completion_tokens": seq.generated,
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}


def reply_words(st: State, seq: Seq, a: int, b: int) -> list[str]:
    """Tokens ``a``..``b`` of the reply: one word of the tokenizer each, fixed by the id."""
    base = zlib.crc32(seq.rid.encode())
    w = st.words
    return [w[(base + i * WORD_MULT) & 4095] for i in range(a, b)]


def completion_body(st: State, seq: Seq, chat: bool) -> dict:
    """The non-streaming reply (a completion or a chat completion) of a finished ``seq``."""
    cfg = st.cfg
    out = "".join(reply_words(st, seq, 0, seq.generated))
    if chat:
        return {"id": f"chatcmpl-{seq.rid}", "object": "chat.completion", "created": st.created,
                "model": cfg.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out},
                             "logprobs": None, "finish_reason": "length"}],
                "usage": usage(seq)}
    return {"id": f"cmpl-{seq.rid}", "object": "text_completion", "created": st.created,
            "model": cfg.model_name,
            "choices": [{"index": 0, "text": out, "logprobs": None,
                         "finish_reason": "length", "stop_reason": None}],
            "usage": usage(seq)}
