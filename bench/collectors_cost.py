"""CPU cost of the collectors: the NVML sampler at 100 ms (FAKE NVML from tests/fake_nvml.py,
so this measures kvbench's own per-sample overhead, not the driver's) and one /metrics scraper
against a vLLM-sized exposition served by a separate process.

    /work/venv/bin/python bench/collectors_cost.py [--seconds 10] [--gpus 8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kvbench.collectors.nvml import NvmlSampler  # noqa: E402
from kvbench.collectors.prometheus import PrometheusScraper, parse_metrics  # noqa: E402
from kvbench.collectors.sink import ShardSink  # noqa: E402
from fake_nvml import FakeGpu, FakeNvml  # noqa: E402


def vllm_sized_exposition(gpus: int) -> str:
    """About the size of a vLLM /metrics page (92 families, histograms) plus DCGM for N GPUs."""
    lines = []
    for i in range(60):
        lines += [f"# TYPE vllm:gauge_{i} gauge", f'vllm:gauge_{i}{{model_name="m",engine="0"}} {i}.5']
    for i in range(30):
        lines.append(f"# TYPE vllm:hist_{i}_seconds histogram")
        for le in (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, "+Inf"):
            lines.append(f'vllm:hist_{i}_seconds_bucket{{le="{le}",model_name="m"}} 42')
        lines += [f'vllm:hist_{i}_seconds_sum{{model_name="m"}} 1.5',
                  f'vllm:hist_{i}_seconds_count{{model_name="m"}} 42']
    for g in range(gpus):
        lab = f'gpu="{g}",UUID="GPU-{g}",Hostname="h",role="decode"'
        for f in ("DEV_GPU_UTIL", "PROF_SM_ACTIVE", "PROF_SM_OCCUPANCY", "PROF_DRAM_ACTIVE",
                  "DEV_FB_USED", "DEV_FB_FREE", "DEV_POWER_USAGE", "DEV_SM_CLOCK",
                  "DEV_GPU_TEMP", "PROF_PCIE_RX_BYTES", "PROF_PCIE_TX_BYTES"):
            lines.append(f"DCGM_FI_{f}{{{lab}}} 1")
    return "\n".join(lines) + "\n"


def cpu_during(seconds: float, start, stop) -> tuple[float, float]:
    """Process CPU seconds and wall seconds while the collector runs and this thread sleeps."""
    c0, w0 = time.process_time(), time.monotonic()
    start()
    time.sleep(seconds)
    stop()
    return time.process_time() - c0, time.monotonic() - w0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    # pyarrow imports pandas on its first pa.array call (about 0.2 s, once per process; a
    # kvbench run has paid it before collectors start): pay it here, outside the measurement
    from kvbench.collectors.sink import Columns
    from kvbench.core.schema import GPU

    c = Columns(GPU)
    c.append({"t_ns": 0})
    t0 = time.process_time()
    c.take_batch()
    print(f"one-time pyarrow warm-up (first pa.array imports pandas): "
          f"{(time.process_time() - t0) * 1e3:.0f} ms CPU")
    with tempfile.TemporaryDirectory() as tmp:
        # -- NVML sampler, 100 ms, fake NVML with N GPUs (GPM on), writing a real shard
        sink = ShardSink(Path(tmp), "gpu")
        s = NvmlSampler(sink.write, interval_s=0.1, nvml=FakeNvml([FakeGpu()] * args.gpus),
                        log=lambda m: None)
        cpu, wall = cpu_during(args.seconds, s.start, s.stop)
        sink.close()
        print(f"NVML sampler (FAKE NVML, {args.gpus} GPUs, 100 ms, {wall:.1f} s): "
              f"{s.ticks} samples, {s.rows} rows, late {s.late_ticks}; CPU {cpu * 1e3:.1f} ms "
              f"= {cpu / max(s.ticks, 1) * 1e3:.3f} ms/sample = {100 * cpu / wall:.2f}% of one "
              f"core (target < 1%)")
        # -- one scraper at 1 s against a separate http.server process
        text = vllm_sized_exposition(args.gpus)
        (Path(tmp) / "metrics").write_text(text)
        srv = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1",
                                "--directory", tmp], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
        try:
            line = srv.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (...)"
            port = int(line.split(" port ")[1].split()[0])
            esink, gsink = ShardSink(Path(tmp), "engine"), ShardSink(Path(tmp), "gpu", "dcgm")
            sc = PrometheusScraper("bench", f"http://127.0.0.1:{port}/metrics", interval_s=1.0,
                                   engine_emit=esink.write, gpu_emit=gsink.write,
                                   log=lambda m: None)
            cpu, wall = cpu_during(args.seconds, sc.start, sc.stop)
            esink.close()
            gsink.close()
        finally:
            srv.terminate()
            srv.wait(5)
        n = sc.engine_rows // max(sc.scrapes - sc.failures, 1)
        print(f"scraper (1 s, {len(text) / 1024:.0f} KiB, {n} samples/scrape, {wall:.1f} s): "
              f"{sc.scrapes} scrapes, {sc.failures} failed; CPU {cpu * 1e3:.1f} ms = "
              f"{cpu / max(sc.scrapes, 1) * 1e3:.2f} ms/scrape = {100 * cpu / wall:.2f}% of one core")
        t0 = time.process_time()
        for _ in range(20):
            parse_metrics(text, t_ns=0, endpoint="bench")
        print(f"parse_metrics alone: {(time.process_time() - t0) / 20 * 1e3:.2f} ms CPU per scrape")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
