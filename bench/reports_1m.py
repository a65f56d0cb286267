"""Time `kvbench report` on 1M synthetic request rows (about 50 chunks each).

Target (issue 5): at most 10 s and 2 GB peak RSS for the report process.
Usage: /work/venv/bin/python bench/reports_1m.py [--rows 1000000] [--format html|md] [--keep DIR]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synthetic results
from synthetic import (EndpointShape, RunShape, engine_table, gpu_table, run_meta,  # noqa: E402
                       synth_table, write_run)


from kvbench.core.store import table_files  # noqa: E402


def synthesise(run_dir: Path, rows: int) -> None:
    endpoints = [EndpointShape("colocated", gpu_hour_cost=2.5),
                 EndpointShape("disaggregated", "disaggregated", ttft_base_ms=140, gpus=2,
                               gpu_hour_cost=2.5, error_rate=0.01),
                 EndpointShape("offloaded", "offloaded", hit_fraction=0.8)]
    stages = (50.0, 150.0)
    shape = RunShape(endpoints=endpoints, stage_rates_rps=stages,
                     requests_per_stage=rows // (len(endpoints) * len(stages)),
                     output_tokens_median=160, max_chunks=50, sessions_turns=4)
    table, st = synth_table(shape, run_id="bench-1m")
    gpu = gpu_table(st, [("colocated", "colocated"), ("disaggregated", "prefill"),
                         ("disaggregated", "decode"), ("offloaded", "colocated")],
                    interval_s=0.5)
    t0 = st[0]["t_start_ns"]
    eng = engine_table([(t0 + i * 10**9, ep.name, m, {}, v * i) for ep in endpoints
                        for i in range(0, 4000, 2)
                        for m, v in (("vllm:prefix_cache_queries_total", 5000.0),
                                     ("vllm:prefix_cache_hits_total", 2000.0))])
    meta = run_meta(shape, st, run_id="bench-1m",
                    workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.6}})
    write_run(run_dir, table, meta, gpu=gpu, engine=eng)
    chunks = table.column("chunk_offsets_ns")
    import pyarrow.compute as pc

    print(f"synthesised {table.num_rows:,} requests, "
          f"{pc.sum(pc.list_value_length(chunks)).as_py():,} chunk offsets, "
          f"compacted requests {sum(f.stat().st_size for f in table_files(run_dir, 'requests')) / 1e6:.0f} MB")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--format", choices=("html", "md"), default="html")
    ap.add_argument("--keep", type=Path, default=None, help="write the run here and keep it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.keep or Path(tmp) / "bench-1m"
        if not (run_dir / "run.json").exists():
            t = time.perf_counter()
            synthesise(run_dir, args.rows)
            print(f"synthesis took {time.perf_counter() - t:.1f} s (not part of the target)")
        out = Path(tmp) / f"report.{args.format}"
        cmd = [sys.executable, "-m", "kvbench", "report", str(run_dir), "-o", str(out),
               "--format", args.format]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
        print(f"kvbench report --format {args.format}: {wall:.2f} s wall, peak RSS "
              f"{rss_gb:.2f} GB, output {out.stat().st_size / 1e6:.1f} MB "
              f"(targets: <= 10 s, <= 2 GB) -> "
              f"{'OK' if wall <= 10 and rss_gb <= 2 else 'OVER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
