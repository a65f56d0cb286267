"""One run's collectors: the local NVML sampler, a scraper per endpoint ``/metrics`` and a puller
per remote agent, all in daemon threads of the calling process, writing ``gpu``/``engine``
shards in the run directory; ``stop()`` gives run.json its telemetry, incomplete and
clock-offset entries."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvbench.collectors.agent import AgentPuller, token_from_env
from kvbench.collectors.nvml import NvmlSampler
from kvbench.collectors.prometheus import PrometheusScraper
from kvbench.collectors.sink import ShardSink
from kvbench.core import store
from kvbench.core.contract import Incomplete
from kvbench.core.errors import DiskFull


def metrics_url_for(endpoint: dict) -> str | None:
    """The endpoint's ``metrics_url``, else its server root + ``/metrics`` (an OpenAI base URL
    ending in ``/v1`` is taken back to the root)."""
    if endpoint.get("metrics_url"):
        return endpoint["metrics_url"]
    url = (endpoint.get("url") or "").rstrip("/")
    if not url:
        return None
    if url.endswith("/v1"):
        url = url[:-3]
    return url + "/metrics"


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Collected:
    """What the collectors give run.json: ``telemetry`` (source -> "ok" or why it is
    missing), ``incomplete`` notes, and ``clock_offsets_ns`` (host -> ns to add to that
    agent's clock)."""

    telemetry: dict[str, str]
    incomplete: list[Incomplete]
    clock_offsets_ns: dict[str, int]


class CollectorHandle:
    """What ``start_collectors`` returns; ``stop()`` once, at the end of the run."""

    def __init__(self, run_dir: Path, cfg, *, gpu_sink: ShardSink, engine_sink: ShardSink,
                 sampler: NvmlSampler | None, scrapers: list[PrometheusScraper],
                 pullers: list[AgentPuller], telemetry: dict[str, str]):
        self.run_dir = run_dir
        self.cfg = cfg
        self.gpu_sink = gpu_sink
        self.engine_sink = engine_sink
        self.sampler = sampler
        self.scrapers = scrapers
        self.pullers = pullers
        self._telemetry = telemetry
        self._result: Collected | None = None
        self._lock = threading.Lock()

    def stop(self, compact: bool = True) -> Collected:
        """Stops every collector (a last scrape and a last pull first), closes the shards,
        compacts them into ``gpu.parquet`` / ``engine.parquet`` when ``compact``, and returns
        what run.json gets of them."""
        with self._lock:
            if self._result is not None:
                return self._result
            telemetry = dict(self._telemetry)
            incomplete: list[Incomplete] = []
            offsets: dict[str, int] = {}
            threads = []
            if self.sampler is not None:
                threads.append(threading.Thread(target=self.sampler.stop))
            threads += [threading.Thread(target=s.stop) for s in self.scrapers]
            threads += [threading.Thread(target=p.stop) for p in self.pullers]
            for t in threads:  # stop in parallel: one slow endpoint must not delay the rest
                t.start()
            for t in threads:
                t.join(30)
            if self.sampler is not None:
                self.sampler.wait_ready(0.1)
                telemetry["nvml"] = ("ok" if self.sampler.status == "ok"
                                     else self.sampler.status)
                if self.sampler.status == "ok" and self.sampler.late_ticks:
                    incomplete.append(Incomplete(
                        "NVML sampling", f"{self.sampler.late_ticks} of {self.sampler.ticks} "
                        f"samples started more than {self.sampler.interval_s} s late"))
            for s in self.scrapers:
                telemetry.update(s.telemetry())
                incomplete += s.incomplete()
            for p in self.pullers:
                telemetry.update(p.telemetry())
                incomplete += p.incomplete()
                if p.host is not None and p.offset_add_ns is not None:
                    offsets[p.host] = p.offset_add_ns
            self.gpu_sink.close()
            self.engine_sink.close()
            for sink in (self.gpu_sink, self.engine_sink):
                if sink.failed is not None:  # the disk is full: its later samples dropped
                    incomplete.append(Incomplete(f"{sink.path.name.split('-')[0]} telemetry",
                                                 f"samples after a failed write dropped: "
                                                 f"{sink.failed}"[:200]))
            for table in ("gpu", "engine") if compact else ():
                try:
                    store.compact(self.run_dir, table)
                except DiskFull as exc:  # its shards stay, whole, for a later compaction
                    incomplete.append(Incomplete(f"{table} telemetry",
                                                 f"not compacted: {exc}"[:200]))
            self._result = Collected(telemetry, incomplete, offsets)
            return self._result


def start_collectors(run_dir: Path, cfg, endpoints: list[dict], *, nvml=None,
                     log: Callable[[str], None] = _log_stderr) -> CollectorHandle:
    """Starts the collectors of ``cfg`` (a ``kvbench.config.CollectConfig``) for ``endpoints``
    (dicts with name, url, metrics_url, topology, and optionally engine: an adapter name or
    "auto") and returns at once; NVML opens in the sampler's own thread. ``nvml`` injects a
    pynvml-like module (tests)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    gpu_sink = ShardSink(run_dir, "gpu")
    engine_sink = ShardSink(run_dir, "engine")
    telemetry: dict[str, str] = {}
    sampler = None
    if cfg.nvml:
        sampler = NvmlSampler(gpu_sink.write, interval_s=cfg.nvml_interval_s, roles=cfg.roles,
                              nvml=nvml, log=log).start()
    else:
        telemetry["nvml"] = "off in bench.toml ([collect] nvml = false)"
    scrapers = []
    for ep in endpoints:
        url = metrics_url_for(ep)
        if url is None:
            telemetry[f"engine:{ep.get('name')}"] = "no metrics_url or url for this endpoint"
            continue
        scrapers.append(PrometheusScraper(
            ep.get("name") or url, url, interval_s=cfg.scrape_interval_s,
            engine_emit=engine_sink.write, gpu_emit=gpu_sink.write, roles=cfg.roles,
            headers=ep.get("metrics_headers"), log=log, engine=ep.get("engine")).start())
    pullers = []
    token = token_from_env(cfg.agent_token_env)
    for url in cfg.agents:
        if cfg.agent_token_env and token is None:
            log(f"kvbench: ${cfg.agent_token_env} ([collect] agent_token_env) is empty; "
                f"pulling from {url} without a token")
        pullers.append(AgentPuller(url, emit=gpu_sink.write, token=token,
                                   interval_s=max(1.0, cfg.scrape_interval_s), roles=cfg.roles,
                                   log=log).start())
    return CollectorHandle(run_dir, cfg, gpu_sink=gpu_sink, engine_sink=engine_sink,
                           sampler=sampler, scrapers=scrapers, pullers=pullers,
                           telemetry=telemetry)
