"""The distributed master's cost per received record (issue 15): a simulated stream of
``--workers`` workers at ``--rate`` requests/s each, sending what their sinks send (a requests
batch, a starts batch and a sidecar every 0.5 s, as Locust messages), fed to the master's side
(Locust's message decoding + ``kvbench.runs.transport.Inbox``: check, rows shard write,
sidecar, acknowledgement encoding) as fast as it takes them.

Prints the master's CPU microseconds per record, the records/s one master core takes (its
ceiling), that ceiling over the stream's rate (headroom: above 1 the master is not the
bottleneck), the bytes per record on the wire, the workers' encoding cost per record (paid on
their thread pools), and the master's RSS before and after (records go to disk, not memory).

Run: ``python bench/dist_master.py [--workers 32] [--rate 1000] [--seconds 10]
[--output-tokens 128]``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from locust.rpc import Message  # noqa: E402

from kvbench.core import rows  # noqa: E402
from kvbench.runs import transport as T  # noqa: E402

FLUSH_S = 0.5


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def offsets(n: int, tokens: int) -> list:
    """Per-chunk arrival offsets as a real stream has them (jittered inter-token gaps), so
    the wire's compression is not flattered by identical rows."""
    rng = np.random.default_rng(n)
    gaps = rng.gamma(4.0, 5_000_000, size=(n, tokens)).astype(np.int64)
    return (50_000_000 + np.cumsum(gaps, axis=1)).tolist()


def batch(worker: str, start: int, n: int, tokens: int, kind: str) -> list[list]:
    """``n`` records as a sink hands them over (column lists in ``rows.COLUMNS[kind]`` order):
    per-chunk offsets and tokens of ``tokens`` chunks."""
    t0 = 1_760_000_000 * 10**9
    cols = {"run_id": ["bench"] * n, "endpoint": ["staging"] * n, "topology": ["colocated"] * n,
            "workload": ["chat"] * n, "request_class": ["chat"] * n, "stage": [0] * n,
            "request_id": [f"{worker}-{start + i}" for i in range(n)],
            "session_id": [f"s{start + i}" for i in range(n)], "turn": [0] * n,
            "worker": [worker] * n, "prompt_tokens": [512] * n, "prompt_tokens_client": [512] * n,
            "shared_prefix_tokens": [128] * n, "max_tokens": [tokens] * n,
            "completion_tokens": [tokens] * n, "completion_tokens_client": [tokens] * n,
            "t_scheduled": [t0 + i * 10**6 for i in range(n)],
            "t_sent": [t0 + i * 10**6 + 2000 for i in range(n)], "connect_ns": [0] * n,
            "ttft_ns": [50_000_000] * n,
            "chunk_offsets_ns": offsets(n, tokens),
            "chunk_tokens": [[1] * tokens] * n, "e2e_ns": [50_000_000 + tokens * 20_000_000] * n,
            "status": ["ok"] * n, "http_status": [200] * n,
            "server_request_id": [f"{worker}-{start + i}" for i in range(n)]}
    return [cols.get(name, [None] * n) for name in rows.COLUMNS[kind]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1000.0, help="requests/s of each worker")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of stream simulated")
    ap.add_argument("--output-tokens", type=int, default=128, help="chunks per request")
    a = ap.parse_args(argv)
    per_flush = int(a.rate * FLUSH_S)
    flushes = int(a.seconds / FLUSH_S)
    # what the workers send (encoded up front: the workers' cost, timed apart)
    boxes = {f"load-{i}:1": T.Outbox(f"load-{i}:1") for i in range(a.workers)}
    template = batch("w", 0, per_flush, a.output_tokens, "requests")
    starts_t = batch("w", 0, per_flush, a.output_tokens, "starts")
    c0 = time.process_time()
    for w, box in boxes.items():
        box.put("requests", template)
    enc_s = (time.process_time() - c0) / (a.workers * per_flush)
    for box in boxes.values():
        box.take()
    req_bytes = T.encode("requests", template)
    start_bytes = T.encode("starts", starts_t)
    meta = {"counts": {"requests_started": 0, "records_written": 0, "dropped_at_cap": 0},
            "stages": [], "incomplete": [], "closed": False, "host": "load", "worker": ""}
    wire = []  # the Locust messages as they arrive at the master, one flush of every worker
    for w in boxes:
        for kind, data in (("starts", start_bytes), ("requests", req_bytes), ("meta", meta)):
            wire.append((w, kind, data))

    with tempfile.TemporaryDirectory(prefix="kvbench-dist-bench-") as d:
        inbox = T.Inbox(Path(d) / "run", master_host="master")
        rss0 = rss_mib()
        seq = {w: 0 for w in boxes}
        bytes_in = 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for f in range(flushes):
            for w, kind, data in wire:
                seq[w] += 1
                if kind == "meta":
                    data = {**data, "worker": w, "counts": {
                        "requests_started": (f + 1) * per_flush,
                        "records_written": (f + 1) * per_flush, "dropped_at_cap": 0}}
                raw = Message("kvbench_records", {"w": w, "seq": seq[w], "kind": kind,
                                                  "data": data}, w).serialize()
                bytes_in += len(raw)
                msg = Message.unserialize(raw)
                got = inbox.receive(msg.data, node=msg.node_id)
                Message("kvbench_ack", {"seqs": [got]}, msg.node_id).serialize()
        for st in inbox.workers.values():
            st.meta["closed"] = True
        inbox.close()
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        rss1 = rss_mib()
        records = sum(st.records for st in inbox.workers.values())
        size = sum(p.stat().st_size for p in rows.shard_files(Path(d) / "run"))
    want = a.workers * a.rate
    per_rec_us = cpu / records * 1e6
    ceiling = records / cpu
    print(f"simulated: {a.workers} workers x {a.rate:.0f} req/s for {a.seconds:.0f} s "
          f"({records} records, {a.output_tokens} chunks each), batches every {FLUSH_S} s")
    print(f"master: {per_rec_us:.2f} us CPU per record ({wall:.2f} s wall for "
          f"{a.seconds:.0f} s of stream); one core takes {ceiling:,.0f} records/s = "
          f"{ceiling / want:.1f}x the {want:,.0f} req/s offered")
    print(f"wire: {bytes_in / records:.0f} bytes per record (msgpack rows + starts + "
          f"sidecars) = {bytes_in / a.seconds / 2**20:.1f} MiB/s into the master; shards on "
          f"disk {size / records:.0f} bytes per record")
    print(f"workers: {enc_s * 1e6:.2f} us per record to encode (their thread pools)")
    print(f"master RSS: {rss0:.0f} MiB before, {rss1:.0f} MiB after ({rss1 - rss0:+.0f} MiB)")
    return 0 if ceiling >= want else 1


if __name__ == "__main__":
    sys.exit(main())
