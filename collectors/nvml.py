"""NVML sampler: per-GPU utilisation, HBM, power, clocks, PCIe/NVLink traffic and (Hopper+) GPM
SM/DRAM activity, sampled in a daemon thread into ``kvbench.schema.GPU`` record batches.

Every NVML call that a GPU answers with NotSupported (or no permission / no such function) is
remembered per GPU and never retried, so an unsupported field costs one call per run, not one
per sample. Without pynvml, the NVML library, a driver or a GPU, the sampler says why once in
``status`` and produces nothing; it never raises into the run.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from kvbench.collectors.roles import role_for
from kvbench.collectors.sink import Columns
from kvbench.core.schema import GPU

UINT_MAX = 0xFFFFFFFF  # NVML field scopeId meaning "sum over all NVLink links"
KIB = 1024
MIB = 1024 * 1024
# nvmlDeviceGetPcieThroughput reports KB/s over a 20 ms window and blocks for it (NVML API
# reference), so without GPM it is read at most once per this period.
LEGACY_PCIE_PERIOD_S = 1.0


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_nvml():
    """The pynvml module, or None when nvidia-ml-py is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def init_reason(nv, exc: BaseException) -> str:
    """One sentence for why NVML could not start on this host."""
    code = getattr(exc, "value", None)
    if code == getattr(nv, "NVML_ERROR_LIBRARY_NOT_FOUND", 12):
        return "no NVML library (libnvidia-ml.so) on this host: no NVIDIA driver installed"
    if code == getattr(nv, "NVML_ERROR_DRIVER_NOT_LOADED", 9):
        return "the NVIDIA driver is not loaded on this host"
    if code == getattr(nv, "NVML_ERROR_NO_PERMISSION", 4):
        return "no permission to open NVML on this host"
    return f"NVML failed to start: {exc}"


@dataclass
class _Device:
    index: int
    handle: object
    role: str
    unsupported: set[str] = field(default_factory=set)
    gpm_ids: list[tuple[str, int]] = field(default_factory=list)
    gpm_prev: object = None
    gpm_cur: object = None
    pcie_next_mono: float = 0.0


class NvmlSampler:
    """Samples every local GPU each ``interval_s`` in its own daemon thread.

    ``emit(batch)`` receives ``kvbench.schema.GPU`` record batches, one about every
    ``flush_every_s`` and a last one on ``stop()``; ``nvml`` injects a module with pynvml's API
    (tests pass a fake; default: the real pynvml).
    """

    def __init__(self, emit: Callable[[pa.RecordBatch], None], *, interval_s: float = 0.1,
                 roles=(), host: str | None = None, nvml=None, flush_every_s: float = 1.0,
                 log: Callable[[str], None] = _log_stderr,
                 clock_ns: Callable[[], int] = time.time_ns):
        self.emit = emit
        self.clock_ns = clock_ns  # epoch ns; injectable so tests can skew a host's clock
        self.interval_s = float(interval_s)
        self.roles = list(roles)
        self.host = host or socket.gethostname()
        self._nvml = nvml
        self.flush_every_s = flush_every_s
        self.log = log
        self.status = "starting"
        self.ticks = 0
        self.rows = 0
        self.late_ticks = 0  # ticks that started more than one interval late
        self.errors = 0  # transient NVML errors (a null field for that sample)
        self.last_error: str | None = None
        self.devices: list[_Device] = []
        self._buf = Columns(GPU)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._nv = None
        self._permanent: set[int] = set()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "NvmlSampler":
        self._thread = threading.Thread(target=self._run, name="kvbench-nvml", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> str:
        """Block until NVML is open (or known to be missing); returns ``status``."""
        self._ready.wait(timeout_s)
        return self.status

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def unsupported(self) -> dict[int, list[str]]:
        return {d.index: sorted(d.unsupported) for d in self.devices}

    # ---- thread body -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if not self._open():
                return
            next_t = time.monotonic()
            last_flush = next_t
            while not self._stop.is_set():
                self._tick()
                now = time.monotonic()
                if now - last_flush >= self.flush_every_s:
                    self._flush()
                    last_flush = now
                next_t += self.interval_s
                if next_t < now:  # overran: skip the missed ticks rather than burst
                    self.late_ticks += 1
                    next_t = now + self.interval_s
                self._stop.wait(next_t - now)
            self._flush()
        except Exception as exc:  # a bug or a lost GPU must not take the run down
            self.status = f"NVML sampler stopped: {type(exc).__name__}: {exc}"
            self.log(f"kvbench: GPU telemetry (NVML) stopped: {exc}")
            try:
                self._flush()
            except Exception:
                pass
        finally:
            self._ready.set()
            self._close()

    def _open(self) -> bool:
        nv = self._nvml if self._nvml is not None else load_nvml()
        if nv is None:
            return self._missing("nvidia-ml-py (pynvml) is not installed")
        self._nv = nv
        try:
            nv.nvmlInit()
        except Exception as exc:
            self._nv = None
            return self._missing(init_reason(nv, exc))
        self._permanent = {getattr(nv, n, d) for n, d in (
            ("NVML_ERROR_NOT_SUPPORTED", 3), ("NVML_ERROR_NO_PERMISSION", 4),
            ("NVML_ERROR_FUNCTION_NOT_FOUND", 13), ("NVML_ERROR_INVALID_ARGUMENT", 2))}
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:
            return self._missing(f"NVML could not count GPUs: {exc}")
        if count == 0:
            return self._missing("NVML found no GPU on this host")
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:
                self.errors += 1
                self.last_error = f"GPU {i}: {exc}"
                continue
            dev = _Device(i, handle, role_for(self.roles, self.host, i))
            self._gpm_open(dev)
            self.devices.append(dev)
        if not self.devices:
            return self._missing(f"NVML could not open any GPU ({self.last_error})")
        self.status = "ok"
        self._ready.set()
        return True

    def _missing(self, reason: str) -> bool:
        self.status = reason
        self.log(f"kvbench: GPU telemetry (NVML) off: {reason}; the run goes on without it")
        self._ready.set()
        return False

    def _close(self) -> None:
        nv = self._nv
        if nv is None:
            return
        for d in self.devices:
            for s in (d.gpm_prev, d.gpm_cur):
                if s is not None:
                    try:
                        nv.nvmlGpmSampleFree(s)
                    except Exception:
                        pass
            d.gpm_prev = d.gpm_cur = None
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
        self._nv = None

    # ---- one NVML call with the unsupported memo -------------------------------------------
    def _call(self, dev: _Device, what: str, fn_name: str, *args):
        if what in dev.unsupported:
            return None
        fn = getattr(self._nv, fn_name, None)
        if fn is None:  # an older pynvml without this function
            dev.unsupported.add(what)
            return None
        try:
            return fn(*args)
        except Exception as exc:
            if getattr(exc, "value", None) in self._permanent:
                dev.unsupported.add(what)
            else:
                self.errors += 1
                self.last_error = f"GPU {dev.index} {what}: {exc}"
            return None

    # ---- GPM (Hopper and later) ------------------------------------------------------------
    def _gpm_open(self, dev: _Device) -> None:
        nv = self._nv
        sup = self._call(dev, "gpm", "nvmlGpmQueryDeviceSupport", dev.handle)
        if sup is None or not getattr(sup, "isSupportedDevice", 0):
            dev.unsupported.add("gpm")
            return
        wanted = [("sm_active", "NVML_GPM_METRIC_SM_UTIL"),
                  ("sm_occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY"),
                  ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
                  ("pcie_tx_bytes_s", "NVML_GPM_METRIC_PCIE_TX_PER_SEC"),
                  ("pcie_rx_bytes_s", "NVML_GPM_METRIC_PCIE_RX_PER_SEC")]
        dev.gpm_ids = [(col, getattr(nv, const)) for col, const in wanted if hasattr(nv, const)]
        a = self._call(dev, "gpm", "nvmlGpmSampleAlloc")
        b = self._call(dev, "gpm", "nvmlGpmSampleAlloc")
        if a is None or b is None or self._call(dev, "gpm", "nvmlGpmSampleGet",
                                                dev.handle, a) is None:
            dev.unsupported.add("gpm")
            for s in (a, b):
                if s is not None:
                    try:
                        nv.nvmlGpmSampleFree(s)
                    except Exception:
                        pass
            return
        dev.gpm_prev, dev.gpm_cur = a, b

    def _gpm_read(self, dev: _Device, row: dict) -> None:
        if "gpm" in dev.unsupported or not dev.gpm_ids:
            return
        nv = self._nv
        if self._call(dev, "gpm", "nvmlGpmSampleGet", dev.handle, dev.gpm_cur) is None:
            return
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(dev.gpm_ids)
        mg.sample1 = dev.gpm_prev
        mg.sample2 = dev.gpm_cur
        for i, (_, mid) in enumerate(dev.gpm_ids):
            mg.metrics[i].metricId = mid
        dev.gpm_prev, dev.gpm_cur = dev.gpm_cur, dev.gpm_prev  # this sample starts the next
        if self._call(dev, "gpm", "nvmlGpmMetricsGet", mg) is None:
            return
        keep = []
        for i, (col, mid) in enumerate(dev.gpm_ids):
            m = mg.metrics[i]
            if m.nvmlReturn == 0:
                v = float(m.value)
                # SM/occupancy/DRAM are percent 0..100 (schema: 0..1); PCIe is MiB/s
                row[col] = v * MIB if col.startswith("pcie") else v / 100.0
                keep.append((col, mid))
            elif m.nvmlReturn in self._permanent:
                dev.unsupported.add(f"gpm:{col}")
            else:
                keep.append((col, mid))
                self.errors += 1
                self.last_error = f"GPU {dev.index} gpm:{col}: NVML return {m.nvmlReturn}"
        dev.gpm_ids = keep

    # ---- one sample ------------------------------------------------------------------------
    def _tick(self) -> None:
        nv = self._nv
        for dev in self.devices:
            h = dev.handle
            row = {"t_ns": self.clock_ns(), "host": self.host, "gpu": dev.index,
                   "role": dev.role, "source": "nvml"}
            u = self._call(dev, "utilization", "nvmlDeviceGetUtilizationRates", h)
            if u is not None:
                row["gpu_util_pct"] = float(u.gpu)
                row["mem_util_pct"] = float(u.memory)
            m = self._call(dev, "memory", "nvmlDeviceGetMemoryInfo", h)
            if m is not None:
                row["hbm_used_bytes"] = int(m.used)
                row["hbm_total_bytes"] = int(m.total)
            p = self._call(dev, "power", "nvmlDeviceGetPowerUsage", h)
            if p is not None:
                row["power_w"] = p / 1000.0  # NVML reports milliwatts
            c = self._call(dev, "sm_clock", "nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM)
            if c is not None:
                row["sm_clock_mhz"] = float(c)
            t = self._call(dev, "temperature", "nvmlDeviceGetTemperature", h,
                           nv.NVML_TEMPERATURE_GPU)
            if t is not None:
                row["temperature_c"] = float(t)
            self._gpm_read(dev, row)
            if "pcie_rx_bytes_s" not in row:
                self._legacy_pcie(dev, row)
            self._nvlink(dev, row)
            self._buf.append(row)
        self.ticks += 1

    def _legacy_pcie(self, dev: _Device, row: dict) -> None:
        now = time.monotonic()
        if now < dev.pcie_next_mono:
            return
        dev.pcie_next_mono = now + LEGACY_PCIE_PERIOD_S
        nv = self._nv
        rx = self._call(dev, "pcie", "nvmlDeviceGetPcieThroughput", dev.handle,
                        nv.NVML_PCIE_UTIL_RX_BYTES)
        tx = self._call(dev, "pcie", "nvmlDeviceGetPcieThroughput", dev.handle,
                        nv.NVML_PCIE_UTIL_TX_BYTES) if rx is not None else None
        if rx is not None and tx is not None:
            row["pcie_rx_bytes_s"] = rx * 1024.0  # KB/s, KB = 1024 bytes as nvidia-smi uses
            row["pcie_tx_bytes_s"] = tx * 1024.0

    def _nvlink(self, dev: _Device, row: dict) -> None:
        nv = self._nv
        ids = [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX),
               (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX)]
        vals = self._call(dev, "nvlink", "nvmlDeviceGetFieldValues", dev.handle, ids)
        if vals is None:
            return
        out = []
        for v in vals:
            if v.nvmlReturn != 0:
                if v.nvmlReturn in self._permanent:
                    dev.unsupported.add("nvlink")
                return
            out.append(_field_value(v))
        # cumulative KiB summed over links (scopeId UINT_MAX); kept raw as bytes
        row["nvlink_rx_bytes"] = int(out[0]) * KIB
        row["nvlink_tx_bytes"] = int(out[1]) * KIB

    def _flush(self) -> None:
        batch = self._buf.take_batch()
        if batch is not None:
            self.rows += batch.num_rows
            self.emit(batch)


_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                 6: "usVal"}  # NVML_VALUE_TYPE_* -> member of nvmlValue_t


def _field_value(v):
    return getattr(v.value, _VALUE_FIELDS.get(v.valueType, "ullVal"))
