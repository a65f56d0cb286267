"""OpenAI-compatible streaming: request bodies, chunk accounting and the status of a stream.

Token accounting (see ../shared/ENGINES.md): a choices chunk whose delta/text represents a
generated token counts as one token even when its text is empty (special or partial-UTF-8
tokens); a chat delta that only announces the role is not a token; an empty chunk carrying
``finish_reason`` counts only when the server's usage says it did (vLLM's EOS, not llama.cpp's
closing chunk) and the tokenizer finds no more than one token a chunk in the text before it.
Usage is taken wherever it appears (a ``choices: []`` chunk for vLLM, the ``finish_reason``
chunk for llama.cpp completions); the last one seen wins.

Token counts come from the server's usage; the client's counts are a check. A chunk may carry
several tokens (speculative decoding, vLLM's stream interval, SGLang): when usage reports N
tokens over K < N token-carrying chunks, the stream is fine and ``chunk_tokens`` is estimated at
settle time from the configured tokenizer's count of each chunk's text, scaled to sum to N (see
``apportion``). More chunks than tokens (K > N) is a protocol error. Without any usage (the
Python server of llama-cpp-python) each chunk counts one token, which undercounts multi-token
chunks: nothing in such a stream says how many tokens a chunk held.
"""

from __future__ import annotations

from html.parser import HTMLParser

import orjson
from orjson import JSONDecodeError
from orjson import loads as _loads

# What a stream may hold before the client cuts it (a protocol_error, the connection dropped):
# token-carrying chunks up to TOKEN_MARGIN x max_tokens + TOKEN_SLACK, and body bytes up to
# CHUNK_BYTES per such chunk + BYTES_SLACK (a vLLM chunk is about 300 bytes; logprobs add a few
# KB). A request without a max_tokens is held to UNKNOWN_MAX_TOKENS.
TOKEN_MARGIN, TOKEN_SLACK = 2, 16
CHUNK_BYTES, BYTES_SLACK = 8192, 1 << 20
UNKNOWN_MAX_TOKENS = 131072

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def request_path(req) -> str:
    return CHAT_PATH if req.messages is not None else COMPLETIONS_PATH


def request_body(req, model: str, *, include_usage: bool = True, ignore_eos: bool = False,
                 extra: dict | None = None, user: str | None = None) -> bytes:
    """JSON body of a request for ``req`` (a ``workloads.base.Request``): streaming unless the
    request says ``stream=False`` (then one JSON answer, no ``stream_options``). A request's
    ``min_tokens`` > 0 is sent as vLLM's ``min_tokens``; ``user``: the body's ``user`` field
    (a session id that routers pin on)."""
    stream = getattr(req, "stream", True)
    body: dict = {"model": model, "max_tokens": int(req.max_tokens), "stream": bool(stream)}
    if req.messages is not None:
        body["messages"] = list(req.messages)
    else:
        body["prompt"] = req.prompt
    if include_usage and stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang extension: generate exactly max_tokens
    min_tokens = getattr(req, "min_tokens", 0)
    if min_tokens and min_tokens > 0:
        body["min_tokens"] = int(min_tokens)  # vLLM extension: no EOS before this many tokens
    if user:
        body["user"] = user
    if extra:
        body.update(extra)
    return orjson.dumps(body)


def parse_answer(body: bytes) -> dict:
    """What a non-streamed answer (one JSON body) says: ``text``, ``prompt_tokens``,
    ``completion_tokens``, ``cached_tokens`` (None when absent), and ``error`` (a server's
    error object, or a body that is not an answer; None when fine)."""
    out = {"text": "", "prompt_tokens": None, "completion_tokens": None,
           "cached_tokens": None, "error": None}
    try:
        obj = _loads(body)
    except JSONDecodeError:
        out["error"] = f"unparseable answer: {body[:80].decode('utf-8', 'replace')}"
        return out
    if type(obj) is not dict or "error" in obj or obj.get("object") == "error":
        out["error"] = _error_text(obj) if type(obj) is dict else "the answer is not an object"
        return out
    try:
        if not obj.get("choices"):
            out["error"] = "the answer has no choices"
            return out
        c = obj["choices"][0]
        msg = c.get("message")
        text = c.get("text") or "" if msg is None else (
            (msg.get("reasoning_content") or msg.get("reasoning") or "")
            + (msg.get("content") or ""))
        out["text"] = text if type(text) is str else str(text)
        usage = obj.get("usage") or {}
        for key in ("prompt_tokens", "completion_tokens"):
            if usage.get(key) is not None:
                out[key] = int(usage[key])
        details = usage.get("prompt_tokens_details")
        if details and details.get("cached_tokens") is not None:
            out["cached_tokens"] = int(details["cached_tokens"])
    except (AttributeError, TypeError, ValueError, KeyError, IndexError):
        out["error"] = f"malformed answer: {body[:80].decode('utf-8', 'replace')}"
    return out


def settle_answer(res, body: bytes | None, keep_text: bool, tokenizer=None) -> None:
    """Fill ``res`` (a ``client.Result``) from a whole non-streamed answer ``body`` (None: the
    connection closed before it ended): usage, the text, the status. No chunks, no TTFT."""
    if body is None:
        res.status, res.error = "disconnected", "connection closed before the answer ended"
        return
    got = parse_answer(body)
    if got["error"] is not None:
        res.status, res.error = "protocol_error", got["error"][:300]
        return
    text = got["text"]
    if tokenizer is None and text:
        from kvbench.workloads.tokenizer import get_tokenizer

        tokenizer = get_tokenizer()
    res.status = "ok"
    res.prompt_tokens, res.cached_tokens = got["prompt_tokens"], got["cached_tokens"]
    res.completion_tokens_client = tokenizer.count(text) if text else 0
    res.completion_tokens = (got["completion_tokens"] if got["completion_tokens"] is not None
                             else res.completion_tokens_client)
    if keep_text:
        res.text = text


def stream_caps(max_tokens: int | None) -> tuple[int, int, str]:
    """``(chunks, bytes, what)``: the most token-carrying chunks and body bytes a stream for
    ``max_tokens`` may send, and the limit in words for the error."""
    given = max_tokens is not None and max_tokens > 0
    n = int(max_tokens) if given else UNKNOWN_MAX_TOKENS
    chunks = TOKEN_MARGIN * n + TOKEN_SLACK
    what = f"max_tokens={n:,}" if given else f"no max_tokens (held to {n:,})"
    return chunks, chunks * CHUNK_BYTES + BYTES_SLACK, what


def error_message(body: bytes, limit: int = 200) -> str:
    """A short text for an error response body (OpenAI ``{"error": {...}}``, vLLM
    ``{"object": "error", ...}``, a proxy's HTML page (its title) or plain text)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        if _looks_html(body):
            return html_summary(body)[:limit]
        return " ".join(body[:limit].decode("utf-8", "replace").split())
    return _error_text(obj)[:limit] if isinstance(obj, dict) else str(obj)[:limit]


def _looks_html(body: bytes) -> bool:
    head = body[:512].lstrip().lower()
    return head.startswith(b"<") and any(t in head for t in (b"<html", b"<!doctype html",
                                                             b"<head", b"<title", b"<body"))


class _PageText(HTMLParser):
    """The title of an HTML page, and its visible text (scripts and styles left out)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title: list[str] = []
        self.text: list[str] = []
        self._in: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("title", "script", "style"):
            self._in.append(tag)

    def handle_endtag(self, tag) -> None:
        if self._in and self._in[-1] == tag:
            self._in.pop()

    def handle_data(self, data) -> None:
        where = self._in[-1] if self._in else None
        if where == "title":
            self.title.append(data)
        elif where is None:
            self.text.append(data)


def html_summary(body: bytes) -> str:
    """``502 Bad Gateway (an HTML page)``: the page's title, else its first visible text."""
    page = _PageText()
    try:
        page.feed(body[:65536].decode("utf-8", "replace"))
        page.close()
    except (AssertionError, ValueError):  # HTMLParser's complaints on broken markup
        pass
    title = " ".join("".join(page.title).split())
    text = title or " ".join(" ".join(page.text).split())[:120]
    return f"{text} (an HTML page)" if text else "an HTML page without text"


def _error_text(obj: dict) -> str:
    err = obj.get("error", obj)
    if isinstance(err, dict):
        msg = err.get("message") or err.get("detail") or orjson.dumps(err).decode()
        code = err.get("code") or obj.get("code")
        return f"{msg} (code {code})" if code is not None else str(msg)
    return str(err)


def apportion(weights: list[int], total: int) -> list[int]:
    """Split ``total`` over chunks in proportion to ``weights`` (largest remainder), every chunk
    getting at least 1; needs ``total >= len(weights) > 0``. A chunk's weight is only an
    estimate of its tokens: tokenizing chunks apart can differ from the server's tokenization."""
    k = len(weights)
    w = [x if x > 0 else 1 for x in weights]
    sw = sum(w)
    quotas = [total * x / sw for x in w]
    alloc = [int(q) or 1 for q in quotas]
    diff = total - sum(alloc)
    if diff > 0:  # fewer than k short: one more each to the largest remainders
        for i in sorted(range(k), key=lambda i: alloc[i] - quotas[i])[:diff]:
            alloc[i] += 1
    while diff < 0:  # chunks raised to 1 took too much: take back from the most over-quota
        for i in sorted(range(k), key=lambda i: quotas[i] - alloc[i]):
            if alloc[i] > 1:
                alloc[i] -= 1
                diff += 1
                if diff == 0:
                    break
    return alloc


class StreamState:
    """Everything learnt from one response stream, fed with SSE events as they arrive.

    ``offsets_ns``/``tokens`` list the token-carrying chunks (arrival offset from the send on
    the monotonic clock, tokens in the chunk: 1 until ``settle`` estimates multi-token chunks
    with ``tokenizer``, the built-in one when None). ``parts`` holds each such chunk's text
    (None when it had none), aligned with ``offsets_ns``; ``keep_text`` only tells the caller
    to hand the text on. ``completion_tokens_client`` is set by ``settle``.
    """

    __slots__ = ("t0_ns", "offsets_ns", "tokens", "done", "finish_reason", "finish_offset_ns",
                 "prompt_tokens", "completion_tokens", "cached_tokens", "error", "bad",
                 "keep_text", "parts", "chunks", "tokenizer", "completion_tokens_client",
                 "caps", "cut")

    def __init__(self, t0_ns: int, keep_text: bool = False, tokenizer=None,
                 caps: tuple[int, int, str] | None = None) -> None:
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
        self.parts: list = []  # text of each token-carrying chunk, as received
        self.chunks = 0  # data events seen, token-carrying or not
        self.tokenizer = tokenizer
        self.completion_tokens_client: int | None = None
        self.caps = caps or stream_caps(None)  # see ``stream_caps``
        self.cut = False  # more chunks than the caps allow: the caller stops reading

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
            self.parts.append(text)  # normalised at settle time, not here
        if len(self.offsets_ns) > self.caps[0]:
            self.cut_at(None)

    def cut_at(self, body_bytes: int | None) -> None:
        """The stream broke the caps (chunks, or ``body_bytes`` past the byte cap): a
        protocol error naming the limit; the chunks beyond the cap are dropped."""
        chunks, nbytes, what = self.caps
        if not self.cut:
            self.cut = True
            if body_bytes is None or len(self.offsets_ns) > chunks:
                over = (f"{chunks:,} token-carrying chunks (the client's cut: {TOKEN_MARGIN} x "
                        f"max_tokens + {TOKEN_SLACK})")
            else:
                over = (f"{nbytes:,} bytes (the client's cut: {CHUNK_BYTES:,} bytes per "
                        "allowed chunk + 1 MiB)")
            self.bad = f"the server sent more than {what} allows: over {over}"
        del self.offsets_ns[chunks:], self.tokens[chunks:], self.parts[chunks:]

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
        return "".join(t if type(t) is str else str(t) for t in self.parts if t)

    def settle(self, body_complete: bool) -> tuple[str, str | None]:
        """``(status, error)`` once the response body ended; ``body_complete`` is False when
        the connection dropped before the HTTP body was complete. Also sets
        ``completion_tokens_client`` and, for multi-token chunks, ``tokens``."""
        client = len(self.tokens)
        usage_n = self.completion_tokens
        if (self.finish_offset_ns is not None and usage_n is not None
                and usage_n == client + 1 and self._tokenizer().count(self.text) <= client):
            # the server counted it (EOS), unless the text chunks hold the extra token
            self.offsets_ns.append(self.finish_offset_ns)
            self.tokens.append(1)
            self.parts.append(None)
            self.finish_offset_ns = None
            client += 1
        self.completion_tokens_client = client
        if self.error is not None:
            return "http_error", f"stream error: {self.error}"[:300]
        if self.bad is not None:
            return "protocol_error", self.bad
        if not body_complete:
            return "disconnected", "connection closed before the stream ended"
        if not self.done and self.finish_reason is None:
            return "protocol_error", "stream ended without [DONE] or finish_reason"
        if usage_n is None or usage_n == client:
            return "ok", None
        if usage_n < client or client == 0:
            return "protocol_error", (f"usage reports {usage_n} tokens but {client} "
                                      "token-carrying chunks arrived")
        self._multi_token(usage_n)
        return "ok", None

    def _tokenizer(self):
        if self.tokenizer is None:
            from kvbench.workloads.tokenizer import get_tokenizer

            self.tokenizer = get_tokenizer()
        return self.tokenizer

    def _multi_token(self, usage_n: int) -> None:
        """K token-carrying chunks held ``usage_n`` > K tokens: estimate each chunk's share."""
        tok = self._tokenizer()
        texts = [t if type(t) is str else ("" if t is None else str(t)) for t in self.parts]
        count = tok.count
        self.tokens[:] = apportion([count(t) if t else 1 for t in texts], usage_n)
        self.completion_tokens_client = count("".join(texts))

