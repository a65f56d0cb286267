"""The load process's loop-lag monitor: a pause is seen, and split into the process's own
work and the time the host did not run it (assertions on CPU time and sleeps, not margins)."""

from __future__ import annotations

import time

import gevent

from kvbench.loadgen.timing.looplag import LoopLag


def _pause_with(block) -> dict:
    lag = LoopLag().start()
    try:
        gevent.sleep(0.02)  # a few firings first
        lag.reset()
        gevent.spawn(block).join()
        gevent.sleep(0.01)  # the firing after the pause measures it
        return lag.take()
    finally:
        lag.stop()


def test_a_blocking_sleep_is_a_pause_the_process_did_not_run():
    out = _pause_with(lambda: time.sleep(0.15))  # blocks the loop, the process off-CPU
    assert out["loop_pause_max_ms"] >= 145
    assert out["loop_pause_max_offcpu_ms"] >= 120  # at most a few ms of CPU ran meanwhile
    assert out["loop_pauses_over_5ms"] >= 1


def test_a_busy_pause_is_the_process_own_work():
    def spin():
        t0 = time.process_time_ns()
        while time.process_time_ns() - t0 < 150_000_000:  # 150 ms of the process's own CPU
            pass

    out = _pause_with(spin)
    own = out["loop_pause_max_ms"] - out["loop_pause_max_offcpu_ms"]
    assert own >= 140  # whatever the host took besides, the CPU it ran is counted as its own
