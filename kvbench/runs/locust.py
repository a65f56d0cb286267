"""Launch one Locust child for a resolved job (``python -m locust -f <job locustfile>
--kvbench-job FILE``), so gevent never enters the ``kvbench run`` process. The locustfiles are
found on disk (``kvbench.loadgen``'s folder) without importing loadgen, which sits above runs."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvbench.core.errors import UserError
from kvbench.runs.job import Job

JOB_LOCUSTFILE = "job"  # runs whatever workload its job file names
DRAIN_S = 30.0  # after the last open-loop stage, how long in-flight requests may finish
GRACE_S = 60.0  # beyond Locust's own --run-time before the child is stopped
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


def command(job: Job, job_file: Path, processes: int) -> tuple[list[str], float]:
    """The Locust command line for ``job`` and the seconds to allow it."""
    cmd = [sys.executable, "-m", "locust", "-f", str(locustfile(JOB_LOCUSTFILE)), "--headless",
           "--host", job.endpoint.url, "--only-summary", "--loglevel", "WARNING",
           "--kvbench-job", str(job_file), "--kvbench-no-finalize"]
    if processes > 1:
        # a free port of its own for master and workers: Locust's default 5557 is shared by
        # every other distributed Locust on the host, whose workers would join this master
        port = free_port()
        cmd += ["--processes", str(processes), "--master-bind-host", "127.0.0.1",
                "--master-bind-port", str(port), "--master-port", str(port)]
    if job.pacing == "closed":
        st = job.stages[job.stage_index]
        cmd += ["-u", str(st.users), "-r", str(st.users),
                "-t", f"{max(1, math.ceil(st.duration_s))}s"]
        return cmd, st.duration_s + GRACE_S
    cap = sum(s.duration_s for s in job.stages) + min(job.timeout_s, DRAIN_S)
    cmd += ["-u", str(processes), "-r", str(processes), "-t", f"{math.ceil(cap)}s"]
    return cmd, cap + GRACE_S


def run(job: Job, processes: int = 1) -> Outcome:
    """Run the job's Locust child to its end; its log goes to the run directory."""
    run_dir = job.run_dir
    stage = job.stage_index if job.pacing == "closed" else "all"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in
                   f"{job.endpoint.name}-{job.workload}-{stage}")
    job_file = job.save(run_dir / f"job-{safe}.json")
    cmd, limit = command(job, job_file, processes)
    log_path = run_dir / f"locust-{safe}.log"
    env = {**os.environ, **job.secret_env()}
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(30)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)  # Locust flushes its records on SIGINT
            proc.wait(30)
            raise
    return Outcome(rc, _error(log_path, rc, job), log_path)


def _error(log_path: Path, rc: int, job: Job) -> str | None:
    text = log_path.read_text(errors="replace")
    for line in text.splitlines():
        if "kvbench: error:" in line:
            return line.split("kvbench: error:", 1)[1].strip()
    if rc not in (0, 1) and "Traceback" in text:
        tail = [ln for ln in text.splitlines() if ln.strip()][-1]
        return f"Locust failed for {job.label()} ({tail.strip()[:200]}); see {log_path}"
    return None
