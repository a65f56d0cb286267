"""Cumulative histograms of the engines' latencies, with vLLM's bucket edges (seconds) for
the series the emulator publishes under vLLM's names."""

from __future__ import annotations

import bisect

# Bucket edges (seconds) as in vLLM's histograms of the same names.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# How late an engine step ends against its modelled deadline (kvbench's own series).
LATENESS_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class Histogram:
    __slots__ = ("edges", "counts", "sum", "count")

    def __init__(self, edges):
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += n
        self.sum += value * n
        self.count += n

    def quantile(self, q: float) -> float:
        """Upper bucket edge holding the q-quantile (inf past the last edge)."""
        if self.count == 0:
            return 0.0
        want = q * self.count
        acc = 0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= want:
                return self.edges[i] if i < len(self.edges) else float("inf")
        return float("inf")
