"""Scrapes Prometheus text (engine ``/metrics`` of vLLM, SGLang, LMCache, Dynamo, llama.cpp, and
the DCGM exporter) into raw ``engine`` rows, and maps DCGM GPU series into ``gpu`` rows.

Counters are stored raw; rates are the reports' job. Parsing uses prometheus_client's
maintained text parser. Which engine family a ``/metrics`` page belongs to, and what its names
mean, is the engine adapters' knowledge (``kvbench.engines``); nothing here spells an engine's
metric name.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client.parser import text_string_to_metric_families

from kvbench.collectors.roles import role_for
from kvbench.collectors.sink import Columns
from kvbench.core.contract import Incomplete
from kvbench.core.schema import ENGINE, GPU
from kvbench.engines import EngineAdapter, detect, get

MIB = 1024 * 1024
# The most one /metrics page may hold. Real pages are a few hundred KB (vLLM's histograms per
# model and LoRA adapter, DCGM's fields per GPU of an 8-GPU host) to a few MB (a router or
# multi-model server labelling every series per replica): 16 MiB leaves room for those, while
# an answer that never ends is cut within a second of reads instead of filling memory.
METRICS_MAX_BYTES = 16 * MIB


def read_bounded(resp, url: str, max_bytes: int, deadline: float) -> bytes:
    """The body of ``resp`` (an open urllib response), at most ``max_bytes`` and read by the
    monotonic ``deadline``: urllib's timeout covers only each wait for bytes, so a server that
    keeps sending never trips it. A breach raises ``ValueError`` or ``TimeoutError``."""
    body = bytearray()
    while True:
        part = resp.read1(65536)
        if not part:
            return bytes(body)
        body += part
        if len(body) > max_bytes:
            raise ValueError(f"{url} answered more than {max_bytes:,} bytes (the client's "
                             "limit; a server streaming without end?)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} was still answering after its deadline")


def get_bounded(url: str, headers: dict | None = None, timeout_s: float = 10.0,
                max_bytes: int = METRICS_MAX_BYTES) -> str:
    """One GET of a text page (``/metrics``), whole within ``timeout_s`` and ``max_bytes``."""
    deadline = time.monotonic() + timeout_s
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        body = read_bounded(resp, url, max_bytes, deadline)
        return body.decode(resp.headers.get_content_charset() or "utf-8", "replace")

# dcgm-exporter series -> (gpu column, factor). Units from the DCGM field reference:
# FB_* in MiB, POWER_USAGE in W, SM_CLOCK in MHz, GPU_TEMP in C, PROF_PCIE_*_BYTES in bytes/s,
# PROF_* activity ratios in 0..1, DEV_*_UTIL in percent.
DCGM_TO_GPU: dict[str, tuple[str, float]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("gpu_util_pct", 1.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("mem_util_pct", 1.0),
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active", 1.0),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("sm_occupancy", 1.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("dram_active", 1.0),
    "DCGM_FI_DEV_FB_USED": ("hbm_used_bytes", MIB),
    "DCGM_FI_DEV_FB_TOTAL": ("hbm_total_bytes", MIB),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1.0),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", 1.0),
    "DCGM_FI_DEV_GPU_TEMP": ("temperature_c", 1.0),
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("pcie_rx_bytes_s", 1.0),
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("pcie_tx_bytes_s", 1.0),
}
_FB_PARTS = ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED")
_INT_COLS = {"hbm_used_bytes", "hbm_total_bytes"}


def parse_metrics(text: str, *, t_ns: int, endpoint: str, roles=(),
                  default_host: str | None = None) -> tuple[pa.RecordBatch, pa.RecordBatch | None]:
    """One scrape's text -> (``engine`` batch of every sample, ``gpu`` batch of the DCGM series
    or None when there are none). Raises ValueError on text that is not Prometheus format."""
    metrics, labels, values = [], [], []
    gpus: dict[tuple[str | None, int], dict] = {}
    fb: dict[tuple[str | None, int], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            metrics.append(s.name)
            labels.append(s.labels)
            values.append(float(s.value))
            if not s.name.startswith("DCGM_FI_"):
                continue
            col = DCGM_TO_GPU.get(s.name)
            if col is None and s.name not in _FB_PARTS:
                continue
            try:
                gpu = int(s.labels.get("gpu", ""))
            except ValueError:
                continue
            host = s.labels.get("Hostname") or default_host
            key = (host, gpu)
            row = gpus.get(key)
            if row is None:
                role = s.labels.get("role") or role_for(roles, host, gpu)
                row = gpus[key] = {"t_ns": t_ns, "host": host, "gpu": gpu, "role": role,
                                   "source": "dcgm", "endpoint": endpoint}
            if s.name in _FB_PARTS:
                fb.setdefault(key, {})[s.name] = float(s.value)
            if col is not None:
                name, factor = col
                v = float(s.value) * factor
                row[name] = int(v) if name in _INT_COLS else v
    n = len(metrics)
    engine = pa.RecordBatch.from_arrays(
        [pa.array([t_ns] * n, pa.int64()), pa.array([endpoint] * n, pa.string()),
         pa.array(metrics, pa.string()), pa.array(labels, ENGINE.field("labels").type),
         pa.array(values, pa.float64())], schema=ENGINE)
    if not gpus:
        return engine, None
    cols = Columns(GPU)
    for key, row in gpus.items():
        parts = fb.get(key, {})
        if "hbm_total_bytes" not in row and "DCGM_FI_DEV_FB_USED" in parts \
                and "DCGM_FI_DEV_FB_FREE" in parts:
            row["hbm_total_bytes"] = int(sum(parts.values()) * MIB)
        cols.append(row)
    return engine, cols.take_batch()


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class PrometheusScraper:
    """Scrapes one ``/metrics`` URL every ``interval_s`` in a daemon thread (blocking urllib,
    short timeout); a failed scrape is counted with its last error, never raised.

    ``engine`` names the endpoint's engine family (an adapter name); None or "auto": detected
    from the metric names of the scrapes until one is recognised."""

    def __init__(self, endpoint: str, url: str, *, interval_s: float = 1.0,
                 engine_emit: Callable[[pa.RecordBatch], None],
                 gpu_emit: Callable[[pa.RecordBatch], None] | None = None, roles=(),
                 timeout_s: float | None = None, headers: dict | None = None,
                 log: Callable[[str], None] = _log_stderr, engine: str | None = None):
        self.endpoint = endpoint
        self.adapter: EngineAdapter | None = None if engine in (None, "auto") else get(engine)
        self.url = url
        self.interval_s = float(interval_s)
        self.timeout_s = timeout_s if timeout_s is not None else max(0.5, min(3.0, interval_s))
        self.engine_emit = engine_emit
        self.gpu_emit = gpu_emit
        self.roles = list(roles)
        self.headers = dict(headers or {})
        self.log = log
        self.scrapes = 0
        self.failures = 0
        self.last_error: str | None = None
        self.engine_rows = 0
        self.gpu_rows = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PrometheusScraper":
        self._thread = threading.Thread(target=self._run, name=f"kvbench-scrape-{self.endpoint}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0, final: bool = True) -> None:
        """Stops the loop; with ``final`` one last scrape is taken so counters cover the end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if final:
            self.scrape_once()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.scrape_once()
            next_t += self.interval_s
            now = time.monotonic()
            if next_t < now:
                next_t = now + self.interval_s
            self._stop.wait(next_t - now)

    def scrape_once(self) -> bool:
        self.scrapes += 1
        req = urllib.request.Request(self.url, headers={"Accept": "text/plain", **self.headers})
        try:
            t0 = time.time_ns()
            deadline = time.monotonic() + self.timeout_s
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = read_bounded(resp, self.url, METRICS_MAX_BYTES, deadline)
                charset = resp.headers.get_content_charset() or "utf-8"
            t1 = time.time_ns()
            engine, gpu = parse_metrics(body.decode(charset, "replace"), t_ns=(t0 + t1) // 2,
                                        endpoint=self.endpoint, roles=self.roles)
        except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
            self.failures += 1
            if isinstance(exc, urllib.error.HTTPError):
                self.last_error = f"HTTP {exc.code} {exc.reason}"[:200]
            else:
                reason = getattr(exc, "reason", None) or exc
                self.last_error = f"{type(exc).__name__}: {reason}"[:200]
            if self.failures == 1:
                self.log(f"kvbench: scrape of {self.url} ({self.endpoint}) failed: "
                         f"{self.last_error}; will keep trying")
            return False
        if self.adapter is None and engine.num_rows:
            self.adapter = detect(pc.unique(engine.column("metric")).to_pylist())
        self.engine_rows += engine.num_rows
        self.engine_emit(engine)
        if gpu is not None and self.gpu_emit is not None:
            self.gpu_rows += gpu.num_rows
            self.gpu_emit(gpu)
        return True

    def telemetry(self) -> dict[str, str]:
        ok = self.scrapes - self.failures
        out = {f"engine:{self.endpoint}": "ok" if ok else
               f"no successful scrape of {self.url} ({self.last_error or 'never scraped'})"}
        if self.adapter is not None or ok:  # an adapter name, for the reports to look up
            out[f"engine_family:{self.endpoint}"] = \
                self.adapter.name if self.adapter is not None else "unknown"
        if self.gpu_rows:
            out[f"dcgm:{self.endpoint}"] = "ok"
        return out

    def incomplete(self) -> list[Incomplete]:
        if not self.failures:
            return []
        return [Incomplete(f"scrape of {self.url} ({self.endpoint})",
                           f"{self.failures} of {self.scrapes} scrapes failed; last: "
                           f"{self.last_error}")]
