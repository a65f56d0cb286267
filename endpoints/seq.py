"""One request as the engines see it, and how a handler task waits for its progress."""

from __future__ import annotations

import asyncio
from typing import Callable


class Seq:
    """One request inside the engines. Times are ``loop.time()`` seconds."""

    __slots__ = ("rid", "n_prompt", "hashes", "max_tokens", "target", "computed", "generated",
                 "held", "anon", "cached_tokens", "load_ms", "first_admit", "waiter",
                 "finished", "error", "cancelled", "replica", "region", "prefilled",
                 "t_arrival", "t_scheduled", "t_prefill_done", "t_transfer_done", "t_first",
                 "t_done", "preemptions", "kv_transfer_ms", "network_ms", "sink",
                 "model_first_s", "model_decode_s")

    def __init__(self, rid: str, n_prompt: int, hashes: list[int], max_tokens: int,
                 t_arrival: float):
        self.rid = rid
        self.n_prompt = n_prompt
        self.hashes = hashes
        self.max_tokens = max_tokens
        self.target = n_prompt  # tokens whose KV must exist before decoding (grows on preemption)
        self.computed = 0
        self.generated = 0
        self.held: list[int] = []
        self.anon = 0
        self.cached_tokens = 0
        self.load_ms = 0.0
        self.first_admit = True
        self.waiter: asyncio.Future | None = None
        self.finished = False
        self.error: tuple[int, str, str] | None = None  # (status, type, message)
        self.cancelled = False
        self.replica = ""
        self.region = ""
        self.prefilled = False
        self.t_arrival = t_arrival
        self.t_scheduled = None
        self.t_prefill_done = None
        self.t_transfer_done = None
        self.t_first = None
        self.t_done = None
        # modelled wall seconds to its first token: front end, network, KV transfer and the
        # steps it took part in, as planned (waits behind other requests and a busy host's
        # late wake-ups are not in it)
        self.model_first_s = 0.0
        # modelled wall seconds of the decode steps after its first token (same exclusions)
        self.model_decode_s = 0.0
        self.preemptions = 0
        self.kv_transfer_ms = 0.0
        self.network_ms = 0.0
        # Called with this Seq when tokens are ready (the server writes them to the socket
        # right here); None: the handler task is woken through ``waiter`` instead.
        self.sink: Callable[[Seq], None] | None = None

    def notify(self) -> None:
        if self.sink is not None:
            self.sink(self)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, status: int, etype: str, message: str) -> None:
        self.error = (status, etype, message)
        self.finished = True
        self.notify()


async def wait(seq: Seq, cond: Callable[[], bool]) -> None:
    """Sleep until ``cond()`` holds, woken by the engine through ``seq.waiter``."""
    loop = asyncio.get_running_loop()
    while not cond():
        seq.waiter = loop.create_future()
        try:
            await seq.waiter
        finally:
            seq.waiter = None
