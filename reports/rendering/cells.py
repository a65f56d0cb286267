"""A figure as the report prints it (``fmt``), and rows of cells with the best of each row
marked: the pieces every table of the report is made of."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from kvbench.reports.statistics import metrics as M
from kvbench.reports.statistics.resampling import CI

# Not computed for requests of classes without an SLO: shown as "no SLO", never 100%.
SLO_METRICS = ("goodput_rps", "slo_attainment")
NO_SLO = "no SLO"


def fmt(x, unit: str = "") -> str:
    from jinja2 import Undefined

    if x is None or isinstance(x, Undefined):
        return "–"
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(xf):
        return "–"
    if unit == "fraction":
        return f"{100 * xf:.1f}%"
    if unit == "count":
        return f"{xf:,.0f}"
    if abs(xf) >= 1000:
        return f"{xf:,.0f}"
    if abs(xf) >= 100:
        return f"{xf:.1f}"
    if abs(xf) >= 1:
        return f"{xf:.2f}"
    return f"{xf:.3g}"


@dataclass
class Cell:
    text: str
    value: float
    best: bool = False
    ci: str = ""


def best_of(values: Sequence[float], higher: bool, unit: str = "") -> set[int]:
    """Indices of the best value; values that print the same as the best tie with it."""
    finite = [(i, v) for i, v in enumerate(values) if v is not None and not math.isnan(v)]
    if len(finite) < 2:
        return set()
    target = max(v for _, v in finite) if higher else min(v for _, v in finite)
    shown = fmt(target, unit)
    best = {i for i, v in finite if v == target or fmt(v, unit) == shown}
    return set() if len(best) == len(finite) else best


def metric_row(label: str, unit: str, values: list[float], higher: bool | None,
               cis: list[CI | None] | None = None, unit_fmt: str | None = None,
               no_slo: Sequence[bool] | None = None) -> dict:
    """``no_slo[i]``: column i has no request of a class with an SLO (shown "no SLO")."""
    best = best_of(values, higher, unit_fmt or unit) if higher is not None else set()
    cells = []
    for i, v in enumerate(values):
        ci = ""
        if cis and cis[i] is not None and not math.isnan(cis[i].low):
            ci = f"[{fmt(cis[i].low, unit_fmt or unit)}, {fmt(cis[i].high, unit_fmt or unit)}]"
        text = NO_SLO if no_slo is not None and no_slo[i] else fmt(v, unit_fmt or unit)
        cells.append(Cell(text, v, i in best, ci))
    shown_unit = "" if unit in ("count", "fraction") else unit
    return {"label": label, "unit": shown_unit, "cells": cells,
            "better": "" if higher is None else ("higher" if higher else "lower")}


def table_rows(t: pd.DataFrame, keys: list[str], mark_within: str | None = None) -> dict:
    """Rows of a grouped table with each metric formatted and the best per group marked."""
    metric_cols = [c for c in t.columns if c in M.METRIC_INFO]
    best: dict[tuple, set] = {}
    if mark_within is not None:
        for _, grp in t.groupby(mark_within, sort=False, observed=True):
            for c in metric_cols:
                info = M.METRIC_INFO[c]
                for i in best_of(list(grp[c]), info.higher_is_better, info.unit):
                    best.setdefault((grp.index[i],), set()).add(c)
    rows = []
    for idx, r in t.iterrows():
        no_slo = bool(r.get("_no_slo", False))
        cells = [Cell(NO_SLO if no_slo and c in SLO_METRICS else fmt(r[c], M.METRIC_INFO[c].unit),
                      r[c], c in best.get((idx,), set()) and not (no_slo and c in SLO_METRICS))
                 for c in metric_cols]
        rows.append({"keys": [str(r[k]) if not (isinstance(r[k], float) and math.isnan(r[k]))
                              else "–" for k in keys],
                     "requests": f"{int(r['requests']):,}", "cells": cells})
    return {"keys": keys, "metrics": [M.METRIC_INFO[c].label for c in metric_cols],
            "rows": rows}

