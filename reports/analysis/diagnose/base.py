"""What every finding shares: the ``Finding`` a rule returns, and the number formats and
thresholds the rules have in common."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MIN_ROWS = 10  # fewest requests per side of a comparison


@dataclass
class Finding:
    rule: str
    title: str
    evidence: list[tuple[str, str]]
    cause: str
    fix: str
    endpoint: str | None = None
    severity: str = "warning"
    numbers: dict = field(default_factory=dict)  # raw values, for tests and the Markdown


def _fmt(x: float, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if unit == "%":
        return f"{100 * x:.1f}%"
    return f"{x:,.1f}{(' ' + unit) if unit else ''}"


def _median(v) -> float:
    v = np.asarray(v, np.float64)
    v = v[~np.isnan(v)]
    return float(np.median(v)) if len(v) else math.nan

