"""Each per-request metric stated once (DESIGN.md's definitions), as a small expression over a
request record's columns. One statement, three evaluations: ``evaluate`` (numpy over column
arrays: the live view in a load process, and the request frame behind the report, the gate and
the capacity search), ``evaluate_arrow`` (pyarrow.compute over an Arrow table) and ``sql`` (an
expression for an engine that scans Parquet). ``tests/test_definitions.py`` holds the first two
equal on generated records. Statistics over the values live apart (``reports.metrics``,
``reports.resampling``); the prose printed in reports is ``reports.metrics.DEFINITIONS``.

Imports numpy only (pyarrow inside the Arrow evaluation): a load process evaluates these
without pandas, pyarrow or pydantic (tests/test_loadgen_lean.py). Nulls follow SQL and Arrow:
arithmetic and comparisons with a null are null, ``and``/``or`` are Kleene's; every flag below
is written to be true or false, never null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from kvbench.core.contract import SLO

NS_PER_MS = 1e6


class Vec(NamedTuple):
    """A column in memory: values, and where they are valid (elsewhere null; the value there
    means nothing). ``data`` of a string column may be ``Coded``."""

    data: object
    valid: object


class Lists(NamedTuple):
    """A list column in memory: flat values, per-row offsets (rows + 1), rows valid."""

    values: np.ndarray
    offsets: np.ndarray
    valid: np.ndarray


class Coded:
    """A string column as dictionary codes (-1: null), compared with a string by its code:
    a report's million statuses are not turned into Python strings to find the "ok" ones."""

    def __init__(self, codes: np.ndarray, values: Sequence[str]):
        self.codes, self.values = codes, list(values)

    def __eq__(self, other) -> np.ndarray:  # type: ignore[override]
        code = self.values.index(other) if other in self.values else -2
        return self.codes == code

    __hash__ = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- expressions


class Expr:
    """A node of a definition. ``_np``/``_arrow`` evaluate it given its arguments' values."""

    args: tuple = ()

    def sql(self, limits: Mapping[str, Mapping[str, float]]) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Col(Expr):
    """A column of the request record (schema v1)."""

    name: str

    def sql(self, limits) -> str:
        return self.name


@dataclass(frozen=True)
class Lit(Expr):
    """A constant (None: null)."""

    value: object

    def sql(self, limits) -> str:
        v = self.value
        if v is None:
            return "NULL"
        if isinstance(v, bool):
            return "TRUE" if v else "FALSE"
        if isinstance(v, str):
            return "'" + v.replace("'", "''") + "'"
        return repr(v)


@dataclass(frozen=True)
class Limit(Expr):
    """The SLO limit (ms) of the request's class on ``key`` (null where its class sets none)."""

    key: str

    def sql(self, limits) -> str:
        when = " ".join(f"WHEN {Lit(c).sql(limits)} THEN {float(lim[self.key])!r}"
                        for c, lim in sorted(limits.items()) if self.key in lim)
        return f"(CASE request_class {when} END)" if when else "CAST(NULL AS DOUBLE)"


_SQL = {"sub": "({} - {})", "div": "(CAST({} AS DOUBLE) / {})", "eq": "({} = {})",
        "le": "({} <= {})", "gt": "({} > {})", "and": "({} AND {})", "or": "({} OR {})",
        "not": "(NOT {})", "is_null": "({} IS NULL)", "coalesce": "coalesce({}, {})",
        "if": "(CASE WHEN {} THEN {} ELSE {} END)"}


@dataclass(frozen=True)
class Call(Expr):
    """An operation (``_SQL`` names them) on the values of its arguments."""

    op: str
    args: tuple

    def sql(self, limits) -> str:
        return _SQL[self.op].format(*(a.sql(limits) for a in self.args))


@dataclass(frozen=True)
class Gaps(Expr):
    """Per row, the differences of consecutive values of a list column (empty where ``keep``
    is false or the list has fewer than two values)."""

    lists: Expr
    keep: Expr

    @property
    def args(self) -> tuple:
        return (self.lists, self.keep)

    def sql(self, limits) -> str:
        x = self.lists.sql(limits)
        return (f"(CASE WHEN {self.keep.sql(limits)} THEN list_transform(range(1, "
                f"coalesce(len({x}), 0)), lambda i: {x}[i + 1] - {x}[i]) ELSE [] END)")


def _call(op: str) -> Callable[..., Call]:
    return lambda *args: Call(op, tuple(a if isinstance(a, Expr) else Lit(a) for a in args))


sub, div, eq, le, gt, coalesce, if_ = (_call(o) for o in ("sub", "div", "eq", "le", "gt",
                                                          "coalesce", "if"))
not_, is_null = _call("not"), _call("is_null")


def and_(*xs) -> Call:
    out = xs[0]
    for x in xs[1:]:
        out = _call("and")(out, x)
    return out


def or_(*xs) -> Call:
    out = xs[0]
    for x in xs[1:]:
        out = _call("or")(out, x)
    return out


NULL = Lit(None)


def within(value: Expr, key: str, absent_ok: bool) -> Expr:
    """The request meets its class's limit on ``key`` (true when the class sets none); a
    request without the value meets it when ``absent_ok``."""
    return or_(is_null(Limit(key)), coalesce(le(value, Limit(key)), absent_ok))


# --------------------------------------------------------------------------- the definitions

OK = coalesce(eq(Col("status"), "ok"), False)
# cut by the run's own stop (or a search cutting a probe): neither a success nor an error
CANCELLED = coalesce(eq(Col("status"), "cancelled"), False)
FINISHED = not_(CANCELLED)
ERROR = and_(FINISHED, not_(OK))  # errors count as misses, cancelled requests are neither
# token counts: the server's usage, the client's count where the server gave none
PROMPT = coalesce(Col("prompt_tokens"), Col("prompt_tokens_client"))
COMPLETION = coalesce(Col("completion_tokens"), Col("completion_tokens_client"))
TTFT_MS = if_(OK, div(Col("ttft_ns"), NS_PER_MS), NULL)
E2E_MS = if_(OK, div(Col("e2e_ns"), NS_PER_MS), NULL)
# one-token answers have no TPOT (and the TPOT SLO does not apply to them)
TPOT_MS = if_(and_(OK, gt(COMPLETION, 1)), div(sub(E2E_MS, TTFT_MS), sub(COMPLETION, 1)), NULL)
# epoch ns: subtracted as integers (exact) before the division
LATENESS_MS = div(sub(Col("t_sent"), Col("t_scheduled")), NS_PER_MS)
HAS_SLO = or_(*(not_(is_null(Limit(k))) for k in SLO.LIMITS))
SLO_MET = and_(OK, within(TTFT_MS, "ttft_ms", False), within(TPOT_MS, "tpot_ms", True),
               within(E2E_MS, "e2e_ms", False))
JUDGED = and_(FINISHED, HAS_SLO)  # the denominator of SLO attainment
MET = and_(SLO_MET, HAS_SLO)  # its numerator, and goodput's count
HIT_COUNTED = and_(OK, not_(is_null(Col("cached_tokens"))), not_(is_null(PROMPT)))
ITL_GAPS_NS = Gaps(Col("chunk_offsets_ns"), OK)

# name -> definition; the request frame's columns of the same names are these
DEFINITIONS: dict[str, Expr] = {
    "ok": OK, "cancelled": CANCELLED, "finished": FINISHED, "error": ERROR,
    "prompt_tokens": PROMPT, "completion_tokens": COMPLETION, "ttft_ms": TTFT_MS,
    "tpot_ms": TPOT_MS, "e2e_ms": E2E_MS, "lateness_ms": LATENESS_MS, "has_slo": HAS_SLO,
    "slo_met": SLO_MET, "judged": JUDGED, "met": MET, "hit_counted": HIT_COUNTED,
    "itl_gaps_ns": ITL_GAPS_NS}
FLAGS = frozenset(k for k, e in DEFINITIONS.items() if e in (
    OK, CANCELLED, FINISHED, ERROR, HAS_SLO, SLO_MET, JUDGED, MET, HIT_COUNTED))

# the record's columns the definitions read, and how they hold their values
INPUTS = {"status": "str", "request_class": "str", "t_scheduled": "int", "t_sent": "int",
          "ttft_ns": "int", "e2e_ns": "int", "prompt_tokens": "int",
          "prompt_tokens_client": "int", "completion_tokens": "int",
          "completion_tokens_client": "int", "cached_tokens": "int", "chunk_offsets_ns": "list"}


def gap_ms32(gaps_ns: np.ndarray) -> np.ndarray:
    """The report's ITL gaps: float32 ms (50M gaps stay 200 MB)."""
    return (gaps_ns / NS_PER_MS).astype(np.float32)


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


# --------------------------------------------------------------------------- in memory (numpy)


def column(values: list, kind: str) -> Vec | Lists:
    """A record column as the load process holds it (a list, None for a null) in memory."""
    n = len(values)
    if kind == "list":
        lens = np.fromiter((len(x) if x else 0 for x in values), np.int64, n)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.fromiter((v for x in values if x for v in x), np.int64, int(offsets[-1]))
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
             gaps_as: tuple | None = None) -> dict[str, Vec | Lists]:
    """Definitions ``names`` over ``columns`` (``{name: list}`` as the record sink hands a
    batch over, or ``{name: Vec | Lists}``); flags come back as plain bool arrays (valid
    everywhere). ``gaps_as``: (convert, dtype) of the ns gaps (``gaps``)."""
    limits = slo_limits(slo)
    cache: dict[str, Vec | Lists] = {}
    if n is None:
        first = next(iter(columns.values()))
        n = len(first.valid) if isinstance(first, (Vec, Lists)) else len(first)

    def col(name: str) -> Vec | Lists:
        got = cache.get(name)
        if got is None:
            raw = columns[name]
            got = cache[name] = raw if isinstance(raw, (Vec, Lists)) else column(
                raw, INPUTS[name])
        return got

    memo: dict[int, Vec | Lists] = {}

    def ev(e: Expr) -> Vec | Lists:
        got = memo.get(id(e))
        if got is None:
            got = memo[id(e)] = _np(e, ev, col, limits, n, gaps_as or (None, np.int64))
        return got

    out = {}
    for name in names:
        v = ev(DEFINITIONS[name])
        if isinstance(v, Vec):
            v = Vec(np.broadcast_to(v.data, (n,)), np.broadcast_to(v.valid, (n,)))
            if name in FLAGS:
                v = Vec(np.asarray(v.data & v.valid, bool), np.ones(n, bool))
        out[name] = v
    return out


def floats(v: Vec) -> np.ndarray:
    """A numeric column as float64, null as NaN."""
    return np.where(v.valid, np.asarray(v.data, np.float64), np.nan)


def _np(e: Expr, ev, col, limits, n, gaps_as) -> Vec | Lists:
    if isinstance(e, Col):
        return col(e.name)
    if isinstance(e, Lit):
        return Vec(False if e.value is None else e.value, e.value is not None)
    if isinstance(e, Limit):
        cls = col("request_class")
        data = np.full(n, np.nan)
        for c, lim in limits.items():
            if e.key in lim:
                data[np.asarray(cls.data == c, bool) & cls.valid] = lim[e.key]
        return Vec(data, ~np.isnan(data))
    if isinstance(e, Gaps):
        lists, keep = ev(e.lists), ev(e.keep)
        return gaps(lists.values, lists.offsets, np.broadcast_to(keep.data & keep.valid, (n,)),
                    *gaps_as)
    a = [ev(x) for x in e.args]
    with np.errstate(all="ignore"):
        return _NP[e.op](*a)


def _arith(f):
    return lambda a, b: Vec(f(a.data, b.data), np.logical_and(a.valid, b.valid))


def _and(a: Vec, b: Vec) -> Vec:
    false = (a.valid & ~np.asarray(a.data, bool)) | (b.valid & ~np.asarray(b.data, bool))
    return Vec(~false, false | (a.valid & b.valid))


def _or(a: Vec, b: Vec) -> Vec:
    true = (a.valid & np.asarray(a.data, bool)) | (b.valid & np.asarray(b.data, bool))
    return Vec(true, true | (a.valid & b.valid))


def _if(c: Vec, a: Vec, b: Vec) -> Vec:
    cond = np.asarray(c.data, bool)
    return Vec(np.where(cond, a.data, b.data), c.valid & np.where(cond, a.valid, b.valid))


_NP = {"sub": _arith(np.subtract), "div": _arith(np.true_divide),
       "eq": _arith(lambda x, y: np.asarray(x == y, bool)), "le": _arith(np.less_equal),
       "gt": _arith(np.greater), "and": _and, "or": _or,
       "not": lambda a: Vec(~np.asarray(a.data, bool), a.valid),
       "is_null": lambda a: Vec(~np.asarray(a.valid, bool), True),
       "coalesce": lambda a, b: Vec(np.where(a.valid, a.data, b.data),
                                    np.logical_or(a.valid, b.valid)),
       "if": _if}


def gaps(values: np.ndarray, offsets: np.ndarray, keep: np.ndarray | None = None,
         convert: Callable[[np.ndarray], np.ndarray] | None = None, dtype=np.int64,
         block: int = 4_000_000) -> Lists:
    """``Gaps`` in memory: on the flat value buffer (no per-row Python), in blocks of
    ``block`` values (bounded temporaries: a report holds 50M gaps), each block of ns gaps
    ``convert``-ed into ``dtype`` (``gap_ms32``: the report's float32 ms)."""
    lens = np.diff(offsets)
    n_gaps = np.maximum(lens - 1, 0)
    ends = offsets[1:] - offsets[0]
    values = values[offsets[0]:offsets[-1]] if len(offsets) else values[:0]
    # A diff at flat position i is a gap unless i is the last value of its row (or its row is
    # not kept).
    keep_flat = np.ones(max(len(values) - 1, 0), bool)
    last = ends[lens > 0] - 1
    keep_flat[last[last < len(keep_flat)]] = False
    if keep is not None and not np.all(keep):
        drop = ~np.asarray(keep, bool) & (lens > 1)
        starts = ends - lens
        size = len(keep_flat) + 1
        mark = (np.bincount(starts[drop], minlength=size)
                - np.bincount(ends[drop] - 1, minlength=size))
        keep_flat &= np.cumsum(mark)[:-1] == 0
        n_gaps = np.where(drop, 0, n_gaps)
    new_offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(n_gaps, out=new_offsets[1:])
    out = np.empty(int(new_offsets[-1]), dtype)
    pos = 0
    for s in range(0, len(keep_flat), block):
        e = min(s + block, len(keep_flat))
        d = (values[s + 1:e + 1] - values[s:e])[keep_flat[s:e]]
        out[pos:pos + len(d)] = convert(d) if convert is not None else d
        pos += len(d)
    return Lists(out, new_offsets, np.ones(len(lens), bool))


# --------------------------------------------------------------------------- columnar (Arrow)


def from_arrow(table, names: Sequence[str]) -> dict[str, Vec | Lists]:
    """The record columns ``names`` of an Arrow table in memory, for ``evaluate`` (strings as
    ``Coded``, lists as flat values and offsets, nulls in the validity)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out: dict[str, Vec | Lists] = {}
    for name in names:
        col = table.column(name)
        valid = pc.is_valid(col).to_numpy(zero_copy_only=False)
        kind = INPUTS[name]
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
    """Definitions ``names`` over an Arrow table by pyarrow.compute: an array per definition
    (a list array of int64 ns for the gaps; nulls where a value is null; flags never null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    limits = slo_limits(slo)
    n = table.num_rows
    memo: dict[int, object] = {}

    def ev(e: Expr):
        got = memo.get(id(e))
        if got is None:
            got = memo[id(e)] = _arrow(e, ev, table, limits, n, pa, pc)
        return got

    out = {}
    for name in names:
        v = ev(DEFINITIONS[name])
        if isinstance(v, pa.Scalar):
            v = pa.array([v.as_py()] * n, v.type)
        if isinstance(v, pa.ChunkedArray):
            v = v.combine_chunks()
        out[name] = pc.fill_null(v, False) if name in FLAGS else v
    return out


def _arrow(e: Expr, ev, table, limits, n, pa, pc):
    if isinstance(e, Col):
        col = table.column(e.name)
        return col if INPUTS[e.name] != "int" else pc.cast(col, pa.int64())
    if isinstance(e, Lit):
        return pa.scalar(e.value)
    if isinstance(e, Limit):
        classes = [c for c, lim in limits.items() if e.key in lim]
        if not classes:
            return pa.nulls(n, pa.float64())
        cls = table.column("request_class")
        if pa.types.is_dictionary(cls.type):
            cls = pc.cast(cls, pa.string())
        idx = pc.index_in(cls, value_set=pa.array(classes, pa.string()))
        return pc.take(pa.array([limits[c][e.key] for c in classes], pa.float64()), idx)
    if isinstance(e, Gaps):
        lists = ev(e.lists)
        lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
        keep = pc.fill_null(ev(e.keep), False)
        keep = keep.combine_chunks() if isinstance(keep, pa.ChunkedArray) else keep
        flat = pc.list_flatten(lists)
        parent = pc.list_parent_indices(lists)
        # a gap closes at flat position i when i - 1 is of the same row, and that row is kept
        same = pc.equal(pc.pairwise_diff(parent), 0)
        mask = pc.fill_null(pc.and_(same, pc.array_take(keep, parent)), False)
        values = pc.filter(pc.pairwise_diff(pc.cast(flat, pa.int64())), mask)
        lens = pc.fill_null(pc.list_value_length(lists), 0)
        n_gaps = pc.if_else(keep, pc.max_element_wise(pc.subtract(lens, 1), 0), 0)
        offsets = pa.array(np.concatenate([[0], np.cumsum(
            n_gaps.to_numpy(zero_copy_only=False), dtype=np.int64)]), pa.int64())
        return pa.LargeListArray.from_arrays(offsets, values)
    a = [ev(x) for x in e.args]
    if e.op == "div":
        a = [pc.cast(x, pa.float64()) for x in a]
    return _ARROW[e.op](pc)(*a)


_ARROW = {"sub": lambda pc: pc.subtract, "div": lambda pc: pc.divide,
          "eq": lambda pc: pc.equal, "le": lambda pc: pc.less_equal,
          "gt": lambda pc: pc.greater, "and": lambda pc: pc.and_kleene,
          "or": lambda pc: pc.or_kleene, "not": lambda pc: pc.invert,
          "is_null": lambda pc: pc.is_null, "coalesce": lambda pc: pc.coalesce,
          "if": lambda pc: pc.if_else}
