"""The emulator on a socket: ``EmulatorServer`` runs the app of ``app.py`` on ``host:port``
inside the running event loop (``kvbench serve``, tests, benchmarks)."""

from __future__ import annotations

from aiohttp import web

from kvbench.endpoints.app import CLUSTER_KEY, create_app
from kvbench.endpoints.cluster import Cluster
from kvbench.endpoints.config import EmulatorConfig


class EmulatorServer:
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
        # handler_cancellation: a client that goes away cancels its handler, so a request
        # still queued leaves the queue at once, as vLLM and SGLang abort a disconnected
        # request; without it a queued request was noticed only when its first token failed
        # to write, so a cut probe's backlog was prefilled anyway and weighed on the next
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the real port when 0 was asked for
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()
