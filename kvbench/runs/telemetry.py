"""Start the telemetry collectors of a run (GPU and engine /metrics), never failing the run:
what could not start is noted in run.json's ``telemetry`` and ``incomplete``."""

from __future__ import annotations

import sys

from kvbench.core.contract import Incomplete
from kvbench.core.redact import redact


def _log(msg: str) -> None:
    print(redact(msg), file=sys.stderr, flush=True)  # a metrics_url may hold a password


def start(run_dir, cfg, jobs, notes: dict):
    """The collectors' session for the endpoints of ``jobs``, or None (reason in ``notes``:
    a dict with ``telemetry`` and ``incomplete``)."""
    try:
        from kvbench.collectors.session import start_collectors
    except ImportError as exc:
        notes["telemetry"]["collectors"] = f"not available ({exc})"
        notes["incomplete"].append(Incomplete("telemetry", "collectors not installed"))
        return None
    eps = {}
    for job in jobs:
        e = job.endpoint
        eps.setdefault(e.name, {"name": e.name, "url": e.url, "topology": e.topology,
                                "metrics_url": e.metrics_url, "engine": e.engine})
    try:
        return start_collectors(run_dir, cfg.collect, list(eps.values()), log=_log)
    except Exception as exc:  # noqa: BLE001 - load still runs without telemetry
        notes["telemetry"]["collectors"] = f"failed to start: {exc}"
        notes["incomplete"].append(Incomplete("telemetry", str(exc)[:200]))
        return None


def stop(collectors, notes: dict) -> None:
    """Stop the collectors and add what they report to ``notes``."""
    if collectors is None:
        return
    try:
        got = collectors.stop()
        notes["telemetry"].update(got.telemetry)
        notes["incomplete"].extend(got.incomplete)
        notes["clock_offsets_ns"].update(got.clock_offsets_ns)
    except Exception as exc:  # noqa: BLE001 - results first
        notes["telemetry"]["collectors"] = f"stop failed: {exc}"
