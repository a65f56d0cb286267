"""Estimates over requests and their intervals: the bootstrap engine, the metric kinds and the
registry every reported figure is evaluated through."""
