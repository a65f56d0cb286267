"""A FAKE NVML module for tests, not a GPU: it mimics the parts of pynvml's API that
``collectors.nvml`` calls, with pynvml's real error classes and constants, and counts calls.

Inject it as ``NvmlSampler(..., nvml=FakeNvml([...]))``. Each ``FakeGpu`` can declare functions
it does not support (raise ``NVMLError_NotSupported``), GPM metric ids it does not support, and
functions that fail transiently.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml as _real

NVMLError = _real.NVMLError


@dataclass
class FakeGpu:
    util_pct: int = 50
    mem_util_pct: int = 20
    used_bytes: int = 40 * 2**30
    total_bytes: int = 80 * 2**30
    power_mw: int = 350_000
    sm_clock_mhz: int = 1980
    temperature_c: int = 61
    pcie_rx_kbs: int = 2_000
    pcie_tx_kbs: int = 1_000
    nvlink_rx_kib: int = 5_000
    nvlink_tx_kib: int = 7_000
    gpm: bool = True
    gpm_values: dict = field(default_factory=lambda: {
        _real.NVML_GPM_METRIC_SM_UTIL: 70.0, _real.NVML_GPM_METRIC_SM_OCCUPANCY: 35.0,
        _real.NVML_GPM_METRIC_DRAM_BW_UTIL: 55.0, _real.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 3.0,
        _real.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 4.0})
    unsupported: set = field(default_factory=set)  # function names raising NotSupported
    unsupported_gpm: set = field(default_factory=set)  # GPM metric ids answered NotSupported
    failing: set = field(default_factory=set)  # function names raising NVML_ERROR_UNKNOWN


class _Metric:
    def __init__(self):
        self.metricId = 0
        self.nvmlReturn = 0
        self.value = 0.0


class FakeGpmMetricsGet:
    def __init__(self):
        self.version = 0
        self.numMetrics = 0
        self.sample1 = None
        self.sample2 = None
        self.metrics = [_Metric() for _ in range(16)]


class FakeNvml:
    """Module-like object: constants and ``nvml*`` functions as attributes."""

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None):
        for name in dir(_real):
            if name.startswith(("NVML_", "NVMLError")):
                setattr(self, name, getattr(_real, name))
        self.gpus = gpus
        self.init_error = init_error
        self.calls = Counter()
        self.samples_live = 0
        self.initialised = False
        self.c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet

    def _enter(self, fn: str, handle=None):
        self.calls[fn] += 1
        if not self.initialised:
            raise NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        if handle is not None:
            self.calls[(fn, handle)] += 1
            gpu = self.gpus[handle]
            if fn in gpu.unsupported:
                raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
            if fn in gpu.failing:
                raise NVMLError(_real.NVML_ERROR_UNKNOWN)
            return gpu
        return None

    def nvmlInit(self):
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self):
        self.calls["nvmlShutdown"] += 1
        self.initialised = False

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= i < len(self.gpus):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return i

    def nvmlDeviceGetName(self, h):
        self._enter("nvmlDeviceGetName", h)
        return f"FAKE GPU {h}"

    def nvmlDeviceGetUtilizationRates(self, h):
        g = self._enter("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=g.util_pct, memory=g.mem_util_pct)

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        g = self._enter("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(used=g.used_bytes, total=g.total_bytes,
                               free=g.total_bytes - g.used_bytes)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._enter("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetClockInfo(self, h, kind):
        g = self._enter("nvmlDeviceGetClockInfo", h)
        assert kind == _real.NVML_CLOCK_SM
        return g.sm_clock_mhz

    def nvmlDeviceGetTemperature(self, h, sensor):
        g = self._enter("nvmlDeviceGetTemperature", h)
        assert sensor == _real.NVML_TEMPERATURE_GPU
        return g.temperature_c

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        g = self._enter("nvmlDeviceGetPcieThroughput", h)
        return g.pcie_rx_kbs if counter == _real.NVML_PCIE_UTIL_RX_BYTES else g.pcie_tx_kbs

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        g = self._enter("nvmlDeviceGetFieldValues", h)
        out = []
        for fid, scope in field_ids:
            assert scope == 0xFFFFFFFF
            v = {_real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: g.nvlink_rx_kib,
                 _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: g.nvlink_tx_kib}[fid]
            out.append(SimpleNamespace(nvmlReturn=0, valueType=_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                                       value=SimpleNamespace(ullVal=v)))
        return out

    # GPM
    def nvmlGpmQueryDeviceSupport(self, h):
        g = self._enter("nvmlGpmQueryDeviceSupport", h)
        return SimpleNamespace(version=1, isSupportedDevice=int(g.gpm))

    def nvmlGpmSampleAlloc(self):
        self._enter("nvmlGpmSampleAlloc")
        self.samples_live += 1
        return SimpleNamespace(device=None, t=None, freed=False)

    def nvmlGpmSampleFree(self, s):
        self._enter("nvmlGpmSampleFree")
        assert not s.freed
        s.freed = True
        self.samples_live -= 1

    def nvmlGpmSampleGet(self, h, s):
        self._enter("nvmlGpmSampleGet", h)
        s.device, s.t = h, time.monotonic_ns()
        return s

    def nvmlGpmMetricsGet(self, mg):
        self._enter("nvmlGpmMetricsGet")
        s1, s2 = mg.sample1, mg.sample2
        if (mg.version != _real.NVML_GPM_METRICS_GET_VERSION or s1.device is None
                or s1.device != s2.device or not s2.t > s1.t):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        g = self.gpus[s1.device]
        for m in mg.metrics[:mg.numMetrics]:
            if m.metricId in g.unsupported_gpm or m.metricId not in g.gpm_values:
                m.nvmlReturn, m.value = _real.NVML_ERROR_NOT_SUPPORTED, 0.0
            else:
                m.nvmlReturn, m.value = 0, g.gpm_values[m.metricId]
        return mg
