"""Finalize a run: wait for the load processes' sidecars, compact the shards, describe the
workloads and what each endpoint was sent, and write run.json (its one writer). Called by
Locust's quitting hook (on the master or single process), by ``kvbench run``, and by anything
that wrote shards itself."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pyarrow.compute as pc

from kvbench.core import redact, store
from kvbench.reports.engine_counters import adapters as engine_adapters

log = logging.getLogger("kvbench.runs")

TABLES = ("requests", "gpu", "engine")
_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when run from one


def finalize(run_dir: Path | str, jobs=(), *, workloads: dict | None = None,
             started_ns: int | None = None, telemetry: dict | None = None,
             clock_offsets_ns: dict | None = None, incomplete=(),
             expected_procs: int | None = None, wait_s: float = 0.0,
             meta: dict | None = None) -> store.RunMeta:
    """Write run.json of ``run_dir`` and return it.

    ``jobs``: the ``runs.job.Job``s run (run id, suite, config, endpoints); ``workloads``:
    their generators by name (described, and compared with what was sent); ``expected_procs``:
    the load processes whose sidecars to wait up to ``wait_s`` for (None: no check); ``meta``:
    run.json fields that win over the derived ones (a run written without Locust)."""
    run_dir = Path(run_dir)
    jobs = list(jobs)
    metas = _wait_for_sidecars(run_dir, expected_procs, wait_s)
    merged = merge_proc_meta(metas)
    notes = list(merged["incomplete"]) + list(incomplete)
    if expected_procs is not None and len(metas) < expected_procs:
        notes.append({"what": f"{expected_procs - len(metas)} load process(es)",
                      "why": "did not close their record shard in time"})
    rows = store.compact(run_dir, "requests")
    for table in TABLES[1:]:
        store.compact(run_dir, table)
    first = jobs[0] if jobs else None
    workloads = dict(workloads or {})
    described = {}
    for name, wl in workloads.items():
        try:
            from kvbench.workloads.describe import describe

            described[name] = describe(wl)
        except Exception as exc:  # noqa: BLE001 - the records matter more than the summary
            notes.append({"what": f"workload summary of {name}",
                          "why": f"describe failed: {exc}"[:200]})
    sent = {}
    try:
        sent = describe_sent_requests(run_dir, workloads, [j.endpoint for j in jobs])
    except Exception as exc:  # noqa: BLE001 - the records matter more than the summary
        notes.append({"what": "summary of the requests sent",
                      "why": f"describe failed: {exc}"[:200]})
    written = merged["counts"]["records_written"]
    if metas and rows != written:
        notes.append({"what": "records", "why": f"{rows} rows compacted, {written} written"})
    data = {
        "run_id": first.run_id if first else run_dir.name,
        "suite": first.suite if first else "default",
        "started_ns": started_ns, "ended_ns": time.time_ns(),
        "config": first.config if first else {},
        "versions": store.versions(), "git_commit": source_commit(),
        "hosts": sorted({m.get("host") for m in metas if m.get("host")}),
        "endpoints": _endpoints(jobs, metas), "stages": merged["stages"],
        "clock_offsets_ns": dict(clock_offsets_ns or {}), "telemetry": dict(telemetry or {}),
        "incomplete": notes, "counts": merged["counts"], "workloads": described,
        "workloads_sent": sent,
    }
    data.update(meta or {})
    data = redact.redact_obj(data)  # no known secret, header value or URL userinfo is written
    run_meta = store.RunMeta.from_dict(data)
    store.write_run_json(run_dir, run_meta)
    log.info("kvbench: %d records in %s", rows, run_dir)
    return run_meta


def source_commit() -> str | None:
    """The git commit of the kvbench source that ran, when it runs from a checkout; None for
    an installed wheel (``versions`` holds its version). Not the working directory's: where the
    user stands says nothing about the code that produced the records."""
    if not ((_SOURCE_ROOT / "pyproject.toml").exists() and (_SOURCE_ROOT / ".git").exists()):
        return None
    return store.git_commit(_SOURCE_ROOT)


def _wait_for_sidecars(run_dir: Path, expected: int | None, wait_s: float) -> list[dict]:
    deadline = time.monotonic() + wait_s
    while expected and len(list(run_dir.glob("proc-*.json"))) < expected and \
            time.monotonic() < deadline:
        time.sleep(0.1)  # cooperative under Locust (gevent patches time.sleep)
    return store.read_proc_meta(run_dir)


def _endpoints(jobs, metas: list[dict]) -> list[dict]:
    """One entry per endpoint: the jobs' own, else what the load processes recorded."""
    out: dict[str, dict] = {}
    for ep in [j.endpoint.record() for j in jobs] + [m.get("endpoint") for m in metas]:
        if ep and ep.get("name") not in out:
            out[ep["name"]] = ep
    return list(out.values())


def merge_proc_meta(metas: list[dict]) -> dict:
    """Counts summed, stages merged by (endpoint, workload, index): earliest start, latest end."""
    counts = {"requests_started": 0, "records_written": 0, "dropped_at_cap": 0}
    stages: dict[tuple, dict] = {}
    incomplete: list[dict] = []
    for m in metas:
        for k in counts:
            counts[k] += int(m.get("counts", {}).get(k, 0))
        for st in m.get("stages", []):
            key = (st.get("endpoint"), st.get("workload"), st.get("index"))
            cur = stages.get(key)
            if cur is None:
                stages[key] = dict(st)
            else:
                cur["t_start_ns"] = min(cur["t_start_ns"], st["t_start_ns"])
                cur["t_end_ns"] = max(cur["t_end_ns"], st["t_end_ns"])
        for item in m.get("incomplete", []):
            if item not in incomplete:
                incomplete.append(item)
    merged = sorted(stages.values(), key=lambda s: (s["t_start_ns"], s.get("index", 0)))
    return {"counts": counts, "stages": merged, "incomplete": incomplete}


def records_so_far(run_dir: Path | str) -> int:
    """Records the load processes of a run have closed so far (from their sidecars)."""
    return merge_proc_meta(store.read_proc_meta(run_dir))["counts"]["records_written"]


def describe_sent_requests(run_dir: Path, workloads: dict, endpoint_cfgs=()) -> dict:
    """run.json ``workloads_sent``: ``{endpoint: {workload: describe}}`` over exactly the
    requests each endpoint was sent (``workloads.describe.sent_descriptions``), with the
    engine's KV block size and per-replica capacity where known (built-in options, or the
    engine adapter's cache-config metric). Reads the run's requests through the store."""
    from kvbench.workloads.describe import sent_descriptions

    if not workloads:
        return {}
    records = store.read_table(run_dir, "requests", columns=[
        "endpoint", "workload", "request_id", "t_sent", "server_replica", "status",
        "ttft_ns"]).to_pydict()
    if not records["request_id"]:
        return {}
    records["t_sent_ns"] = records.pop("t_sent")
    return sent_descriptions(records, workloads, endpoint_caches(run_dir, endpoint_cfgs))


def endpoint_caches(run_dir: Path, endpoint_cfgs=()) -> dict:
    """endpoint -> {block_tokens, capacity_tokens (per replica)}, where known: from the scraped
    cache-config metric of the endpoint's engine (detected from its metric names), and from a
    built-in endpoint's own settings."""
    out: dict = {}
    try:
        t = store.read_table(run_dir, "engine", columns=["endpoint", "metric", "labels"])
    except Exception:  # noqa: BLE001 - no engine samples: no capacities
        t = None
    if t is not None and t.num_rows:
        for ep, adapter in engine_adapters(t).items():
            if adapter.cache_config is None:
                continue
            mask = pc.and_(pc.equal(t.column("endpoint"), ep),
                           pc.equal(t.column("metric"), adapter.cache_config))
            for lab in t.filter(mask).column("labels").to_pylist():
                geom = adapter.geometry(dict(lab or []))
                if geom is not None:
                    out[ep] = {"block_tokens": geom[0], "capacity_tokens": geom[1]}
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
