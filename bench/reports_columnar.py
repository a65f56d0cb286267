"""Time and peak RSS of the out-of-core aggregates (reports.statistics.columnar, DuckDB) against
today's in-memory path (reports.measures.data.load: the request frame, then its counts and
percentiles per stage and per workload), on N synthetic requests, each in its own process;
printed with their ratios. Synthesis (not timed) streams batches into one requests.parquet, so
10M requests fit in memory; its disk use is printed.

Usage: python bench/reports_columnar.py [--rows 1000000] [--keep DIR] [--memory-limit 1GB]
       [--threads 2] [--skip-pandas]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # synthetic results

BATCH = 500_000  # requests synthesised at once


def synthesise(run_dir: Path, rows: int, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

    endpoints = [EndpointShape("colocated"),
                 EndpointShape("disaggregated", "disaggregated", ttft_base_ms=140,
                               error_rate=0.01),
                 EndpointShape("offloaded", "offloaded", hit_fraction=0.8)]
    per = len(endpoints) * 2
    run_dir.mkdir(parents=True, exist_ok=True)
    writer, offsets, stages, shape, done, i = None, 0, None, None, 0, 0
    while done < rows:
        n = min(BATCH, rows - done)
        shape = RunShape(endpoints=endpoints, stage_rates_rps=(50.0, 150.0),
                         requests_per_stage=max(1, n // per), output_tokens_median=160,
                         max_chunks=50, sessions_turns=4, seed=seed * 100_003 + i)
        table, st = synth_table(shape, run_id="bench-columnar")
        stages = stages or st
        ids = pc.binary_join_element_wise(table.column("request_id"), f"b{i}", "#")
        table = table.set_column(table.schema.get_field_index("request_id"), "request_id", ids)
        if writer is None:
            writer = pq.ParquetWriter(run_dir / "requests.parquet", table.schema,
                                      compression="zstd")
        writer.write_table(table, row_group_size=128 * 1024)
        offsets += pc.sum(pc.list_value_length(table.column("chunk_offsets_ns"))).as_py()
        done += table.num_rows
        i += 1
        del table
    writer.close()
    parquet = run_dir / "requests.parquet"
    keep = parquet.with_suffix(".keep")
    parquet.rename(keep)  # write_run writes its own requests.parquet: an empty one, replaced
    write_run(run_dir, pa.Table.from_pylist([], schema=pq.read_schema(keep)),
              run_meta(shape, stages, run_id="bench-columnar"), layout=1)
    keep.replace(parquet)
    print(f"synthesised {done:,} requests, {offsets:,} chunk offsets, requests.parquet "
          f"{parquet.stat().st_size / 1e6:.0f} MB on disk")


def child(which: str, run_dir: Path, memory_limit: str, threads: int) -> None:
    """One measured path, in this process: prints JSON {seconds, peak_gb, groups}."""
    import resource

    t = time.perf_counter()
    if which == "columnar":
        from kvbench.reports.statistics import columnar as C

        agg = C.aggregate(run_dir, settings=C.Settings(memory_limit=memory_limit,
                                                       threads=threads))
        groups = len(agg.by_stage) + len(agg.by_workload)
    else:
        from kvbench.reports.measures import data
        from kvbench.reports.statistics import metrics as M
        from kvbench.reports.statistics.columnar import LATENCIES, QUANTILES, STAGE_KEYS, \
            WORKLOAD_KEYS

        names = [f"{m}_{p}" for m in LATENCIES for p in QUANTILES]
        frame = data.load([run_dir]).frame
        groups = 0
        for keys in (STAGE_KEYS, WORKLOAD_KEYS):
            groups += len(M.summarise(frame, by=keys, metrics=names))
            frame.groupby(list(keys), observed=True)[["ok", "cancelled", "slo_met"]].sum()
    secs = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print(json.dumps({"seconds": secs, "peak_gb": peak, "groups": groups}))


def measure(which: str, run_dir: Path, args) -> dict:
    cmd = [sys.executable, str(HERE), "--child", which, "--keep", str(run_dir),
           "--memory-limit", args.memory_limit, "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"seconds": float("nan"), "peak_gb": float("nan"), "failed": True}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{which:9s}: {got['seconds']:7.2f} s, peak RSS {got['peak_gb']:.2f} GB "
          f"({got['groups']} groups)")
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, default=None, help="write the run here and keep it")
    ap.add_argument("--memory-limit", default="1GB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-pandas", action="store_true",
                    help="time the columnar path only (10M requests need ~12 GB in pandas)")
    ap.add_argument("--child", choices=("columnar", "pandas"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.keep, args.memory_limit, args.threads)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.keep or Path(tmp) / "bench-columnar"
        if not (run_dir / "run.json").exists():
            t = time.perf_counter()
            synthesise(run_dir, args.rows)
            print(f"synthesis took {time.perf_counter() - t:.1f} s (not timed)")
        col = measure("columnar", run_dir, args)
        if args.skip_pandas:
            return 0
        pd_ = measure("pandas", run_dir, args)
        print(f"ratios pandas/columnar: time {pd_['seconds'] / col['seconds']:.2f}x, "
              f"peak RSS {pd_['peak_gb'] / col['peak_gb']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
