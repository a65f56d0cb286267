"""Children that end with their parent: ``kvbench run`` may be killed (SIGKILL) with no chance
to stop what it started, so each child asks the kernel for a signal when its parent dies
(Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread polls the parent pid) and checks the
parent is still the one it was started by. Set in the child itself, not in a ``preexec_fn``,
which is unsafe in a parent with threads (the collectors')."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PARENT_ENV = "KVBENCH_PARENT_PID"  # set by kvbench run for the children it starts
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_watched: int | None = None  # the parent pid this process watches


def orphaned() -> bool:
    """Whether the parent this process watches has died (its signal came from the lifeline)."""
    return _watched is not None and os.getppid() != _watched


def child_env() -> dict:
    """Environment for a child that must not outlive this process (see ``watch_parent``)."""
    return {PARENT_ENV: str(os.getpid())}


def watch_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> bool:
    """Get ``sig`` when the parent dies: ``parent_pid`` (default: ``$KVBENCH_PARENT_PID``;
    nothing to watch without one). If the parent is already gone, ``sig`` comes now."""
    if parent_pid is None:
        env = os.environ.get(PARENT_ENV, "")
        if not env.isdigit():
            return False
        parent_pid = int(env)
    global _watched
    _watched = parent_pid
    if not _pdeathsig(sig):
        threading.Thread(target=_poll, args=(parent_pid, sig), daemon=True,
                         name="kvbench-lifeline").start()
    if os.getppid() != parent_pid:  # it died before the watch was set
        os.kill(os.getpid(), sig)
    return True


def _pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _poll(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), sig)
