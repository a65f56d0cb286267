"""What the live summary (kvbench.loadgen.liveview.live) costs a load process at a given request rate.

Replays the sink's output at ``--rate`` requests/s: a REQUESTS batch every flush interval
(0.5 s: what ``RecordSink`` writes, handed over as {column: list of values}), with ``--chunks``
chunks per request, for ``--seconds`` of
simulated load. At each live tick (0.5 s) the queued batches are derived, and once a second the
progress file is rewritten (what every load process under kvbench run does); every 2 s the web UI's
summary is taken (a browser on the tab: exact window and since-start percentiles). The CPU time
of that work (thread time) over the simulated wall time is the share of a core it costs.
The batch construction is the sink's own cost and is not counted.

    python bench/live_cost.py                      # 1,000 req/s, 300 s, 64 chunks a request
    python bench/live_cost.py --rate 1000 --seconds 600 --chunks 256
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench.core.schema import REQUESTS
from kvbench.loadgen.liveview import live
from kvbench.loadgen.timing.sink import FLUSH_INTERVAL_S


def batch(rng, n: int, chunks: int, t0_ns: int, classes=("rag", "chat")) -> pa.RecordBatch:
    """``n`` finished requests as the sink writes them (the columns live.py reads filled)."""
    ttft = rng.lognormal(np.log(80e6), 0.5, n).astype(np.int64)
    itl = rng.lognormal(np.log(15e6), 0.3, (n, chunks)).astype(np.int64)
    offs = ttft[:, None] + np.concatenate([np.zeros((n, 1), np.int64),
                                           np.cumsum(itl[:, 1:], axis=1)], axis=1)
    status = np.where(rng.random(n) < 0.01, "timeout", "ok")
    sched = t0_ns + np.arange(n) * int(1e9 / max(n, 1))
    cols = {
        "endpoint": ["builtin"] * n, "request_class": list(rng.choice(classes, n)),
        "stage": np.zeros(n, np.int64), "status": list(status),
        "t_scheduled": sched, "t_sent": sched + rng.integers(0, 2_000_000, n),
        "ttft_ns": ttft, "e2e_ns": offs[:, -1], "completion_tokens": np.full(n, chunks),
        "prompt_tokens": np.full(n, 2000), "cached_tokens": rng.integers(0, 2000, n),
        "chunk_offsets_ns": pa.ListArray.from_arrays(
            np.arange(0, n * chunks + 1, chunks, dtype=np.int32), offs.ravel()),
    }
    arrays = []
    for f in REQUESTS:
        if f.name in cols:
            arrays.append(pa.array(cols[f.name], type=f.type) if not isinstance(
                cols[f.name], pa.Array) else cols[f.name].cast(f.type))
        else:
            arrays.append(pa.nulls(n, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=REQUESTS)


def run_once(a, pool) -> tuple[float, float, float, int, int]:
    """One replay: (CPU s, CPU s of the last minute, CPU s deriving, requests, summaries)."""
    clock = [time.time_ns()]  # simulated: the window ages with the replayed seconds
    stats = live.LiveStats({"rag": {"ttft_ms": 200.0, "tpot_ms": 50.0}, "chat": {}},
                           clock=lambda: clock[0])
    tmp = Path(tempfile.mkdtemp()) / "live.json"
    flushes = int(round(1 / FLUSH_INTERVAL_S))
    spent = spent_last_min = 0.0
    summaries = 0
    s = None
    for sec in range(a.seconds):
        clock[0] += 10**9
        t = time.thread_time()
        for k in range(flushes):  # the sink's batches, and the live ticks that take them
            stats.tap(pool[(sec * flushes + k) % len(pool)])
            if (k + 1) * FLUSH_INTERVAL_S % live.TICK_S < 1e-9:
                stats.drain()
        live._write_json(tmp, stats.progress())  # every live.PROGRESS_TICKS ticks: a second
        if a.ui_every and sec % int(a.ui_every) == 0:
            s = stats.summary()
            summaries += 1
        dt = time.thread_time() - t
        spent += dt
        if sec >= a.seconds - 60:
            spent_last_min += dt
    n = sum(ks.counts["done"] for ks in stats.keys.values())
    return spent, spent_last_min, stats.derive_s, n, summaries


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="requests per second")
    ap.add_argument("--seconds", type=int, default=300, help="simulated seconds of load")
    ap.add_argument("--chunks", type=int, default=64, help="chunks per request (ITL gaps + 1)")
    ap.add_argument("--ui-every", type=float, default=2.0, help="web UI refresh, s (0: none)")
    ap.add_argument("--repeat", type=int, default=3, help="replays (a busy host varies)")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(7)
    per_flush = int(round(a.rate * FLUSH_INTERVAL_S))
    # as the sink's taps receive them: column lists by name (built with pyarrow here only)
    pool = [batch(rng, per_flush, a.chunks, time.time_ns()).to_pydict() for _ in range(8)]
    print(f"live summary at {a.rate:.0f} req/s, {a.chunks} chunks/request, {a.seconds} s "
          f"simulated, web UI summary every {a.ui_every or 'never'} s:")
    shares = []
    for _ in range(a.repeat):
        spent, last, derive_s, n, summaries = run_once(a, pool)
        shares.append(spent / a.seconds)
        print(f"  {n} requests, {summaries} summaries: CPU {spent:.3f} s = "
              f"{100 * spent / a.seconds:.3f}% of a core (last minute "
              f"{100 * last / min(60, a.seconds):.3f}%; deriving "
              f"{100 * derive_s / a.seconds:.3f}%)")
    print(f"median {100 * float(np.median(shares)):.3f}% of a core, "
          f"min {100 * min(shares):.3f}%")


if __name__ == "__main__":
    main()
