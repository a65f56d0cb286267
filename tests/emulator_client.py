"""A small aiohttp client for the emulator's own tests and benchmarks (not the load generator):
one request, streamed or not, with client-side timing and the SSE events as parsed by the
tree's one SSE parser (``kvbench.loadgen.timing.sse``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from kvbench.loadgen.timing.sse import SSEParser


@dataclass
class Reply:
    status: int
    headers: dict
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_times_s: list = field(default_factory=list)  # arrival of each token event, from send
    text: str = ""
    usage: dict | None = None
    events: list = field(default_factory=list)  # parsed JSON of every data event
    bad_events: list = field(default_factory=list)  # data lines that were not JSON
    done: bool = False  # saw data: [DONE]
    body: dict | None = None  # non-streaming JSON body (or error body)
    error: str | None = None  # transport error text

    def header_ms(self, name: str) -> float:
        return float(self.headers.get(f"x-kvbench-{name}-ms", "nan"))

    def server_ttft_ms(self) -> float:
        """queue + prefill + KV transfer + first decode, as the server reported them."""
        return sum(self.header_ms(n) for n in ("queue", "prefill", "kv-transfer", "first-decode"))

    @property
    def cached_tokens(self) -> int:
        u = self.usage or {}
        return int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _take(rep: Reply, events: list, now: float, chat: bool, parts: list[str]) -> None:
    """Fold parsed SSE events that arrived at ``now`` (seconds from send) into ``rep``."""
    for _, payload in events:
        if payload == b"[DONE]":
            rep.done = True
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            rep.bad_events.append(payload)
            continue
        rep.events.append(obj)
        if obj.get("usage") and not obj.get("choices"):
            rep.usage = obj["usage"]
        for ch in obj.get("choices") or ():
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            if piece:
                parts.append(piece)
                rep.chunk_times_s.append(now)
                if rep.ttft_s is None:
                    rep.ttft_s = now


async def request(session: aiohttp.ClientSession, url: str, body: dict, *, chat: bool = False,
                  headers: dict | None = None) -> Reply:
    """POST to /v1/completions (or /v1/chat/completions) and read the whole reply."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    try:
        async with session.post(url + path, data=orjson.dumps(body),
                                headers={"Content-Type": "application/json",
                                         **(headers or {})}) as resp:
            rep = Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()})
            if not body.get("stream") or resp.status != 200:
                raw = await resp.read()
                rep.e2e_s = time.perf_counter() - t0
                try:
                    rep.body = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    rep.body = {"raw": raw.decode(errors="replace")}
                if resp.status == 200:
                    ch = rep.body["choices"][0]
                    rep.text = ch["message"]["content"] if chat else ch["text"]
                    rep.usage = rep.body.get("usage")
                    rep.ttft_s = rep.e2e_s
                return rep
            parser = SSEParser()
            parts: list[str] = []
            async for data in resp.content.iter_any():
                _take(rep, parser.feed(data), time.perf_counter() - t0, chat, parts)
            _take(rep, parser.finish(), time.perf_counter() - t0, chat, parts)
            rep.text = "".join(parts)
            rep.e2e_s = time.perf_counter() - t0
            return rep
    except (aiohttp.ClientError, ConnectionError) as exc:
        rep = locals().get("rep") or Reply(0, {})
        rep.error = f"{type(exc).__name__}: {exc}"
        rep.e2e_s = time.perf_counter() - t0
        return rep
