"""Each per-request metric stated once (DESIGN.md's definitions), as a small expression over a
request record's columns. One statement, three evaluations: ``evaluate`` (numpy over column
arrays: the live view in a load process, and the request frame behind the report, the gate and
the capacity search), ``evaluate_arrow`` (pyarrow.compute over an Arrow table) and ``sql`` (an
expression for an engine that scans Parquet), in the expression language of ``reports.expr``.
``tests/test_definitions.py`` holds the first two equal on generated records. Statistics over
the values live apart (``reports.metrics``, ``reports.resampling``); the prose printed in
reports is ``reports.metric_kinds.DEFINITIONS``.

Imports numpy only (pyarrow inside the Arrow evaluation): a load process evaluates these
without pandas, pyarrow or pydantic (tests/test_loadgen_lean.py). Every flag below is
written to be true or false, never null.
"""

from __future__ import annotations

import itertools

from typing import Mapping, Sequence

import numpy as np

from kvbench.core.contract import SLO
from kvbench.reports.measures import expr as X
from kvbench.reports.measures.expr import (NULL, Coded, Col, Expr, Gaps, Limit, Lists, Vec, and_,
                                  coalesce, div, eq, gt, if_, is_null, le, not_, or_, sub)
from kvbench.reports.measures.expr import floats, gaps  # noqa: F401 - the frame and the live view

NS_PER_MS = 1e6


# --------------------------------------------------------------------------- the definitions


def within(value: Expr, key: str, absent_ok: "bool | Expr") -> Expr:
    """The request meets its class's limit on ``key`` (true when the class sets none); a
    request without the value meets it when ``absent_ok``."""
    return or_(is_null(Limit(key)), coalesce(le(value, Limit(key)), absent_ok))


OK = coalesce(eq(Col("status"), "ok"), False)
# cut by the run's own stop (or a search cutting a probe): neither a success nor an error
CANCELLED = coalesce(eq(Col("status"), "cancelled"), False)
FINISHED = not_(CANCELLED)
FAILED = and_(FINISHED, not_(OK))  # errors count as misses, cancelled requests are neither
# token counts: the server's usage, the client's count where the server gave none
PROMPT = coalesce(Col("prompt_tokens"), Col("prompt_tokens_client"))
COMPLETION = coalesce(Col("completion_tokens"), Col("completion_tokens_client"))
TTFT_MS = if_(OK, div(Col("ttft_ns"), NS_PER_MS), NULL)
E2E_MS = if_(OK, div(Col("e2e_ns"), NS_PER_MS), NULL)
# one-token answers have no TPOT (and the TPOT SLO does not apply to them)
TPOT_MS = if_(and_(OK, gt(COMPLETION, 1)), div(sub(E2E_MS, TTFT_MS), sub(COMPLETION, 1)), NULL)
# epoch ns: subtracted as integers (exact) before the division
LATENESS_MS = div(sub(Col("t_sent"), Col("t_scheduled")), NS_PER_MS)
# from the intended send time (coordinated omission): lateness + TTFT (E2E), summed in integer
# ns before the division; written as ttft - (scheduled - sent), the expressions have no "add"
LATE_NS = sub(Col("t_scheduled"), Col("t_sent"))
TTFT_INTENDED_MS = if_(OK, div(sub(Col("ttft_ns"), LATE_NS), NS_PER_MS), NULL)
E2E_INTENDED_MS = if_(OK, div(sub(Col("e2e_ns"), LATE_NS), NS_PER_MS), NULL)
HAS_SLO = or_(*(not_(is_null(Limit(k))) for k in SLO.LIMITS))
# sent without streaming (a trace's "type": "n"): no first token by design, so its class's
# TTFT limit does not apply (E2E does); a record from before the column counts as streamed
NOT_STREAMED = coalesce(eq(Col("streamed"), 0), False)
SLO_MET = and_(OK, within(TTFT_MS, "ttft_ms", NOT_STREAMED), within(TPOT_MS, "tpot_ms", True),
               within(E2E_MS, "e2e_ms", False))
JUDGED = and_(FINISHED, HAS_SLO)  # the denominator of SLO attainment
MET = and_(SLO_MET, HAS_SLO)  # its numerator, and goodput's count
HIT_COUNTED = and_(OK, not_(is_null(Col("cached_tokens"))), not_(is_null(PROMPT)))
ITL_GAPS_NS = Gaps(Col("chunk_offsets_ns"), OK)

# name -> definition; the request frame's columns of the same names are these
DEFINITIONS: dict[str, Expr] = {
    "ok": OK, "cancelled": CANCELLED, "finished": FINISHED, "failed": FAILED,
    "prompt_tokens": PROMPT, "completion_tokens": COMPLETION,
    "cached_tokens": Col("cached_tokens"), "ttft_ms": TTFT_MS,
    "tpot_ms": TPOT_MS, "e2e_ms": E2E_MS, "lateness_ms": LATENESS_MS,
    "ttft_intended_ms": TTFT_INTENDED_MS, "e2e_intended_ms": E2E_INTENDED_MS, "has_slo": HAS_SLO,
    "slo_met": SLO_MET, "judged": JUDGED, "met": MET, "hit_counted": HIT_COUNTED,
    "itl_gaps_ns": ITL_GAPS_NS}
FLAGS = frozenset({"ok", "cancelled", "finished", "failed", "has_slo", "slo_met", "judged",
                   "met", "hit_counted"})

# the record's columns the definitions read, and how they hold their values
INPUTS = {"status": "str", "request_class": "str", "t_scheduled": "int", "t_sent": "int",
          "ttft_ns": "int", "e2e_ns": "int", "prompt_tokens": "int",
          "prompt_tokens_client": "int", "completion_tokens": "int",
          "completion_tokens_client": "int", "cached_tokens": "int", "chunk_offsets_ns": "list",
          "streamed": "int"}  # a bool, held as 0/1


def gap_ms32(gaps_ns: np.ndarray) -> np.ndarray:
    """The report's ITL gaps in ms, stored as float32 (50M gaps stay 200 MB): ``gaps`` writes
    them into its float32 buffer, which rounds as ``astype`` would without a copy of its own."""
    return gaps_ns / NS_PER_MS


def gap_us(gaps_ns: np.ndarray) -> np.ndarray:
    """The live view's ITL gaps: to the nearest microsecond, in integers (its histograms count
    whole microseconds; ns offsets are exact there)."""
    return (gaps_ns + 500) // 1000


def slo_limits(slo) -> dict[str, dict[str, float]]:
    """``{class: {metric: limit ms}}`` of the classes with an SLO, from ``{class: SLO}`` (the
    contract's, bench.toml's, or their JSON objects)."""
    out = {}
    for cls, s in (slo or {}).items():
        s = SLO.from_dict(s) if isinstance(s, Mapping) else s
        lim = {k: float(v) for k in SLO.LIMITS if (v := getattr(s, k, None)) is not None}
        if lim:
            out[str(cls)] = lim
    return out


def inputs(names: Sequence[str]) -> list[str]:
    """The record columns the definitions ``names`` read (``request_class`` for SLO limits)."""
    found: set[str] = set()

    def walk(e: Expr) -> None:
        if isinstance(e, Col):
            found.add(e.name)
        elif isinstance(e, Limit):
            found.add("request_class")
        for a in e.args:
            walk(a)

    for n in names:
        walk(DEFINITIONS[n])
    return [c for c in INPUTS if c in found]


def sql(name: str, slo=None) -> str:
    """Definition ``name`` as a SQL expression over the requests table (DuckDB's dialect)."""
    return DEFINITIONS[name].sql(slo_limits(slo))


# --------------------------------------------------------------------------- evaluations


def column(values: list, kind: str) -> Vec | Lists:
    """A record column as the load process holds it (a list, None for a null) in memory."""
    n = len(values)
    if kind == "list":
        lens = np.fromiter((len(x) if x else 0 for x in values), np.int64, n)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        # chain's C loop: a nested generator here cost the live view twice its old derivation
        flat = np.fromiter(itertools.chain.from_iterable(x for x in values if x), np.int64,
                           int(offsets[-1]))
        return Lists(flat, offsets, np.fromiter((x is not None for x in values), bool, n))
    if kind == "str":
        data = np.array(values, dtype=object)
        return Vec(data, np.not_equal(data, None))
    try:  # the common case: no nulls
        return Vec(np.array(values, dtype=np.int64), np.ones(n, bool))
    except (TypeError, ValueError):
        valid = np.fromiter((v is not None for v in values), bool, n)
        return Vec(np.array([v if v is not None else 0 for v in values], np.int64), valid)


def evaluate(names: Sequence[str], columns: Mapping, slo=None, n: int | None = None,
             gaps_as: tuple | None = None, known: Mapping | None = None
             ) -> dict[str, Vec | Lists]:
    """Definitions ``names`` in memory over ``columns`` (``{name: list}`` as the record sink
    hands a batch over, or ``from_arrow``'s); flags as plain bool arrays. ``gaps_as``:
    (convert, dtype) of the ns gaps (``gap_ms32``); ``known``: values of definitions already
    evaluated, by name (a request frame's columns)."""
    if n is None:
        first = next(iter(columns.values()))
        n = len(first.valid) if isinstance(first, (Vec, Lists)) else len(first)
    return X.evaluate({k: DEFINITIONS[k] for k in names}, columns, INPUTS, column,
                      slo_limits(slo), n, FLAGS, gaps_as, known, DEFINITIONS)


def from_arrow(table, names: Sequence[str]) -> dict[str, Vec | Lists]:
    """The record columns ``names`` of an Arrow table or batch in memory, for ``evaluate``
    (strings as ``Coded``, lists as flat values and offsets, nulls in the validity)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out: dict[str, Vec | Lists] = {}
    for name in names:
        col, kind = table.column(name), INPUTS[name]
        valid = pc.is_valid(col).to_numpy(zero_copy_only=False)
        if kind == "list":
            lens = pc.fill_null(pc.list_value_length(col), 0).to_numpy(
                zero_copy_only=False).astype(np.int64)
            offsets = np.zeros(len(lens) + 1, np.int64)
            np.cumsum(lens, out=offsets[1:])
            flat = pc.list_flatten(col)
            flat = flat.to_numpy() if isinstance(flat, pa.Array) else (
                np.concatenate([c.to_numpy() for c in flat.chunks]) if flat.num_chunks
                else np.zeros(0, np.int64))
            out[name] = Lists(np.asarray(flat, np.int64), offsets, valid)
        elif kind == "str":
            enc = pc.dictionary_encode(col)
            enc = enc.combine_chunks() if hasattr(enc, "combine_chunks") else enc
            codes = pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False)
            out[name] = Vec(Coded(codes, enc.dictionary.to_pylist()), valid)
        else:
            data = pc.fill_null(pc.cast(col, pa.int64()), 0).to_numpy(zero_copy_only=False)
            out[name] = Vec(np.asarray(data, np.int64), valid)
    return out


def evaluate_arrow(table, names: Sequence[str], slo=None) -> dict:
    """Definitions ``names`` over an Arrow table by pyarrow.compute (the gaps as a list array
    of int64 ns; flags never null)."""
    return X.evaluate_arrow({k: DEFINITIONS[k] for k in names}, table, INPUTS,
                            slo_limits(slo), FLAGS)
