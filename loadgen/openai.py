"""OpenAI-compatible streaming: request bodies, chunk accounting and the status of a stream.

Token accounting (see ../shared/ENGINES.md): a choices chunk whose delta/text represents a
generated token counts as one token even when its text is empty (special or partial-UTF-8
tokens); a chat delta that only announces the role is not a token; an empty chunk carrying
``finish_reason`` counts only when the server's usage says it did (vLLM's EOS, not llama.cpp's
closing chunk). Usage is taken wherever it appears (a ``choices: []`` chunk for vLLM, the
``finish_reason`` chunk for llama.cpp completions); the last one seen wins.
"""

from __future__ import annotations

import orjson
from orjson import JSONDecodeError
from orjson import loads as _loads

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def request_path(req) -> str:
    return CHAT_PATH if req.messages is not None else COMPLETIONS_PATH


def request_body(req, model: str, *, include_usage: bool = True, ignore_eos: bool = False,
                 extra: dict | None = None) -> bytes:
    """JSON body of a streaming request for ``req`` (a ``workloads.base.Request``)."""
    body: dict = {"model": model, "max_tokens": int(req.max_tokens), "stream": True}
    if req.messages is not None:
        body["messages"] = list(req.messages)
    else:
        body["prompt"] = req.prompt
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang extension: generate exactly max_tokens
    if extra:
        body.update(extra)
    return orjson.dumps(body)


def error_message(body: bytes, limit: int = 200) -> str:
    """A short text for an error response body (OpenAI ``{"error": {...}}``, vLLM
    ``{"object": "error", ...}`` or plain text)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:limit].decode("utf-8", "replace").strip()
    return _error_text(obj)[:limit] if isinstance(obj, dict) else str(obj)[:limit]


def _error_text(obj: dict) -> str:
    err = obj.get("error", obj)
    if isinstance(err, dict):
        msg = err.get("message") or err.get("detail") or orjson.dumps(err).decode()
        code = err.get("code") or obj.get("code")
        return f"{msg} (code {code})" if code is not None else str(msg)
    return str(err)


class StreamState:
    """Everything learnt from one response stream, fed with SSE events as they arrive.

    ``offsets_ns``/``tokens`` list the token-carrying chunks (arrival offset from the send on
    the monotonic clock, tokens in the chunk). ``text`` is kept only when ``keep_text``.
    """

    __slots__ = ("t0_ns", "offsets_ns", "tokens", "done", "finish_reason", "finish_offset_ns",
                 "prompt_tokens", "completion_tokens", "cached_tokens", "error", "bad",
                 "keep_text", "parts", "chunks")

    def __init__(self, t0_ns: int, keep_text: bool = False) -> None:
        self.t0_ns = t0_ns
        self.offsets_ns: list[int] = []
        self.tokens: list[int] = []
        self.done = False  # [DONE] seen
        self.finish_reason = None
        self.finish_offset_ns: int | None = None  # an empty chunk that only closed the stream
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.error: str | None = None  # the server reported an error in the stream
        self.bad: str | None = None  # the stream broke the protocol
        self.keep_text = keep_text
        self.parts: list[str] = []
        self.chunks = 0  # data events seen, token-carrying or not

    def on_events(self, events: list, t_ns: int) -> None:
        """Account for the events of one socket read that arrived at monotonic ``t_ns``."""
        offset_ns = t_ns - self.t0_ns
        self.chunks += len(events)
        for ev_type, data in events:
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                obj = _loads(data)
            except JSONDecodeError:
                if self.bad is None:
                    self.bad = f"unparseable chunk: {data[:80].decode('utf-8', 'replace')}"
                continue
            if type(obj) is not dict:
                if self.bad is None:
                    self.bad = "chunk is not a JSON object"
                continue
            if ev_type == "error" or "error" in obj or obj.get("object") == "error":
                if self.error is None:
                    self.error = _error_text(obj)
                continue
            try:
                usage = obj.get("usage")
                if usage:
                    self._usage(usage)
                choices = obj.get("choices")
                if not choices:
                    continue
                c = choices[0]
                delta = c.get("delta")
                if delta is not None:  # chat
                    text = delta.get("content")
                    if "reasoning_content" in delta or "reasoning" in delta:
                        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                        if reasoning:
                            text = reasoning if not text else reasoning + text
                        elif not text and "role" in delta and not delta.get("tool_calls"):
                            continue
                    elif not text and "role" in delta and not delta.get("tool_calls"):
                        continue  # the role announcement, not a generated token
                else:
                    text = c.get("text")
                fr = c.get("finish_reason")
            except (AttributeError, TypeError, ValueError, KeyError, IndexError):
                if self.bad is None:
                    self.bad = f"malformed chunk: {data[:80].decode('utf-8', 'replace')}"
                continue
            if fr is not None:
                self.finish_reason = fr
                if not text:
                    self.finish_offset_ns = offset_ns
                    continue
            self.offsets_ns.append(offset_ns)
            self.tokens.append(1)
            if text and self.keep_text:
                self.parts.append(text if type(text) is str else str(text))

    def _usage(self, usage: dict) -> None:
        pt = usage.get("prompt_tokens")
        ct = usage.get("completion_tokens")
        if pt is not None:
            self.prompt_tokens = int(pt)
        if ct is not None:
            self.completion_tokens = int(ct)
        details = usage.get("prompt_tokens_details")
        if details and details.get("cached_tokens") is not None:
            self.cached_tokens = int(details["cached_tokens"])

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def settle(self, body_complete: bool) -> tuple[str, str | None]:
        """``(status, error)`` once the response body ended; ``body_complete`` is False when
        the connection dropped before the HTTP body was complete."""
        client = len(self.tokens)
        if (self.finish_offset_ns is not None and self.completion_tokens is not None
                and self.completion_tokens == client + 1):
            self.offsets_ns.append(self.finish_offset_ns)  # the server counted it (EOS)
            self.tokens.append(1)
            self.finish_offset_ns = None
            client += 1
        if self.error is not None:
            return "http_error", f"stream error: {self.error}"[:300]
        if self.bad is not None:
            return "protocol_error", self.bad
        if not body_complete:
            return "disconnected", "connection closed before the stream ended"
        if not self.done and self.finish_reason is None:
            return "protocol_error", "stream ended without [DONE] or finish_reason"
        if self.completion_tokens is not None and self.completion_tokens != client:
            return "protocol_error", (f"token count mismatch: {client} token chunks, usage says "
                                      f"{self.completion_tokens}")
        return "ok", None
