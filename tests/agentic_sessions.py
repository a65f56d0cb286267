"""Hand-built agentic sessions for the session driver's tests (tests/test_agentic_replay.py):
workload factories a Locust subprocess loads with ``--kvbench-workload agentic_sessions:NAME``
(this folder is on the subprocesses' PYTHONPATH, see conftest). No trace reader involved."""

from __future__ import annotations

import os

from kvbench.workloads.base import Request, Spawn
from kvbench.workloads.tokenizer import get_tokenizer

MAX_TOKENS = int(os.environ.get("AGENTIC_TEST_MAX_TOKENS", "48"))


def _req(sid: str, turn: int, *, stream: bool = True, offset: float | None = None,
         think: float = 0.0, api: float | None = None) -> Request:
    prompt = f"session {sid} turn {turn} " + " ".join(f"w{sid}x{turn}y{i}" for i in range(40))
    return Request(request_id=f"{sid}-t{turn}", request_class="agent", max_tokens=MAX_TOKENS,
                   prompt_tokens=get_tokenizer().count(prompt), shared_prefix_tokens=0,
                   session_id=sid, turn=turn, prompt=prompt, stream=stream,
                   conversation_offset_s=offset, think_time_s=think, api_time_s=api,
                   min_tokens=MAX_TOKENS)


class ListSession:
    """A session of prepared items (requests and ``Spawn``s), given in order; it keeps the
    answers it was fed."""

    def __init__(self, session_id: str, items: list) -> None:
        self.session_id = session_id
        self.items = list(items)
        self.fed: list[str] = []

    def next_request(self):
        return self.items.pop(0) if self.items else None

    def feed_response(self, text: str) -> None:
        self.fed.append(text)


class ListWorkload:
    name = "agentic-test"
    request_class = "agent"
    has_arrivals = False

    def __init__(self, build) -> None:
        self._build = build  # () -> fresh list of sessions

    def sessions(self):
        return iter(self._build())

    def requests(self):
        def flat(s):
            while (item := s.next_request()) is not None:
                if isinstance(item, Spawn):
                    for sub in item.sessions:
                        yield from flat(sub)
                else:
                    yield item
        for s in self._build():
            yield from flat(s)


def spawn_sessions() -> list:
    """One parent: a turn, three sub-agents of two turns each, the parent's next turn; the
    parent's second turn is sent without streaming (a trace's "type": "n")."""
    subs = tuple(ListSession(f"p-sub{i}", [_req(f"p-sub{i}", 0), _req(f"p-sub{i}", 1)])
                 for i in range(3))
    return [ListSession("p", [_req("p", 0), Spawn(subs), _req("p", 1, stream=False)])]


def timestamp_sessions() -> list:
    """Requests recorded 20 ms apart: an endpoint that answers slower falls behind them."""
    return [ListSession("ts", [_req("ts", k, offset=0.02 * k) for k in range(4)])]


def spawn() -> ListWorkload:
    return ListWorkload(spawn_sessions)


def timestamps() -> ListWorkload:
    return ListWorkload(timestamp_sessions)


# --------------------------------------------------------------------------- a logged endpoint

def serve_logged(options_json: str, log_path: str) -> None:
    """The built-in endpoint on 127.0.0.1 (port 0) whose middleware appends every generation
    request's X-Request-Id, X-Session-ID and JSON body to ``log_path`` (JSON lines): the
    endpoint's request log. Prints ``listening on URL``; runs until killed."""
    import asyncio
    import json

    from aiohttp import web

    from kvbench.endpoints.config import EmulatorConfig
    from kvbench.endpoints.server import EmulatorServer

    log = open(log_path, "a", buffering=1)

    @web.middleware
    async def logged(request, handler):
        if request.path.startswith("/v1/") and request.method == "POST":
            body = json.loads(await request.read())
            log.write(json.dumps([request.headers.get("X-Request-Id"),
                                  request.headers.get("X-Session-ID"), body]) + "\n")
        return await handler(request)

    async def main():
        srv = EmulatorServer(EmulatorConfig(**json.loads(options_json)))
        srv.app.middlewares.append(logged)
        await srv.start()
        print(f"listening on {srv.url}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


if __name__ == "__main__":
    import sys

    serve_logged(sys.argv[1], sys.argv[2])
