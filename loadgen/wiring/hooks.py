"""kvbench's Locust event listeners, registered at import (hooks, never patches).

``init``: a single process builds its context before the run starts; every process watches its
parent when it has one to end with (kvbench run, or a --processes master) and notes which signal
stops it; the drain bound (Locust's --stop-timeout) defaults to the profile's ``drain_s``.
``test_start``: the master hands its run id and worker count to the workers through the synced
custom arguments. ``test_stopping``: users and the dispatcher start nothing new (what is in
flight drains). ``test_stop`` flushes records. ``quitting`` (Locust may fire it twice, from a
signal and from its main greenlet: the second waits for the first): a run stopped before its
planned end is marked interrupted, with no drain, and exits 128 + the signal; each load process
closes its own shard, then the master or single process finalizes the run (once).
"""

from __future__ import annotations

import inspect
import os
import signal
import time

import gevent
import gevent.event
from locust import events
from locust.runners import (STATE_CLEANUP, STATE_RUNNING, STATE_SPAWNING, MasterRunner,
                            WorkerRunner)

from kvbench.core import redact
from kvbench.core.contract import Incomplete
from kvbench.core.errors import DiskFull, UserError
from kvbench.loadgen.fleet import distributed # noqa: F401 - issue 15: records over Locust messages
from kvbench.loadgen.timing import sink as record_sink
from kvbench.loadgen.wiring.context import LoadContext, fail, get_context, log, quit_soon
from kvbench.loadgen.plan.options import has_kvbench_options, job_from_options, run_dir, run_id
from kvbench.runs import lifeline

# kvbench.runs.finalize (pyarrow, compaction) is imported where a run ends, never while a load
# process sends (issue 13: pyarrow is about 38 MB of its memory)

PLAIN_TELEMETRY = {"collectors": "not started by a plain locust run (kvbench run starts them)"}
MASTER_WAIT_S = 15.0  # beyond the drain, how long the master waits for its workers' sidecars
QUIT_WAIT_S = 3600.0 + 120.0  # a second quitting waits for the first at most this long
INTERRUPT_MSG = "kvbench_interrupt"  # master -> workers: stop now, no drain
RUNNING = (STATE_SPAWNING, STATE_RUNNING, STATE_CLEANUP)  # quitting in these: interrupted
_LOAD_PID = os.getpid()  # the process that imported the locustfile (a --processes master)


def kvbench_users(environment) -> list:
    return [c for c in environment.user_classes if getattr(c, "kvbench_user", False)]


@events.init.add_listener
def on_init(environment, **kw) -> None:
    """A single process builds its context now, so workload generation is not charged to the
    run time (workers wait for the master's run id and worker count: see on_test_start)."""
    # Locust's handlers (root, locust, its stats table) write no known secret
    redact.install_log_filter("", "locust", "locust.stats_logger")
    runner = environment.runner
    if not has_kvbench_options(environment.parsed_options) or runner is None:
        return
    classes = kvbench_users(environment)
    if not classes:
        return
    record_sink.ON_WRITE_FAILURE = lambda exc: write_failed(environment, exc)
    _warm_inspect()
    if getattr(environment, "locustfile", None):  # Locust's own process, not a test's
        _lifeline()
        _note_signals(environment)
    if isinstance(runner, (MasterRunner, WorkerRunner)):
        # the runner's own quitting listener (registered before this one, fired after it:
        # quitting fires in reverse) quits it: look at its state before that
        environment.events.quitting.add_listener(_before_the_runner_quits)
    if isinstance(runner, WorkerRunner):
        runner.register_message(INTERRUPT_MSG, _on_interrupt_message)
        return
    if isinstance(runner, MasterRunner):
        if not environment.stop_timeout:
            try:
                job = job_from_options(environment.parsed_options, environment.host or getattr(
                    classes[0], "host", None), classes[0].workload, lookup_model=False)
                environment.stop_timeout = min(job.timeout_s, job.drain_s)
            except UserError:
                pass  # the workers report it
        return
    try:
        if not environment.parsed_options.kvbench_run_id:
            on_test_start(environment)
        ctx = get_context(environment, classes[0])
        if not environment.stop_timeout:
            environment.stop_timeout = ctx.drain_s
    except DiskFull as exc:  # no space for its first record: the same sentence and code
        write_failed(environment, exc)
    except UserError as exc:
        fail(environment, exc)
    # The build blocked the loop: refresh libev's cached clock, or Locust's --run-time timer
    # (armed next) would count the build and end the run early.
    gevent.get_hub().loop.update_now()


def _warm_inspect() -> None:
    """Locust's ``runner.stop()`` logs its caller with ``inspect.stack()``, which reads the
    source of every frame and maps every loaded module's file on first use: 40-120 ms with the
    loop blocked at the stop of each run, while the streams still in flight drain (issue 13).
    Done once here, before the load, the stop costs about 3 ms."""
    inspect.stack()


def _lifeline() -> None:
    """End with the parent: a --processes worker with its master, a load process with the
    kvbench run that started it (``$KVBENCH_PARENT_PID``)."""
    if os.getpid() != _LOAD_PID:
        lifeline.watch_parent(_LOAD_PID)
    else:
        lifeline.watch_parent()


def _note_signals(environment) -> None:
    """Remember which signal stops this process (Locust's own handlers do the stopping);
    SIGHUP (a closed terminal) stops it as SIGTERM does instead of killing it outright."""
    def note(name: str) -> None:
        environment.__dict__.setdefault("kvbench_signal", name)

    # Ctrl-C takes Locust's SIGTERM path (a graceful shutdown from its own greenlet) instead of
    # a KeyboardInterrupt raised in whichever greenlet runs: Locust swallows one that lands
    # while users are spawning (its runner quits, the main greenlet does not) and the run went
    # on to its --run-time, seen on a loaded host. A second Ctrl-C is a KeyboardInterrupt again.
    def on_sigint() -> None:
        note("SIGINT")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGTERM)

    gevent.signal_handler(signal.SIGINT, on_sigint)
    gevent.signal_handler(signal.SIGTERM, note, "SIGTERM")

    def on_sighup() -> None:
        note("SIGHUP")
        os.kill(os.getpid(), signal.SIGTERM)

    gevent.signal_handler(signal.SIGHUP, on_sighup)


def _before_the_runner_quits(environment, **kw) -> None:
    if getattr(environment, "kvbench_quit_done", None) is not None:
        return  # a second shutdown
    gevent.sleep(0)  # a signal's note runs in its own greenlet: let it land first
    why = interruption(environment)
    if why:
        environment.kvbench_interrupt = why
        environment.stop_timeout = 0
        if isinstance(environment.runner, MasterRunner):  # before its quit: no drain there
            environment.runner.send_message(INTERRUPT_MSG, why)


def _on_interrupt_message(environment, msg, **kw) -> None:
    """The master was interrupted: stop at once (the quit message follows)."""
    environment.kvbench_interrupt = msg.data
    environment.stop_timeout = 0


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
    ctx = getattr(environment, "kvbench", None)
    if ctx is not None:
        ctx.prewarm()  # closed loop: every user's connection, before the stage's clock
        ctx.looplag.reset()  # the stage's pauses are the load's, not Locust's start-up
    if ctx is not None and ctx.pacing == "closed" and ctx.stopping.is_set():
        ctx.stopping.clear()  # a test started again (web UI): its users may send again


@events.test_stopping.add_listener
def on_test_stopping(environment, **kw) -> None:
    ctx = getattr(environment, "kvbench", None)
    if ctx is not None:
        ctx.stop_starting()


@events.test_stop.add_listener
def on_test_stop(environment, **kw) -> None:
    ctx = getattr(environment, "kvbench", None)
    if ctx is not None:
        ctx.sink.flush()


@events.quitting.add_listener
def on_quitting(environment, **kw) -> None:
    done = environment.__dict__.get("kvbench_quit_done")
    if done is not None:  # Locust's second shutdown: let the first finish its work
        done.wait(QUIT_WAIT_S)
        return
    done = environment.kvbench_quit_done = gevent.event.Event()
    try:
        _quit(environment)
    finally:
        done.set()


def interruption(environment) -> str | None:
    """How this process's run was cut before its planned end, or None: a signal came while
    the users ran (Locust quits without stopping them first), or the master said so."""
    told = getattr(environment, "kvbench_interrupt", None)
    if told:
        return told
    runner = environment.runner
    if runner is None or runner.state not in RUNNING:
        return None
    sig = getattr(environment, "kvbench_signal", None)
    if sig and lifeline.orphaned():
        return f"{sig}: the process that started this load process died"
    return f"{sig} to the load process" if sig else "stopped before its planned end"


def _quit(environment) -> None:
    gevent.sleep(0)  # a signal's note runs in its own greenlet: let it land first
    runner = environment.runner
    o = environment.parsed_options
    master = isinstance(runner, MasterRunner)
    why = interruption(environment)
    if why:
        # the exit code is the master's (a worker's nonzero one only makes Locust log an error)
        if environment.process_exit_code is None and not isinstance(runner, WorkerRunner):
            sig = getattr(signal, why.split()[0].rstrip(":"), None) if why.startswith(
                "SIG") else None
            environment.process_exit_code = 128 + int(sig) if sig else 1
        environment.stop_timeout = 0
    ctx: LoadContext | None = getattr(environment, "kvbench", None)
    if ctx is not None:
        ctx.close(why)
        if ctx.sink.failure is not None:  # its last write, at the close, failed
            write_failed(environment, ctx.sink.failure, quit=False)
    if not has_kvbench_options(o) or isinstance(runner, WorkerRunner) or not o.kvbench_run_id:
        return
    if ctx is None and not master and getattr(environment, "kvbench_error", None) is not None:
        return  # its job failed before any load (the error said why): no run directory
    expected = max(1, o.kvbench_workers or 1) if master else 1
    if master:  # its workers close their records (draining first) before it may go
        from kvbench.runs.finalize import wait_for_sidecars

        try:
            wait_for_sidecars(ctx.run_dir if ctx is not None else run_dir(o), expected,
                              MASTER_WAIT_S + (environment.stop_timeout or 0))
        except UserError:
            pass  # no job file to name the run: nothing was recorded
    if o.kvbench_no_finalize or getattr(environment, "kvbench_finalized", False) or \
            getattr(environment, "kvbench_write_failed", None):
        return  # (a failed write: the disk is full, the shards wait for kvbench recover)
    environment.kvbench_finalized = True
    try:
        finalize_environment(environment, ctx, expected_procs=expected, wait_s=0.0,
                             interrupted=why)
    except DiskFull as exc:
        write_failed(environment, exc, quit=False)
    except UserError as exc:
        fail(environment, exc)
        return
    if master:  # records that never reached this disk: not a run that passed (issue 33)
        path = ctx.run_dir if ctx is not None else run_dir(o)
        distributed.check_records_arrived(environment, path, _rows(path))


def _rows(path) -> int | None:
    """The requests table's rows of a finalized run, None where it cannot be read."""
    from kvbench.core import store

    try:
        return store.read_table(path, "requests", columns=["request_id"]).num_rows
    except Exception:  # noqa: BLE001 - finalize has named what is damaged
        return None


def write_failed(environment, exc: DiskFull, quit: bool = True) -> None:
    """A write of the run's results failed (the disk is full, issue 33): say so in one
    sentence, stop the load now (no drain: nothing more can be written) and exit with
    ``DiskFull``'s code; the shards keep what was written, for ``kvbench recover``."""
    if getattr(environment, "kvbench_write_failed", None) is not None:
        return
    environment.kvbench_write_failed = exc
    if not getattr(environment, "kvbench_interrupt", None):
        environment.kvbench_interrupt = "a write of its results failed"
    environment.stop_timeout = 0
    environment.process_exit_code = exc.exit_code
    if not getattr(environment, "kvbench_reported", False):
        environment.kvbench_reported = True  # one sentence: later errors are its echo
        log.error("kvbench: error: %s", redact.redact(str(exc)))
    if quit:
        quit_soon(environment)


def _pyarrow_without_pandas() -> None:
    """Before a load process finalizes its own run (a plain locust run): pyarrow's first
    conversion of Python values asks whether they are pandas objects, importing pandas to know
    (about 34 MB more at the process's peak, for a run that never uses pandas). That one check
    is made here with pandas hidden (its import fails, pyarrow notes "no pandas" for the
    check); pyarrow imports it again whenever something really converts to or from pandas."""
    import sys

    if "pandas" in sys.modules:
        return  # nothing to save

    class NoPandas:
        def find_spec(self, name, path=None, target=None):
            if name == "pandas" or name.startswith("pandas."):
                raise ImportError("pandas is not used by a load process")
            return None

    hide = NoPandas()
    sys.meta_path.insert(0, hide)
    try:
        import pyarrow as pa

        pa.array([None])
        pa.scalar("ok")
    finally:
        sys.meta_path.remove(hide)


def finalize_environment(environment, ctx: LoadContext | None, expected_procs: int = 1,
                         wait_s: float = 0.0, interrupted: str | None = None):
    """run.json of this environment's run: the context's job and workload, or (the master,
    which sends nothing) the job resolved again from the options, without a model lookup."""
    _pyarrow_without_pandas()
    from kvbench.runs.finalize import finalize

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
        notes = [Incomplete(f"workload summary of {job.workload}",
                            f"describe failed: {exc}"[:200])]
    else:
        notes = []
    started = getattr(environment, "kvbench_started_ns", None) or (
        ctx.t_start_ns if ctx is not None else None)
    return finalize(job.run_dir, [job], workloads=workloads, started_ns=started,
                    telemetry=PLAIN_TELEMETRY, incomplete=notes,
                    expected_procs=expected_procs, wait_s=wait_s, interrupted=interrupted)
