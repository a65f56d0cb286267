"""The seeds' symptom table as rules: each compares what was measured with what should have
been, fires only when its evidence is in the data, and says the numbers, the cause and the fix.

One module per concern, each a few rules: ``cache`` (prefix hits lost, HBM full), ``topology``
(transfer tax, cross-region, residency), ``load`` (overloaded, load generator saturated),
``errors``, ``hogwild``, ``sessions`` (agent sessions' KV working set), ``search`` (a search
that passed nothing; which of its probes are evidence at all); ``base`` holds the ``Finding`` they return. ``RULES`` names them all,
``diagnose`` runs them and ``order`` puts what a user should act on first.

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
from kvbench.reports.analysis.diagnose.search import start_failed
from kvbench.reports.analysis.diagnose.sessions import session_cache
from kvbench.reports.analysis.diagnose.topology import cross_region, residency, transfer_tax
from kvbench.reports.analysis.diagnose.twin import twin_gap

RULES: dict[str, Callable[[ReportData], list[Finding]]] = {
    "start_failed": start_failed,
    "errors": errors,
    "prefix_hits_lost": prefix_hits_lost,
    "transfer_tax": transfer_tax,
    "hbm_full": hbm_full,
    "session_cache": session_cache,
    "cross_region": cross_region,
    "residency": residency,
    "hogwild": hogwild,
    "loadgen_saturated": loadgen_saturated,
    "overloaded": overloaded,
    "twin_gap": twin_gap,
}


# What a user acts on first, within a severity: an endpoint that serves nothing or fails
# requests, then what makes the measurements themselves wrong (the load generator), then what
# to change in the deployment (residency, routing, cache, capacity), then comparisons of
# topologies, and last the prefix-cache bookkeeping check (``cache_verify``).
ACTION_ORDER = ("start_failed", "errors", "residency", "loadgen_saturated", "prefix_hits_lost",
                "overloaded", "hbm_full", "session_cache", "cross_region", "transfer_tax",
                "hogwild", "twin_gap", "cache_verify")


def order(found: list[Finding]) -> list[Finding]:
    """Findings critical first, then by ``ACTION_ORDER`` (rules it does not name after those
    it does), then by endpoint."""
    rank = {r: i for i, r in enumerate(ACTION_ORDER)}
    return sorted(found, key=lambda x: (x.severity != "critical",
                                        rank.get(x.rule, len(rank)), x.rule, x.endpoint or ""))


def diagnose(d: ReportData) -> list[Finding]:
    """Every rule's findings, in ``order``."""
    found = []
    for rule in RULES.values():
        found.extend(rule(d))
    return order(found)


__all__ = ["ACTION_ORDER", "Finding", "MIN_ROWS", "RULES", "order", "start_failed", "SENT_HIT_RATIO_FRACTION", "cross_region", "diagnose",
           "errors", "hbm_full", "hogwild", "lateness_split", "loadgen_saturated", "overloaded",
           "prefix_hits_lost", "residency", "session_cache", "transfer_tax"]
