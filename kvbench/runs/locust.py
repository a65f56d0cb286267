"""Launch one Locust child for a resolved job (``python -m locust -f <job locustfile>
--kvbench-job FILE``), so gevent never enters the ``kvbench run`` process. The locustfiles are
found on disk (``kvbench.loadgen``'s folder) without importing loadgen, which sits above runs.

A failed write of the run's results (the disk is full: issue 33), the child's own (it exits
with ``DISK_FULL_EXIT``) or this process's (its collectors'), stops every Locust child at once
and ends the job with ``DiskFull``."""

from __future__ import annotations

import errno
import importlib.util
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import sys
from dataclasses import dataclass
from pathlib import Path

from kvbench.core import redact, rows
from kvbench.core.errors import DISK_FULL_EXIT, DiskFull, UserError
from kvbench.runs import lifeline
from kvbench.runs.job import Job

JOB_LOCUSTFILE = "job"  # runs whatever workload its job file names
GRACE_S = 60.0  # beyond Locust's own --run-time and drain before the child is stopped
STOP_WAIT_S = 30.0  # after a SIGTERM, before the child's process group gets a SIGKILL
_USER_CLASS = re.compile(r"^class \w+\((?:[\w.]+\.)?KVBenchUser\)", re.M)


def locustfile_dir() -> Path:
    spec = importlib.util.find_spec("kvbench.loadgen")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("kvbench.loadgen is not installed; reinstall kvbench")
    return Path(list(spec.submodule_search_locations)[0])


def locustfiles() -> dict[str, Path]:
    """name -> path of every locustfile shipped (a module defining a KVBenchUser subclass)."""
    out = {}
    for path in sorted(locustfile_dir().glob("*.py")):
        try:
            if _USER_CLASS.search(path.read_text()):
                out[path.stem] = path
        except OSError:
            continue
    return out


def locustfile(name: str) -> Path:
    files = locustfiles()
    if name not in files:
        raise UserError(f"no locustfile named {name!r}; use one of {sorted(files)}")
    return files[name].resolve()


@dataclass(frozen=True)
class Outcome:
    rc: int
    error: str | None  # a kvbench error the child reported, or its crash
    log_path: Path


def free_port() -> int:
    """A TCP port free on loopback now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Distributed:
    """A run on Locust's master and workers whose records travel to the master over Locust's
    messages (``kvbench.runs.transport``): ``local`` worker processes started here, or
    ``expect`` workers started elsewhere (``locust -f "$(kvbench locustfile job)" --worker
    --master-host <this host> --master-port <port>``) that the master waits for."""

    workers: int
    local: bool = True
    bind_host: str = "127.0.0.1"
    port: int = 0  # 0: a free port (local workers only)
    wait_s: float = 600.0  # how long the master waits for expected workers to connect

    def resolved(self) -> "Distributed":
        if self.port:
            return self
        return Distributed(self.workers, self.local, self.bind_host, free_port(), self.wait_s)


def worker_command(master_host: str, port: int) -> list[str]:
    """A Locust worker of the job locustfile (the master sends it the job)."""
    return [sys.executable, "-m", "locust", "-f", str(locustfile(JOB_LOCUSTFILE)), "--worker",
            "--master-host", master_host, "--master-port", str(port), "--loglevel", "WARNING"]


def command(job: Job, job_file: Path, processes: int,
            dist: Distributed | None = None) -> tuple[list[str], float]:
    """The Locust command line for ``job`` and the seconds to allow it."""
    cmd = [sys.executable, "-m", "locust", "-f", str(locustfile(JOB_LOCUSTFILE)), "--headless",
           "--host", job.endpoint.url, "--only-summary", "--loglevel", "WARNING",
           "--kvbench-job", str(job_file), "--kvbench-no-finalize"]
    extra_s = 0.0
    if dist is not None:
        processes = dist.workers
        cmd += ["--master", "--master-bind-host", dist.bind_host, "--master-bind-port",
                str(dist.port), "--expect-workers", str(dist.workers),
                "--expect-workers-max-wait", str(int(dist.wait_s)), "--kvbench-ship-records"]
        extra_s = dist.wait_s
    elif processes > 1:
        # a free port of its own for master and workers: Locust's default 5557 is shared by
        # every other distributed Locust on the host, whose workers would join this master
        port = free_port()
        cmd += ["--processes", str(processes), "--master-bind-host", "127.0.0.1",
                "--master-bind-port", str(port), "--master-port", str(port)]
    # At the stage's end users start nothing new; what is in flight may finish for drain_s
    # (the job's: the child sets Locust's stop timeout to it, which takes whole seconds only),
    # then it is cancelled and recorded as cancelled at the stop.
    drain = min(job.timeout_s, job.drain_s)
    if job.pacing == "closed":
        st = job.stages[job.stage_index]
        cmd += ["-u", str(st.users), "-r", str(st.users),
                "-t", f"{max(1, math.ceil(st.duration_s))}s"]
        return cmd, st.duration_s + drain + GRACE_S + extra_s
    # open loop: the dispatcher ends the run itself after its stages and drain; -t is a bound
    cap = sum(s.duration_s for s in job.stages) + drain
    cmd += ["-u", str(processes), "-r", str(processes), "-t", f"{math.ceil(cap)}s"]
    return cmd, cap + GRACE_S + extra_s


def run(job: Job, processes: int = 1, dist: Distributed | None = None) -> Outcome:
    """Run the job's Locust child to its end (with ``dist``: a master, and its local workers
    when they are local); its log goes to the run directory."""
    run_dir = job.run_dir
    try:
        job_file = job.save(run_dir / job.file_name())
    except OSError as exc:
        raise rows.write_failed(run_dir, exc) from None
    dist = dist.resolved() if dist is not None else None
    cmd, limit = command(job, job_file, processes, dist)
    log_path = run_dir / f"locust-{job_file.stem.removeprefix('job-')}.log"
    env = {**os.environ, **job.secret_env(), **lifeline.child_env()}
    workers: list[subprocess.Popen] = []
    spool = None
    with open(log_path, "w") as logf:
        # its own session: a terminal's signals reach kvbench run alone, which stops it
        proc = track(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
        try:
            if dist is not None and dist.local:
                workers, spool = _start_workers(dist, run_dir, logf, env)
            rc = proc.wait(limit)
            for w in workers:  # they end with the master; a straggler is stopped
                try:
                    w.wait(STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    stop(w)
        except subprocess.TimeoutExpired:
            rc = stop(proc)
        except BaseException:  # an interrupt (KeyboardInterrupt, or kvbench run's signals)
            stop(proc)
            raise
        finally:
            untrack(proc)
            for w in workers:
                if w.poll() is None:
                    stop(w)
            if spool is not None and not rows.shard_files(spool, recursive=True):
                shutil.rmtree(spool, ignore_errors=True)  # all acknowledged: nothing to keep
            _scrub(log_path)
    check_writes(run_dir, rc)
    return Outcome(rc, _error(log_path, rc, job), log_path)


def check_writes(run_dir: Path, rc: int) -> None:
    """Raise ``DiskFull`` when a write of the run's results failed: the child's own (its exit
    code says so; its log, on the same disk, may not) or this process's."""
    if rc == DISK_FULL_EXIT:
        rows.write_failed(run_dir, OSError(errno.ENOSPC, "its load process could not write "
                                                         "its records"))
    err = rows.write_failure(run_dir)
    if err is not None:
        raise err


def _stop_all_soon(err: DiskFull) -> None:
    """A write failed (the disk is full): every Locust child stops now, from a thread of its
    own (the failing thread is a collector's, or a job's that is waiting on its child)."""
    threading.Thread(target=stop_all, name="kvbench-disk-full", daemon=True).start()


rows.on_write_failure(_stop_all_soon)


def _start_workers(dist: Distributed, run_dir: Path, logf, env: dict
                   ) -> tuple[list, Path]:
    """``dist.workers`` local Locust workers, each with a spool of its own outside the run
    directory (what they record reaches the run through the master alone)."""
    import tempfile

    spool = Path(tempfile.mkdtemp(prefix=f"kvbench-spool-{run_dir.name}-"))
    host = "127.0.0.1" if dist.bind_host in ("0.0.0.0", "*", "") else dist.bind_host
    procs = []
    for i in range(dist.workers):
        procs.append(subprocess.Popen(
            worker_command(host, dist.port), stdout=logf, stderr=subprocess.STDOUT,
            env={**env, "KVBENCH_SPOOL": str(spool / f"worker-{i}")}, start_new_session=True))
    return procs, spool


def _scrub(log_path: Path) -> None:
    """Redact the child's log in place: its logging is filtered as it writes, but what the
    child prints outside logging (a gevent traceback, a library's print) is not."""
    try:
        text = log_path.read_text(errors="replace")
        clean = redact.redact(text)
        if clean != text:
            log_path.write_text(clean)
    except OSError:
        pass


_LIVE: set = set()  # Locust children running now (kvbench run's side-by-side lanes stop them)
_LIVE_LOCK = threading.Lock()


def track(proc: subprocess.Popen) -> subprocess.Popen:
    """Register a running Locust child so that ``stop_all`` reaches it."""
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


def untrack(proc: subprocess.Popen) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def stop_all() -> None:
    """Stop every registered Locust child (an interrupt while endpoints run side by side:
    their threads see their children end and return, records kept)."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for proc in procs:
        if proc.poll() is None:
            stop(proc)


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM to the child's process group (Locust and its --processes workers close their
    records and stop: no drain on an interrupt), SIGKILL after ``STOP_WAIT_S``."""
    for sig, wait_s in ((signal.SIGTERM, STOP_WAIT_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _error(log_path: Path, rc: int, job: Job) -> str | None:
    text = log_path.read_text(errors="replace")
    for line in text.splitlines():
        if "kvbench: error:" in line:
            return line.split("kvbench: error:", 1)[1].strip()
    if rc not in (0, 1) and "Traceback" in text:
        tail = [ln for ln in text.splitlines() if ln.strip()][-1]
        return f"Locust failed for {job.label()} ({tail.strip()[:200]}); see {log_path}"
    return None
