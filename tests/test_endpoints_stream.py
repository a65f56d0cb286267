"""The emulator's SSE fast path in process: the engine's step writes to the socket while the
reader keeps up, hands the writes to the handler while it lags, and every token goes out once,
in order, in HTTP/1.1 chunked framing."""

from __future__ import annotations

import asyncio

from kvbench.endpoints import stream
from kvbench.endpoints.seq import Seq


class FakeTransport:
    def __init__(self, out: list):
        self.out = out
        self.buffered = 0  # what get_write_buffer_size reports (bytes)
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(("sink", data))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


class FakeResponse:
    chunked = True

    def __init__(self, out: list):
        self.out = out

    async def write(self, data: bytes) -> None:
        self.out.append(("handler", data))


def pending(a: int, b: int) -> bytes:
    return b"".join(b"<%d>" % i for i in range(a, b))


def step(seq: Seq) -> None:
    """One decode token, delivered as Engine._apply delivers it."""
    seq.generated += 1
    if seq.generated >= seq.max_tokens:
        seq.finished = True
        seq.notify()
    elif seq.sink is not None:
        seq.sink(seq)
    elif seq.waiter is not None and not seq.waiter.done():
        seq.waiter.set_result(None)


def dechunk(data: bytes) -> bytes:
    size, _, rest = data.partition(b"\r\n")
    assert rest[int(size, 16):] == b"\r\n"
    return rest[:int(size, 16)]


def run_push(max_tokens: int, lag_steps: range, close_at: int | None = None):
    async def go():
        out: list = []
        tr, resp = FakeTransport(out), FakeResponse(out)
        seq = Seq("r", 8, [], max_tokens, 0.0)
        seq.generated = 1  # the first token went out with the headers
        task = asyncio.create_task(stream._push(seq, resp, tr, pending, 1))
        for i in range(1, max_tokens):
            await asyncio.sleep(0)  # the handler runs between steps (or not: several steps)
            tr.buffered = stream.LAGGING_READER_BYTES + 1 if i in lag_steps else 0
            tr.closing = i == close_at
            if seq.cancelled:
                break
            step(seq)
        return await asyncio.wait_for(task, 5), out, seq
    return asyncio.run(go())


def test_every_token_once_in_order_across_lag_and_recovery():
    sent, out, seq = run_push(40, lag_steps=range(10, 25))
    assert sent == 40
    body = b"".join(dechunk(d) if who == "sink" else d for who, d in out)
    assert body == pending(1, 40)
    who = [w for w, _ in out]
    assert who[0] == "sink" and "handler" in who and who[-1] == "sink"  # handed back, re-armed
    assert seq.sink is None


def test_client_gone_cancels_the_sequence():
    sent, out, seq = run_push(40, lag_steps=range(0), close_at=5)
    assert sent is None and seq.cancelled and seq.sink is None
    assert b"".join(dechunk(d) for _, d in out) == pending(1, 5)
