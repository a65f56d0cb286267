"""Start and stop the built-in reference endpoints (``kvbench serve`` in a subprocess on a free
loopback port) for the duration of a run."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

from kvbench.core.errors import UserError
from kvbench.runs import lifeline

START_TIMEOUT_S = 60


def start(ep) -> tuple[subprocess.Popen, str]:
    """Start the built-in endpoint ``ep`` (a ``BuiltinEndpoint``); returns it and its URL."""
    cmd = [sys.executable, "-m", "kvbench", "serve", "--topology", ep.topology,
           "--host", "127.0.0.1", "--port", "0"]
    if ep.options:
        cmd += ["--options-json", json.dumps(ep.options)]
    # its own session (a terminal's Ctrl-C reaches kvbench run alone, which stops it); it
    # watches kvbench run's pid and stops when that dies, even by SIGKILL
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **lifeline.child_env()})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        line = ""
    except BaseException:  # interrupted while it starts: it must not outlive the run
        stop(proc)
        raise
    if "listening on" not in line:
        stop(proc)
        err = (proc.stderr.read() or "").strip().splitlines()
        raise UserError(f"built-in endpoint {ep.name!r} ({ep.topology}) did not start: "
                        f"{err[-1] if err else 'no listening line within 60 s'}")
    url = line.split("listening on", 1)[1].split()[0]
    # keep draining stdout so the server never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
