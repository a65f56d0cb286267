"""Finalize a run: compact its shards and write run.json (the one writer of run.json)."""

from __future__ import annotations

from pathlib import Path


def describe_sent_requests(run_dir: Path, workloads: dict, endpoint_cfgs=()) -> dict:
    """run.json ``workloads_sent``: ``{endpoint: {workload: describe}}`` over exactly the
    requests each endpoint was sent (``workloads.describe.sent_descriptions``), with the
    engine's KV block size and per-replica capacity where known (built-in options, or a
    scraped ``vllm:cache_config_info``). Reads the compacted requests.parquet."""
    import pyarrow.parquet as pq

    from kvbench.workloads.describe import sent_descriptions

    pfile = Path(run_dir) / "requests.parquet"
    if not workloads or not pfile.exists():
        return {}
    have = set(pq.ParquetFile(pfile).schema_arrow.names)
    cols = [c for c in ("endpoint", "workload", "request_id", "t_sent", "server_replica",
                        "status", "ttft_ns") if c in have]
    records = pq.read_table(pfile, columns=cols).to_pydict()
    records["t_sent_ns"] = records.pop("t_sent")
    return sent_descriptions(records, workloads, endpoint_caches(run_dir, endpoint_cfgs))


def endpoint_caches(run_dir: Path, endpoint_cfgs=()) -> dict:
    """endpoint -> {block_tokens, capacity_tokens (per replica)}, where known."""
    import pyarrow.parquet as pq

    out: dict = {}
    efile = Path(run_dir) / "engine.parquet"
    if efile.exists():
        try:
            t = pq.read_table(efile, columns=["endpoint", "metric", "labels"],
                              filters=[("metric", "=", "vllm:cache_config_info")])
        except Exception:  # noqa: BLE001 - no engine samples: no capacities
            t = None
        if t is not None:
            for ep, labels in zip(t.column("endpoint").to_pylist(),
                                  t.column("labels").to_pylist()):
                lab = dict(labels or [])
                try:
                    bt = int(float(lab["block_size"]))
                    out[ep] = {"block_tokens": bt,
                               "capacity_tokens": int(float(lab["num_gpu_blocks"])) * bt}
                except (KeyError, ValueError):
                    continue
    for ep in endpoint_cfgs or ():
        if getattr(ep, "kind", None) != "builtin":
            continue
        try:
            from kvbench.endpoints.config import validate_options

            res = validate_options(ep.topology, ep.options or {}).resolved()
        except Exception:  # noqa: BLE001 - validated before the run; be safe anyway
            continue
        out[ep.name] = {"block_tokens": res.cfg.block_tokens,
                        "capacity_tokens": res.capacity_tokens}
    return out
