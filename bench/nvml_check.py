"""Samples the REAL local GPUs with kvbench's NVML sampler for 10 s under a small matrix-multiply
load and prints what it saw: min/mean/max of every field per GPU, and which fields NVML did
not support. Exits 2 with one sentence when there is no NVML, driver or GPU.

    /work/venv/bin/python bench/nvml_check.py [--seconds 10] [--interval-s 0.1]

Load: torch (CUDA) if importable, else cupy, else numpy on the CPU (the GPU then stays idle).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import pyarrow as pa  # noqa: E402

from kvbench.collectors.nvml import NvmlSampler, init_reason, load_nvml  # noqa: E402
from kvbench.core.schema import GPU  # noqa: E402

FIELDS = [f.name for f in GPU if f.name not in ("t_ns", "host", "gpu", "role", "source",
                                                "endpoint")]


def gpu_names() -> list[str] | str:
    """GPU names, or why NVML cannot be used here."""
    nv = load_nvml()
    if nv is None:
        return "nvidia-ml-py (pynvml) is not installed"
    try:
        nv.nvmlInit()
    except Exception as exc:
        return init_reason(nv, exc)
    try:
        names = []
        for i in range(nv.nvmlDeviceGetCount()):
            n = nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i))
            names.append(n.decode() if isinstance(n, bytes) else n)
        return names or "NVML found no GPU on this host"
    finally:
        nv.nvmlShutdown()


def load(stop: threading.Event, note: list[str]) -> None:
    """Matrix multiplies until ``stop``, plus host->device copies so PCIe moves."""
    try:
        import torch

        if torch.cuda.is_available():
            note.append(f"load: torch {torch.__version__} fp16 8192x8192 matmul on cuda:0 "
                        "+ 256 MiB pinned host->device copies")
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
            b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
            host = torch.empty(128 * 2**20, dtype=torch.float16).pin_memory()
            ballast = torch.empty(8 * 2**30, dtype=torch.uint8, device="cuda")  # HBM moves
            i = 0
            while not stop.is_set():
                c = a @ b
                if i % 20 == 0:
                    host.to("cuda", non_blocking=True)
                    torch.cuda.synchronize()
                i += 1
            torch.cuda.synchronize()
            del a, b, c, host, ballast
            return
    except ImportError:
        pass
    try:
        import cupy as cp

        note.append(f"load: cupy {cp.__version__} float32 4096x4096 matmul")
        a = cp.random.rand(4096, 4096, dtype=cp.float32)
        while not stop.is_set():
            a @ a
            cp.cuda.Device().synchronize()
        return
    except ImportError:
        pass
    import numpy as np

    note.append("load: numpy on the CPU (no torch/cupy with CUDA here): the GPU stays idle")
    a = np.random.rand(1024, 1024)
    while not stop.is_set():
        a @ a


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval-s", type=float, default=0.1)
    args = ap.parse_args()
    names = gpu_names()
    if isinstance(names, str):
        print(f"nvml_check: no GPU telemetry on this host: {names}.", file=sys.stderr)
        return 2
    for i, n in enumerate(names):
        print(f"GPU {i}: {n}")
    batches: list[pa.RecordBatch] = []
    sampler = NvmlSampler(batches.append, interval_s=args.interval_s)
    stop, note = threading.Event(), []
    worker = threading.Thread(target=load, args=(stop, note), daemon=True)
    t0 = time.process_time()
    sampler.start()
    if sampler.wait_ready(30) != "ok":
        print(f"nvml_check: sampler did not start: {sampler.status}", file=sys.stderr)
        return 2
    worker.start()
    time.sleep(args.seconds)
    stop.set()
    worker.join(60)
    sampler.stop()
    print(*note, sep="\n")
    t = pa.Table.from_batches(batches, schema=GPU).to_pandas()
    print(f"samples: {sampler.ticks} ticks, {len(t)} rows, late ticks {sampler.late_ticks}, "
          f"transient errors {sampler.errors} ({sampler.last_error})")
    print(f"process CPU during the run (sampler + load thread): "
          f"{time.process_time() - t0:.2f} s over {args.seconds:.0f} s")
    for gpu, g in t.groupby("gpu"):
        print(f"\nGPU {gpu} (role {g['role'].iloc[0]}):")
        print(f"  {'field':<18}{'n':>6}{'min':>16}{'mean':>16}{'max':>16}")
        for f in FIELDS:
            col = g[f].dropna()
            if col.empty:
                print(f"  {f:<18}{0:>6}{'-':>16}{'-':>16}{'-':>16}")
            else:
                print(f"  {f:<18}{len(col):>6}{col.min():>16.4g}{col.mean():>16.4g}"
                      f"{col.max():>16.4g}")
        print(f"  unsupported: {', '.join(sampler.unsupported.get(gpu, [])) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
