"""Finalize a run: wait for the load processes' sidecars, compact the shards, describe the
workloads and what each endpoint was sent, and write run.json (its one writer). Called by
Locust's quitting hook (on the master or single process), by ``kvbench run``, by anything
that wrote shards itself, and by ``recover`` for a run whose finalizer was killed."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path

import pyarrow.compute as pc

from kvbench.core import redact, store
from kvbench.core.contract import EndpointEntry, Incomplete, ProcMeta, RunMeta, StageEntry
from kvbench.core.errors import DataError, UserError
from kvbench.core.rows import write_failed
from kvbench.runs import search

log = logging.getLogger("kvbench.runs")

TABLES = ("requests", "gpu", "engine")
_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when run from one


def finalize(run_dir: Path | str, jobs=(), *, workloads: dict | None = None,
             started_ns: int | None = None, telemetry: dict | None = None,
             clock_offsets_ns: dict | None = None, incomplete=(),
             expected_procs: int | None = None, wait_s: float = 0.0,
             meta: dict | None = None, interrupted: str | None = None) -> RunMeta:
    """Write run.json of ``run_dir`` and return it.

    ``jobs``: the ``runs.job.Job``s run (run id, suite, config, endpoints); ``workloads``:
    their generators by name (described, and compared with what was sent); ``incomplete``:
    ``Incomplete`` notes (or their JSON objects); ``expected_procs``: the load processes whose
    sidecars to wait up to ``wait_s`` for (None: no check); ``meta``: run.json fields that win
    over the derived ones (a run written without Locust); ``interrupted``: how a signal cut
    the run (a load process's own sidecar may say so too)."""
    run_dir = Path(run_dir)
    jobs = list(jobs)
    metas = wait_for_sidecars(run_dir, expected_procs, wait_s)
    merged = merge_proc_meta(metas)
    notes = merged.incomplete + [_incomplete(n) for n in incomplete]
    interrupted = interrupted or merged.interrupted
    if interrupted:
        notes.insert(0, Incomplete("the run", f"interrupted: {interrupted}"))
    closed = [m for m in metas if m.closed]
    if expected_procs is not None and len(closed) < expected_procs:
        notes.append(Incomplete(f"{expected_procs - len(closed)} load process(es)",
                                "did not close their record shard in time"))
    # (no shard left: compacted by an earlier finalize that did not get to write run.json)
    rows = store.compact(run_dir, "requests") or store.read_table(
        run_dir, "requests", columns=["request_id"]).num_rows
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
            notes.append(Incomplete(f"workload summary of {name}",
                                    f"describe failed: {exc}"[:200]))
    sent = {}
    try:
        sent = describe_sent_requests(run_dir, workloads, [j.endpoint for j in jobs])
    except Exception as exc:  # noqa: BLE001 - the records matter more than the summary
        notes.append(Incomplete("summary of the requests sent", f"describe failed: {exc}"[:200]))
    written = merged.count("records_written")
    if metas and len(closed) == len(metas) and rows != written:
        notes.append(Incomplete("records", f"{rows} rows compacted, {written} written"))
    lost = killed_in_flight(run_dir)
    if lost:
        merged.counts["in_flight_at_kill"] = lost
    workers, offsets = worker_accounts(metas)
    run = RunMeta(
        run_id=first.run_id if first else run_dir.name,
        suite=first.suite if first else "default",
        started_ns=started_ns, ended_ns=time.time_ns(),
        config=first.config if first else {},
        versions=store.versions(), git_commit=source_commit(),
        hosts=sorted({m.host for m in metas if m.host}),
        endpoints=_endpoints(jobs, metas),
        stages=search.annotate(run_dir, merged.stages),  # capacity search probes
        clock_offsets_ns=dict(clock_offsets_ns or {}), telemetry=dict(telemetry or {}),
        incomplete=notes, counts=merged.counts, workloads=described, workloads_sent=sent,
        interrupted=bool(interrupted), interruption=interrupted,
        workers=workers, worker_clock_offsets_ns=offsets,
        layout=1 if (run_dir / "requests.parquet").exists() else store.LAYOUT)
    run = _with(run, meta or {})
    # no known secret, header value or URL userinfo is written (redacted as JSON: every
    # string of every field, the config's included)
    run = RunMeta.from_dict(redact.redact_obj(run.to_dict()))
    try:
        store.write_run_json(run_dir, run)
    except OSError as exc:  # the disk is full: the shards stay for kvbench recover
        (run_dir / "run.json.tmp").unlink(missing_ok=True)
        raise write_failed(run_dir, exc) from None
    log.info("kvbench: %d records in %s", rows, run_dir)
    return run


def _incomplete(note) -> Incomplete:
    """A note given by a caller: an ``Incomplete``, or its JSON object."""
    return note if isinstance(note, Incomplete) else Incomplete.from_dict(note)


def _with(run: RunMeta, given: dict) -> RunMeta:
    """``run`` with the run.json fields ``given`` (JSON, or the contract's classes) set."""
    typed = RunMeta.from_dict(given)
    known = {f.name for f in dataclasses.fields(RunMeta)} & given.keys()
    out = run.replace(**{k: getattr(typed, k) for k in known})
    out.extra.update(typed.extra)
    return out


def source_commit() -> str | None:
    """The git commit of the kvbench source that ran, when it runs from a checkout; None for
    an installed wheel (``versions`` holds its version). Not the working directory's: where the
    user stands says nothing about the code that produced the records."""
    if not ((_SOURCE_ROOT / "pyproject.toml").exists() and (_SOURCE_ROOT / ".git").exists()):
        return None
    return store.git_commit(_SOURCE_ROOT)


def wait_for_sidecars(run_dir: Path, expected: int | None, wait_s: float) -> list[ProcMeta]:
    """The sidecars, once ``expected`` of them are final (``closed``) or ``wait_s`` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        metas = store.read_proc_meta(run_dir)
        if not expected or time.monotonic() >= deadline or \
                sum(1 for m in metas if m.closed) >= expected:
            return metas
        time.sleep(0.1)  # cooperative under Locust (gevent patches time.sleep)


def worker_accounts(metas: list[ProcMeta]) -> tuple[dict, dict]:
    """run.json ``workers`` and ``worker_clock_offsets_ns``: what each worker that sent its
    records to the master sent (the master's account in each sidecar, ``runs.transport``)."""
    workers, offsets = {}, {}
    for m in metas:
        acct = m.transport
        if not isinstance(acct, dict) or not m.worker:
            continue
        workers[m.worker] = acct
        if isinstance(acct.get("clock_offset_ns"), int):
            offsets[m.worker] = acct["clock_offset_ns"]
    return workers, offsets


def killed_in_flight(run_dir: Path) -> int:
    """Records that compaction made of starts a killed load process left without a record."""
    if not store.table_files(run_dir, "requests"):
        return 0
    err = store.read_table(run_dir, "requests", columns=["error"], shards=False).column("error")
    return pc.sum(pc.equal(err, store.KILLED_IN_FLIGHT)).as_py() or 0


def _endpoints(jobs, metas: list[ProcMeta]) -> list[EndpointEntry]:
    """One entry per endpoint: the jobs' own, else what the load processes recorded."""
    out: dict[str, EndpointEntry] = {}
    for ep in [j.endpoint.record() for j in jobs] + [m.endpoint for m in metas]:
        if ep is not None and ep.name not in out:
            out[ep.name] = ep
    return list(out.values())


def merge_proc_meta(metas: list[ProcMeta]) -> ProcMeta:
    """The run's load processes as one: counts summed, stages merged by (endpoint, workload,
    index) (earliest start, latest end), notes once each. A sidecar never closed (its process
    was killed) ends its open stage at its last refresh; ``interrupted``: the first process's
    own account of a signal, if any."""
    counts = {"requests_started": 0, "records_written": 0, "dropped_at_cap": 0}
    stages: dict[tuple, StageEntry] = {}
    incomplete: list[Incomplete] = []
    interrupted = None
    for m in metas:
        for k in counts:
            counts[k] += m.count(k)
        own = list(m.stages)
        if not m.closed:
            interrupted = interrupted or "killed (a load process never closed its records)"
            incomplete.append(Incomplete(f"load process {m.worker or '?'}", (
                "killed before it closed its records: its last flush is kept, its requests "
                "in flight are recorded as cancelled")))
            if m.open_stage is not None and m.updated_ns:
                own.append(m.open_stage.cut(m.updated_ns))
        interrupted = interrupted or m.interrupted
        for st in own:
            cur = stages.get(st.key)
            stages[st.key] = st.replace() if cur is None else _spanning(cur, st)
        for item in m.incomplete:
            if item not in incomplete:
                incomplete.append(item)
    merged = sorted(stages.values(), key=lambda s: (s.t_start_ns, s.index))
    return ProcMeta(counts=counts, stages=merged, incomplete=incomplete,
                    interrupted=interrupted)


def _spanning(cur: StageEntry, st: StageEntry) -> StageEntry:
    """One stage run by two processes: from the earlier start to the later end, with the
    largest loop pause of the two (and that pause's own off-CPU part), pauses over 5 ms
    summed."""
    out = cur.replace(t_start_ns=min(cur.t_start_ns, st.t_start_ns),
                      t_end_ns=max(cur.t_end_ns, st.t_end_ns))
    mine, theirs = cur.loop_pause_max_ms, st.loop_pause_max_ms
    if theirs is not None and (mine is None or theirs > mine):
        # an older process's pause has no split: the other pause's is not this one's
        out.loop_pause_max_ms = theirs
        out.loop_pause_max_offcpu_ms = st.loop_pause_max_offcpu_ms
    got = [v for v in (cur.loop_pauses_over_5ms, st.loop_pauses_over_5ms) if v is not None]
    if got:
        out.loop_pauses_over_5ms = sum(got)
    return out


RUNNER_FILE = "runner.json"  # kvbench run's {"worker": "host:pid"} while it drives the run


def mark_running(run_dir: Path, running: bool = True) -> None:
    """Say (or stop saying) that this process drives ``run_dir``, so ``recover`` waits."""
    path = Path(run_dir) / RUNNER_FILE
    if running:
        try:
            path.write_text(json.dumps({"worker": f"{socket.gethostname()}:{os.getpid()}",
                                        "updated_ns": time.time_ns()}))
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise write_failed(run_dir, exc) from None
    else:
        path.unlink(missing_ok=True)


def recover(run_dir: Path | str) -> RunMeta | None:
    """run.json of a run whose finalizer never wrote it (a SIGKILL of the load process or of
    ``kvbench run``): shards compacted (starts without a record become ``cancelled``), rebuilt
    from its job file(s) and sidecars, marked interrupted. None when there is nothing to
    recover (run.json already there, or no shard, job file or sidecar)."""
    run_dir = Path(run_dir)
    if (run_dir / "run.json").exists():
        return None
    job_files = sorted(run_dir.glob("job-*.json"))
    metas = store.read_proc_meta(run_dir)
    if not (job_files or metas or store.shard_files(run_dir)):
        return None
    runner = run_dir / RUNNER_FILE
    try:
        driver = json.loads(runner.read_text()) if runner.exists() else None
    except (OSError, ValueError):
        driver = None
    if isinstance(driver, dict):
        worker = driver.get("worker")
        if _alive(worker, driver.get("updated_ns")):
            raise DataError(f"{run_dir}: kvbench run (process {worker}) is still driving "
                            "it; wait for it to end, or stop it first")
    for m in metas:
        if not m.closed and _alive(m.worker, m.updated_ns):
            raise DataError(f"{run_dir}: its run is still going (process {m.worker} "
                            "writes it); wait for it to end, or stop it first")
    from kvbench.runs.job import Job

    jobs, workloads, notes = [], {}, []
    for path in job_files:
        try:
            jobs.append(Job.load(path))
        except UserError as exc:
            notes.append(Incomplete(path.name, str(exc)[:200]))
    for job in jobs:
        if job.workload in workloads:
            continue
        try:
            workloads[job.workload] = job.build_workload()
        except Exception as exc:  # noqa: BLE001 - the records matter more than the summary
            notes.append(Incomplete(f"workload summary of {job.workload}",
                                    f"describe failed: {exc}"[:200]))
    opened = [m.opened_ns for m in metas if m.opened_ns]
    killed = any(not m.closed for m in metas)
    said = next((m.interrupted for m in metas if m.interrupted), None)
    why = ("killed before run.json was written; recovered from its shards" if killed else
           f"{said}; run.json recovered from its shards" if said else
           "its finalizer stopped before writing run.json; recovered from its shards")
    meta = finalize(run_dir, jobs, workloads=workloads, started_ns=min(opened, default=None),
                    telemetry={"collectors": "unknown: run.json was rebuilt after the run "
                                             "was stopped"},
                    incomplete=notes, interrupted=why,
                    meta=None if jobs else {"run_id": run_dir.name})
    mark_running(run_dir, False)  # a killed kvbench run's mark
    return meta


def _alive(worker: str | None, updated_ns: int | None) -> bool:
    """Whether process ``worker`` (host:pid) that wrote a file of the run at ``updated_ns``
    still runs (on this host; elsewhere: assume not, a file refreshed in the last 5 s
    excepted)."""
    host, _, pid = str(worker or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return time.time_ns() - int(updated_ns or 0) < 5e9
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def records_so_far(run_dir: Path | str) -> int:
    """Records the load processes of a run have closed so far (from their sidecars)."""
    return merge_proc_meta(store.read_proc_meta(run_dir)).count("records_written")


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
        # imported here: it brings pandas (+40 MB), which a load process never needs
        from kvbench.reports.analysis.engine_counters import adapters as engine_adapters

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
