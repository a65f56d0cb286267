"""How long this load process's event loop stalled: the largest pause per stage.

A stalled loop reads every stream's chunks late together, so a pause is client lateness that
per-request numbers cannot show (issue 13 found 70-255 ms pauses from garbage collection and
from Locust's stop). A libev timer fires every ``INTERVAL_S``; when the loop was busy the next
firing comes late, and the gap beyond the interval is the pause. The callback runs in the hub
(no greenlet switch): about 1 us a firing, 0.05% of a core at 2 ms.

Pauses shorter than the interval are seen only in part (a pause of P starting just after a
firing shows as ``max(0, P - interval)``), so figures under ~2 ms read as 0.

The largest pause is split by whose it was: the process's own CPU time over the gap (every
thread: a conversion holding the GIL counts) against the wall time. What the process did not
run of it was the host's (another process had the core, or the kernel): ``off-CPU``, which
no change to the load process can remove, where the rest is its own work.
"""

from __future__ import annotations

import time

_mono = time.perf_counter_ns
_cpu = time.process_time_ns  # CLOCK_PROCESS_CPUTIME_ID: every thread of the process
INTERVAL_S = 0.002
OVER_MS = 5.0  # pauses above this are counted: they make per-chunk lag visible


class LoopLag:
    """Per-stage largest pause (ms) and count of pauses over ``OVER_MS``; ``take`` reads and
    resets them when a stage ends."""

    __slots__ = ("interval_ns", "last_ns", "last_cpu_ns", "max_ns", "max_off_ns", "over",
                 "total_max_ns", "timer")

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_ns = int(interval_s * 1e9)
        self.last_ns = _mono()
        self.last_cpu_ns = _cpu()
        self.max_ns = 0
        self.max_off_ns = 0  # of the largest pause, the time the process was not running
        self.over = 0
        self.total_max_ns = 0
        self.timer = None

    def start(self) -> "LoopLag":
        import gevent

        if self.timer is None:
            s = self.interval_ns / 1e9
            self.timer = gevent.get_hub().loop.timer(s, s, ref=False)  # never keeps a loop up
            self.last_ns = _mono()
            self.last_cpu_ns = _cpu()
            self.timer.start(self._tick)
        return self

    def _tick(self) -> None:
        now = _mono()
        cpu = _cpu()
        gap = now - self.last_ns
        pause = gap - self.interval_ns
        self.last_ns = now
        ran = cpu - self.last_cpu_ns
        self.last_cpu_ns = cpu
        if pause > self.max_ns:
            self.max_ns = pause
            self.max_off_ns = min(pause, max(0, gap - ran))
            if pause > self.total_max_ns:
                self.total_max_ns = pause
        if pause > OVER_MS * 1e6:
            self.over += 1

    def reset(self) -> None:
        """A stage starts: what came before (building the workload, spawning) is not its."""
        self.last_ns = _mono()
        self.last_cpu_ns = _cpu()
        self.max_ns = 0
        self.max_off_ns = 0
        self.over = 0

    def take(self) -> dict:
        """This stage's figures, in run.json's stage fields; then reset."""
        self._tick_now()
        out = {"loop_pause_max_ms": round(self.max_ns / 1e6, 3),
               "loop_pause_max_offcpu_ms": round(self.max_off_ns / 1e6, 3),
               "loop_pauses_over_5ms": self.over}
        self.reset()
        return out

    def _tick_now(self) -> None:
        """Count a pause still running (the loop is blocked in the caller's own stack)."""
        gap = _mono() - self.last_ns
        pause = gap - self.interval_ns
        if pause > self.max_ns:
            self.max_ns = pause
            self.max_off_ns = min(pause, max(0, gap - (_cpu() - self.last_cpu_ns)))

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.close()
            self.timer = None
