"""Compaction at scale (issue 34, "Long runs"): N synthetic requests written as a load
process's shards (records and starts, streamed: never N rows in memory), then compacted into
the layout-2 dataset in a child process whose peak RSS and time are printed, with the disk
used. Peak RSS must stay flat as N grows.

    python bench/compact_scale.py 1000000 [10000000 ...]
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CHILD = """
import sys, time, resource
from kvbench.core import store
t = time.perf_counter()
n = store.compact(sys.argv[1], "requests")
print(n, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def synthesise(run: Path, n: int, chunk: int = 200_000) -> None:
    """``n`` requests over two endpoints, as two processes' Arrow shards of records and
    starts (a few starts left without a record), ``chunk`` rows at a time."""
    import pyarrow as pa

    from kvbench.core import store
    from kvbench.core.shards import ShardWriter
    from synthetic import EndpointShape, RunShape, synth_table

    writers = {}
    done = 0
    seed = 0
    while done < n:
        m = min(chunk, n - done)
        shape = RunShape(endpoints=[EndpointShape("a"), EndpointShape("b")],
                         requests_per_stage=max(1, m // 2), stage_rates_rps=(1000.0,),
                         seed=seed)
        t, _ = synth_table(shape, run_id="scale")
        t = t.slice(0, m)
        # each chunk a later stretch of time, ids unique over the run
        shift = pa.scalar(seed * 10**12, pa.int64())
        import pyarrow.compute as pc
        for c in ("t_scheduled", "t_sent"):
            t = t.set_column(t.schema.get_field_index(c), c, pc.add(t.column(c), shift))
        t = t.set_column(t.schema.get_field_index("request_id"), "request_id",
                         pc.binary_join_element_wise(t.column("request_id"),
                                                     pa.scalar(f"#{seed}"), ""))
        for w in ("0", "1"):
            mine = t.filter(pc.equal(pc.bit_wise_and(pa.array(range(m)), 1), int(w)))
            mine = mine.set_column(mine.schema.get_field_index("worker"), "worker",
                                   pa.array([f"h:{w}"] * mine.num_rows))
            rec = writers.setdefault(("requests", w), ShardWriter(run, "requests", w))
            st = writers.setdefault(("starts", w), ShardWriter(run, "starts", w))
            for b in mine.select(list(store.START_COLUMNS)).to_batches(max_chunksize=2000):
                st.write(b)
            body = mine.slice(0, mine.num_rows - 1) if done + m >= n else mine  # in flight
            for b in body.to_batches(max_chunksize=2000):
                rec.write(b)
        done += m
        seed += 1
    for w in writers.values():
        w.close()


def main(sizes: list[int]) -> None:
    for n in sizes:
        tmp = Path(tempfile.mkdtemp(prefix="kvb-compact-"))
        run = tmp / "run"
        t0 = time.perf_counter()
        synthesise(run, n)
        shards = du(run)
        print(f"{n:>11,} requests: synthesised in {time.perf_counter() - t0:.0f} s, shards "
              f"{shards / 1e9:.2f} GB on disk (synthesis peak RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)",
              flush=True)
        out = subprocess.run([sys.executable, "-c", CHILD, str(run)], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
        rows, secs, rss_kb = int(out[0]), float(out[1]), int(out[2])
        files = list((run / "requests").rglob("*.parquet"))
        print(f"{'':>11}  compacted {rows:,} rows (2 cancelled) in {secs:.1f} s, peak RSS "
              f"{rss_kb / 1024:.0f} MB; dataset {du(run / 'requests') / 1e9:.2f} GB in "
              f"{len(files)} files", flush=True)
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1_000_000])
