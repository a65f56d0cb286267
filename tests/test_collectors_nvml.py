"""The NVML sampler through its interface, against the FAKE NVML of tests/fake_nvml.py."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pynvml

import kvbench.collectors.nvml as cnvml
from kvbench.collectors.nvml import NvmlSampler
from kvbench.config import GpuRole
from kvbench.core.schema import GPU
from fake_nvml import FakeGpu, FakeNvml


class Collect:
    def __init__(self):
        self.batches = []
        self.lock = threading.Lock()

    def __call__(self, batch):
        assert batch.schema == GPU
        with self.lock:
            self.batches.append(batch)

    def table(self) -> pa.Table:
        return pa.Table.from_batches(self.batches, schema=GPU)


def run_sampler(nv, seconds=0.35, **kw):
    out, logs = Collect(), []
    s = NvmlSampler(out, interval_s=0.02, nvml=nv, host="gpuhost", flush_every_s=0.1,
                    log=logs.append, **kw)
    t0 = time.time_ns()
    s.start()
    s.wait_ready(5)
    time.sleep(seconds)
    s.stop()
    t1 = time.time_ns()
    return s, out.table(), logs, (t0, t1)


def test_full_and_partial_support_with_roles():
    full = FakeGpu()
    partial = FakeGpu(gpm=False, unsupported={"nvmlDeviceGetPowerUsage",
                                              "nvmlDeviceGetFieldValues"})
    nv = FakeNvml([full, partial])
    roles = [GpuRole(host="gpu*", gpus=[0], role="prefill"),
             GpuRole(host="other", role="decode")]
    s, t, logs, (t0, t1) = run_sampler(nv, roles=roles)
    assert s.status == "ok" and logs == []
    rows = t.to_pylist()
    g0 = [r for r in rows if r["gpu"] == 0]
    g1 = [r for r in rows if r["gpu"] == 1]
    assert len(g0) >= 5 and len(g1) == len(g0) == s.ticks
    assert all(t0 <= r["t_ns"] <= t1 for r in rows)
    assert [r["t_ns"] for r in g0] == sorted(r["t_ns"] for r in g0)
    r = g0[-1]
    assert (r["host"], r["role"], r["source"]) == ("gpuhost", "prefill", "nvml")
    assert r["gpu_util_pct"] == 50.0 and r["mem_util_pct"] == 20.0
    assert (r["hbm_used_bytes"], r["hbm_total_bytes"]) == (40 * 2**30, 80 * 2**30)
    assert r["power_w"] == 350.0 and r["sm_clock_mhz"] == 1980.0 and r["temperature_c"] == 61.0
    # GPM: percent -> 0..1, PCIe MiB/s -> bytes/s
    assert (r["sm_active"], r["sm_occupancy"], r["dram_active"]) == (0.70, 0.35, 0.55)
    assert r["pcie_rx_bytes_s"] == 4.0 * 2**20 and r["pcie_tx_bytes_s"] == 3.0 * 2**20
    assert (r["nvlink_rx_bytes"], r["nvlink_tx_bytes"]) == (5000 * 1024, 7000 * 1024)
    # GPM gave PCIe for GPU 0, so the blocking legacy call was never made for it
    assert nv.calls[("nvmlDeviceGetPcieThroughput", 0)] == 0
    # GPU 1: unsupported fields are null and asked once only
    assert all(r["role"] == "unknown" for r in g1)
    assert all(r["power_w"] is None and r["nvlink_rx_bytes"] is None for r in g1)
    assert all(r["sm_active"] is None for r in g1)
    assert nv.calls[("nvmlDeviceGetPowerUsage", 1)] == 1
    assert nv.calls[("nvmlDeviceGetFieldValues", 1)] == 1
    assert nv.calls[("nvmlDeviceGetPowerUsage", 0)] == s.ticks
    # legacy PCIe (no GPM) is read on the first sample, then at most once a second
    with_pcie = [r for r in g1 if r["pcie_rx_bytes_s"] is not None]
    assert len(with_pcie) == 1 and with_pcie[0]["pcie_rx_bytes_s"] == 2000 * 1024.0
    assert s.unsupported == {0: [], 1: ["gpm", "nvlink", "power"]}
    assert s.errors == 0
    # resources given back
    assert nv.samples_live == 0 and nv.calls["nvmlShutdown"] == 1


def test_unsupported_gpm_metric_and_transient_errors():
    g = FakeGpu(unsupported_gpm={pynvml.NVML_GPM_METRIC_SM_OCCUPANCY},
                failing={"nvmlDeviceGetTemperature"})
    nv = FakeNvml([g])
    s, t, _, _ = run_sampler(nv, seconds=0.2)
    rows = t.to_pylist()
    assert rows and all(r["sm_occupancy"] is None for r in rows)
    assert all(r["sm_active"] == 0.7 for r in rows)
    assert "gpm:sm_occupancy" in s.unsupported[0]
    # transient failures are retried every sample and counted, never memoised
    assert all(r["temperature_c"] is None for r in rows)
    assert nv.calls[("nvmlDeviceGetTemperature", 0)] == s.ticks == s.errors
    assert "temperature" not in s.unsupported[0] and "Unknown" in s.last_error


def test_nvml_library_missing_gives_one_message_and_no_rows():
    nv = FakeNvml([FakeGpu()], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    s, t, logs, _ = run_sampler(nv, seconds=0.05)
    assert t.num_rows == 0
    assert "no NVML library" in s.status
    assert len(logs) == 1 and "the run goes on" in logs[0]
    assert not s._thread.is_alive()


def test_driver_not_loaded_and_no_gpu(monkeypatch):
    s, _, _, _ = run_sampler(FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), 0.01)
    assert s.status == "the NVIDIA driver is not loaded on this host"
    s, t, logs, _ = run_sampler(FakeNvml([]), 0.01)
    assert s.status == "NVML found no GPU on this host" and t.num_rows == 0 and len(logs) == 1
    monkeypatch.setattr(cnvml, "load_nvml", lambda: None)
    s, _, _, _ = run_sampler(None, 0.01)
    assert s.status == "nvidia-ml-py (pynvml) is not installed"


def test_real_pynvml_without_driver_reports_missing():
    # this machine has no NVIDIA driver: the real module must fail cleanly, not raise
    s, t, logs, _ = run_sampler(None, seconds=0.01)
    if s.status == "ok":  # a GPU host: the sampler must have produced rows
        assert t.num_rows > 0
    else:
        assert t.num_rows == 0 and len(logs) == 1
