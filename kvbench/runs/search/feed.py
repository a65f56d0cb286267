"""The load process's side of a capacity search: the probes kvbench run asks for, read from
the control file between stages; a cut of the running probe ends its arrivals and cancels its
requests in flight. Imported by the load process: gevent only, no pandas or pydantic."""

from __future__ import annotations

from pathlib import Path

from kvbench.runs.search.control import control_path, read_control

FEED_WAIT_S = 120.0  # a child with no control file for this long ends (no kvbench run)


class ProbeFeed:
    """The probes of one endpoint x workload's search, one at a time, as the dispatcher's
    stages (``probes``)."""

    def __init__(self, run_dir: Path | str, endpoint: str, workload: str) -> None:
        self.path = control_path(run_dir, endpoint, workload)
        self.current: int | None = None  # the probe running
        self._ended: set[int] = set()
        self._cut: set[int] = set()

    def probes(self, dispatcher):
        import gevent

        watcher = gevent.spawn(self._watch, dispatcher)
        k = 0
        waited = 0.0
        try:
            while True:
                control = read_control(self.path)
                if control is not None and len(control.probes) > k:
                    probe = control.probes[k].probe()
                    k += 1
                    waited = 0.0
                    self.current = probe.index
                    yield probe
                    continue
                if control is not None and control.done:
                    return
                if control is None and waited > FEED_WAIT_S:
                    raise RuntimeError(f"no capacity search drives this run ({self.path} never "
                                       "appeared); pacing = \"search\" runs under kvbench run")
                gevent.sleep(0.05)
                waited += 0.05
        finally:
            watcher.kill(block=False)

    def _watch(self, dispatcher) -> None:
        """Applies the ends and cuts the driver asks for, until the search is done."""
        import gevent

        while True:
            control = read_control(self.path)
            if control is not None:
                self._apply(control, dispatcher)
                if control.done:
                    return
            gevent.sleep(0.1)

    def _apply(self, control, dispatcher) -> None:
        for i in control.end:  # its arrivals end, its requests finish
            if i not in self._ended and i == self.current:
                self._ended.add(i)
                dispatcher.end_stage()
        for i in control.cut:
            if i in self._cut:
                continue
            self._cut.add(i)
            if i == self.current:
                dispatcher.end_stage()
            # its requests in flight (a saturated queue, or a failed probe's backlog that
            # would weigh on the next one) go; other probes' stay
            dispatcher.cancel_stage(i)
