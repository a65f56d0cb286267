"""The seeds' symptom table as rules: each compares what was measured with what should have
been, fires only when its evidence is in the data, and says the numbers, the cause and the fix.

One module per concern, each a few rules: ``cache`` (prefix hits lost, HBM full), ``topology``
(transfer tax, cross-region, residency), ``load`` (overloaded, load generator saturated),
``errors``, ``hogwild``; ``base`` holds the ``Finding`` they return. ``RULES`` names them all,
``diagnose`` runs them.

Symptom -> cause -> fix rows are from seed 000's table ("Prefix hit rate drops to 8% | Round-robin
ALB | Cache-aware router on prefix hash", ...). Thresholds are ours, named in each module.
"""

from __future__ import annotations

from typing import Callable

from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose.base import MIN_ROWS, Finding
from kvbench.reports.analysis.diagnose.cache import SENT_HIT_RATIO_FRACTION, hbm_full, prefix_hits_lost
from kvbench.reports.analysis.diagnose.errors import errors
from kvbench.reports.analysis.diagnose.hogwild import hogwild
from kvbench.reports.analysis.diagnose.load import lateness_split, loadgen_saturated, overloaded
from kvbench.reports.analysis.diagnose.topology import cross_region, residency, transfer_tax

RULES: dict[str, Callable[[ReportData], list[Finding]]] = {
    "errors": errors,
    "prefix_hits_lost": prefix_hits_lost,
    "transfer_tax": transfer_tax,
    "hbm_full": hbm_full,
    "cross_region": cross_region,
    "residency": residency,
    "hogwild": hogwild,
    "loadgen_saturated": loadgen_saturated,
    "overloaded": overloaded,
}


def diagnose(d: ReportData) -> list[Finding]:
    """Every rule's findings, critical first."""
    found = []
    for rule in RULES.values():
        found.extend(rule(d))
    return sorted(found, key=lambda x: (x.severity != "critical", x.rule, x.endpoint or ""))


__all__ = ["Finding", "MIN_ROWS", "RULES", "SENT_HIT_RATIO_FRACTION", "cross_region", "diagnose",
           "errors", "hbm_full", "hogwild", "lateness_split", "loadgen_saturated", "overloaded",
           "prefix_hits_lost", "residency", "transfer_tax"]
