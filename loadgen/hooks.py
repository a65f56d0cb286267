"""kvbench's Locust event listeners, registered at import (hooks, never patches).

``init``: a single process builds its context before the run starts. ``test_start``: the master
hands its run id and worker count to the workers through the synced custom arguments.
``test_stop`` flushes records; ``quitting``: each load process closes its own shard, then the
master or single process finalizes the run (``kvbench.runs.finalize``, once).
"""

from __future__ import annotations

import time

import gevent
from locust import events
from locust.runners import MasterRunner, WorkerRunner

from kvbench.core import redact
from kvbench.core.errors import UserError
from kvbench.loadgen.context import LoadContext, fail, get_context
from kvbench.loadgen.options import has_kvbench_options, job_from_options, run_id
from kvbench.runs.finalize import finalize

PLAIN_TELEMETRY = {"collectors": "not started by a plain locust run (kvbench run starts them)"}
MASTER_WAIT_S = 15.0  # how long the master waits for its workers' sidecars


def kvbench_users(environment) -> list:
    return [c for c in environment.user_classes if getattr(c, "kvbench_user", False)]


@events.init.add_listener
def on_init(environment, **kw) -> None:
    """A single process builds its context now, so workload generation is not charged to the
    run time (workers wait for the master's run id and worker count: see on_test_start)."""
    # Locust's handlers (root, locust, its stats table) write no known secret
    redact.install_log_filter("", "locust", "locust.stats_logger")
    runner = environment.runner
    if not has_kvbench_options(environment.parsed_options) or runner is None or \
            isinstance(runner, (MasterRunner, WorkerRunner)):
        return
    classes = kvbench_users(environment)
    if not classes:
        return
    try:
        if not environment.parsed_options.kvbench_run_id:
            on_test_start(environment)
        get_context(environment, classes[0])
    except UserError as exc:
        fail(environment, exc)
    # The build blocked the loop: refresh libev's cached clock, or Locust's --run-time timer
    # (armed next) would count the build and end the run early.
    gevent.get_hub().loop.update_now()


@events.test_start.add_listener
def on_test_start(environment, **kw) -> None:
    o = environment.parsed_options
    if not has_kvbench_options(o):
        return
    if not o.kvbench_run_id:
        o.kvbench_run_id = run_id(o)
    if isinstance(environment.runner, MasterRunner):
        # synced to the workers with the spawn message (custom arguments travel)
        o.kvbench_workers = max(1, environment.runner.worker_count)
    if not getattr(environment, "kvbench_started_ns", None):
        environment.kvbench_started_ns = time.time_ns()


@events.test_stop.add_listener
def on_test_stop(environment, **kw) -> None:
    ctx = getattr(environment, "kvbench", None)
    if ctx is not None:
        ctx.sink.flush()


@events.quitting.add_listener
def on_quitting(environment, **kw) -> None:
    runner = environment.runner
    ctx: LoadContext | None = getattr(environment, "kvbench", None)
    if ctx is not None:
        ctx.close()
    o = environment.parsed_options
    if not has_kvbench_options(o) or isinstance(runner, WorkerRunner) or \
            o.kvbench_no_finalize or not o.kvbench_run_id:
        return
    if getattr(environment, "kvbench_finalized", False):
        return
    environment.kvbench_finalized = True
    master = isinstance(runner, MasterRunner)
    try:
        finalize_environment(environment, ctx, expected_procs=max(1, (
            o.kvbench_workers or 1) if master else 1), wait_s=MASTER_WAIT_S if master else 0.0)
    except UserError as exc:
        fail(environment, exc)


def finalize_environment(environment, ctx: LoadContext | None, expected_procs: int = 1,
                         wait_s: float = 0.0):
    """run.json of this environment's run: the context's job and workload, or (the master,
    which sends nothing) the job resolved again from the options, without a model lookup."""
    if ctx is not None:
        job, workload = ctx.job, ctx.workload
    else:
        classes = kvbench_users(environment)
        host = environment.host or (getattr(classes[0], "host", None) if classes else None)
        job = job_from_options(environment.parsed_options, host,
                               getattr(classes[0], "workload", "") if classes else "",
                               lookup_model=False)
        workload = None
    workloads = {}
    try:
        workloads[job.workload] = workload if workload is not None else job.build_workload()
    except Exception as exc:  # noqa: BLE001 - the records matter more than the summary
        notes = [{"what": f"workload summary of {job.workload}",
                  "why": f"describe failed: {exc}"[:200]}]
    else:
        notes = []
    started = getattr(environment, "kvbench_started_ns", None) or (
        ctx.t_start_ns if ctx is not None else None)
    return finalize(job.run_dir, [job], workloads=workloads, started_ns=started,
                    telemetry=PLAIN_TELEMETRY, incomplete=notes,
                    expected_procs=expected_procs, wait_s=wait_s)
