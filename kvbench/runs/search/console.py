"""What a capacity search says: a probe's verdict in words (written beside it in the control
file and run.json) and the lines kvbench run prints as the search goes."""

from __future__ import annotations

from kvbench.runs.search.control import Probe


def say(line: str) -> None:
    print(line, flush=True)


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
    return (f"    probe {p.index + 1} ({p.role}) {p.text()}, {p.duration_s:g} s: "
            f"{verdict.upper()}: {why}")


def warmup_line(p: Probe) -> str:
    return f"    warm-up {p.text()}, {p.duration_s:g} s: not judged"
