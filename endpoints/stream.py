"""The SSE streaming path: one event per generated token, ``[DONE]`` at the end.

While the reader keeps up, the engine's step writes each stream's new events straight to its
socket through the sink (no task wake-up per token); a lagging reader or a mid-stream fault
hands the writes back to the handler task, which goes through aiohttp's ``write`` (and its
drain). Only public API: ``request.transport``, ``StreamResponse.enable_chunked_encoding``,
``chunked``, ``write``; the chunked framing of the sink's writes is HTTP/1.1's own.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Callable

import orjson
from aiohttp import HttpVersion11, web

from kvbench.endpoints.faults import Faults
from kvbench.endpoints.protocol import WORD_MULT, State, error_body, timing_headers, usage
from kvbench.endpoints.seq import Seq, wait

# Bytes queued in the socket's send buffer above which the reader counts as lagging: the
# handler takes the writes over so that aiohttp's drain paces them (its own limit, 64 KiB).
LAGGING_READER_BYTES = 0x10000


def _event_parts(st: State, seq: Seq, chat: bool) -> tuple[bytes, bytes, bytes]:
    """(first event, bytes before a token's text, bytes after it up to finish_reason)."""
    model = orjson.dumps(st.cfg.model_name).decode()
    if chat:
        head = (f'data: {{"id":"chatcmpl-{seq.rid}","object":"chat.completion.chunk",'
                f'"created":{st.created},"model":{model},"choices":[{{"index":0,')
        first = (head + '"delta":{"role":"assistant","content":""},"logprobs":null,'
                 '"finish_reason":null}]}\n\n').encode()
        return first, (head + '"delta":{"content":"').encode(), \
            b'"},"logprobs":null,"finish_reason":'
    head = (f'data: {{"id":"cmpl-{seq.rid}","object":"text_completion",'
            f'"created":{st.created},"model":{model},"choices":[{{"index":0,')
    return b"", (head + '"text":"').encode(), b'","logprobs":null,"finish_reason":'


def _renderer(st: State, seq: Seq, chat: bool) -> tuple[bytes, Callable[[int, int], bytes]]:
    """The first event and ``pending(a, b)``: the events of tokens ``a``..``b``."""
    first, pre, mid = _event_parts(st, seq, chat)
    tail_open = b'null}]}\n\n'
    tail_last = b'"length"}]}\n\n'
    base = zlib.crc32(seq.rid.encode())
    words = st.word_bytes

    def pending(a: int, b: int) -> bytes:
        last = seq.max_tokens
        parts = []
        for i in range(a, b):
            parts.append(pre)
            parts.append(words[(base + i * WORD_MULT) & 4095])
            parts.append(mid)
            parts.append(tail_last if i + 1 == last else tail_open)
        return b"".join(parts)

    return first, pending


async def _push(seq: Seq, resp: web.StreamResponse, transport: asyncio.Transport,
                pending: Callable[[int, int], bytes], sent: int) -> int | None:
    """Stream until ``seq`` finishes, written by the engine's step while the reader keeps up;
    the tokens sent, or None when the client went away."""
    chunked = resp.chunked
    state = [sent]

    def sink(s: Seq) -> None:
        n = s.generated
        if n > state[0]:
            data = pending(state[0], n)
            state[0] = n
            try:
                if transport.is_closing():
                    raise ConnectionResetError
                transport.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
            except Exception:
                s.cancelled = True
                s.sink = None
            else:
                if transport.get_write_buffer_size() > LAGGING_READER_BYTES:
                    s.sink = None
        if s.finished:
            s.sink = None
        if s.sink is None:  # hand back to the handler task
            w = s.waiter
            if w is not None and not w.done():
                w.set_result(None)

    while True:
        if seq.cancelled:
            return None
        if seq.generated > state[0]:  # a lagging reader: aiohttp's write drains
            await resp.write(pending(state[0], seq.generated))
            state[0] = seq.generated
        if seq.finished:
            return state[0]
        if transport.get_write_buffer_size() <= LAGGING_READER_BYTES:
            seq.sink = sink
            await wait(seq, lambda: seq.finished or seq.sink is None or seq.cancelled)
            seq.sink = None
        else:
            await wait(seq, lambda: seq.finished or seq.cancelled or seq.generated > state[0])


async def stream_reply(request: web.Request, st: State, seq: Seq, chat: bool,
                       include_usage: bool, faults: Faults) -> web.StreamResponse:
    """The SSE reply of ``seq``, whose first token is out; the headers carry its timing."""
    rid = seq.rid
    headers = timing_headers(seq, st)
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    resp = web.StreamResponse(status=200, headers=headers)
    if request.version >= HttpVersion11:  # what aiohttp picks anyway; now resp.chunked says so
        resp.enable_chunked_encoding()
    first, pending = _renderer(st, seq, chat)
    loop = asyncio.get_running_loop()
    try:
        await resp.prepare(request)
        sent = seq.generated
        await resp.write(first + pending(0, sent))  # the headers go out with it
        transport = request.transport
        if not faults.mid_stream and transport is not None:
            done = await _push(seq, resp, transport, pending, sent)
            if done is None:
                return resp
            sent = done
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
            await resp.write(b"data: " + orjson.dumps(error_body(status, msg, etype)) + b"\n\n")
        if include_usage:
            u = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                 "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": st.created, "model": st.cfg.model_name, "choices": [],
                 "usage": usage(seq)}
            await resp.write(b"data: " + orjson.dumps(u) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:  # the client went away
        seq.cancelled = True
    except asyncio.CancelledError:
        seq.cancelled = True
        raise
    return resp
