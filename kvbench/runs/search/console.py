"""What a capacity search says: a probe's verdict in words (written beside it in the control
file and run.json) and the lines kvbench run prints as the search goes.

Numbering (``reports.analysis.numbering``): a probe is "probe N" with N = its run.json stage
index + 1, in the console, in run.json's notes ("started assuming probe N passed") and in the
report; a search's warm-up stage is "warm-up", never a probe number.

Lanes: with ``suite.parallel_endpoints`` each endpoint's jobs run in a thread of their own
(``runs.orchestrate``), which names itself with ``lane``; every line said from that thread
then carries the job's "endpoint x workload", and lines are written whole (one write under a
lock), so two lanes never share a line."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator

from kvbench.reports.analysis.numbering import label, number as probe_number  # noqa: F401
from kvbench.runs.search.control import Probe

_LANE = threading.local()
_WRITE = threading.Lock()


@contextmanager
def lane(name: str | None) -> Iterator[None]:
    """Lines said from this thread carry ``name`` ("endpoint x workload") while it is open."""
    before = getattr(_LANE, "name", None)
    _LANE.name = name
    try:
        yield
    finally:
        _LANE.name = before


def lane_name() -> str | None:
    """The lane this thread says its lines for (None: the run's own lines)."""
    return getattr(_LANE, "name", None)


def tagged(line: str, name: str | None = None) -> str:
    """``line`` naming its lane: "[endpoint x workload] " after its indentation, unless the
    line names it already (a job's own begin and done lines)."""
    name = lane_name() if name is None else name
    if not name or name in line:
        return line
    text = line.lstrip(" ")
    return f"{line[:len(line) - len(text)]}[{name}] {text}"


def emit(line: str, stream=None) -> None:
    """Write ``line`` (tagged with the thread's lane) and its newline in one write."""
    stream = stream or sys.stdout
    with _WRITE:
        stream.write(tagged(line) + "\n")
        stream.flush()


def say(line: str) -> None:
    emit(line)


def why_text(v, target: float = 0.95, confidence: float = 0.95) -> str:
    """Why a probe got verdict ``v`` (a ``reports.capacity.ProbeVerdict``): its worst class,
    its requests within SLO with their interval, the SLO it missed most, thin evidence."""
    w = v.worst
    if w is None:
        return "no request with an SLO"
    from kvbench.reports.analysis.verdict import thin_text

    miss = f", mostly {w.missed}" if w.missed and w.attainment < 1 else ""
    thin = thin_text(v.classes, target, confidence)
    return (f"worst class {w.request_class}: {w.met}/{w.requests} within SLO "
            f"[{w.low:.2f}, {w.high:.2f}]{miss}" + (f"; thin: {thin}" if thin else ""))


def probe_line(p: Probe, verdict: str, why: str) -> str:
    return (f"    {label(p.index)} ({p.role}) {p.text()}, {p.duration_s:g} s: "
            f"{verdict.upper()}: {why}")


def warmup_line(p: Probe) -> str:
    return f"    warm-up {p.text()}, {p.duration_s:g} s: not judged"
