"""Small expressions over a table's columns, evaluated in memory (``evaluate``: numpy over
column arrays) or columnar (``evaluate_arrow``: pyarrow.compute over an Arrow table) and rendered
as SQL (``Expr.sql``), with SQL's and Arrow's nulls: arithmetic and comparisons with a null are
null, ``and``/``or`` are Kleene's, ``if`` with a null condition is null. The metric definitions
(``reports.definitions``) are written in it.

Imports numpy only (pyarrow inside the Arrow evaluation): a load process evaluates these.
In memory a column is a ``Vec`` (values and validity) or ``Lists`` (flat values and offsets).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np


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
    return functools.reduce(_call("and"), xs)


def or_(*xs) -> Call:
    return functools.reduce(_call("or"), xs)


NULL = Lit(None)


# --------------------------------------------------------------------------- in memory (numpy)


def evaluate(exprs: Mapping[str, Expr], columns: Mapping, kinds: Mapping[str, str],
             convert: Callable, limits: Mapping[str, Mapping[str, float]], n: int,
             flags=frozenset(), gaps_as: tuple | None = None, known: Mapping | None = None,
             named: Mapping[str, Expr] | None = None) -> dict[str, Vec | Lists]:
    """``{name: expression}`` over ``columns`` (``{name: Vec | Lists}``, or values
    ``convert(values, kinds[name])`` turns into one); ``flags`` come back as plain bool arrays
    (null as false).
    ``gaps_as``: (convert, dtype) of ``Gaps``; ``known``: values of some expressions of
    ``named`` (default ``exprs``) already evaluated, by name, taken as they are where another
    expression reads them."""
    cache: dict[str, Vec | Lists] = {}
    names = {id(e): k for k, e in (named or exprs).items()}

    def col(name: str) -> Vec | Lists:
        got = cache.get(name)
        if got is None:
            raw = columns[name]
            got = cache[name] = raw if isinstance(raw, (Vec, Lists)) else convert(
                raw, kinds[name])
        return got

    # a node's value is kept while a node still to be evaluated reads it, then let go: a
    # report's frame holds 1M rows, and every intermediate column kept to the end cost 30%
    # more peak memory than the frame itself needed
    uses: dict[int, int] = {}
    seen: set[int] = set()

    def count(e: Expr) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        for x in {id(x): x for x in e.args}.values():
            uses[id(x)] = uses.get(id(x), 0) + 1
            count(x)

    for e in exprs.values():
        uses[id(e)] = uses.get(id(e), 0) + 1
        count(e)
    memo: dict[int, Vec | Lists] = {}

    def done_with(e: Expr) -> None:
        uses[id(e)] -= 1
        if uses[id(e)] == 0:
            memo.pop(id(e), None)

    def count_off(e: Expr) -> None:
        """``e`` was given, not evaluated: what only it would have read is not read."""
        for x in {id(x): x for x in e.args}.values():
            uses[id(x)] -= 1
            if uses[id(x)] == 0 and id(x) not in memo:
                count_off(x)

    def ev(e: Expr) -> Vec | Lists:
        got = memo.get(id(e))
        if got is None:
            name = names.get(id(e))
            if known is not None and name in known:
                got = memo[id(e)] = known[name]
                count_off(e)  # its arguments are not read
            else:
                got = memo[id(e)] = _np(e, ev, col, limits, n, gaps_as or (None, np.int64))
                for x in {id(x): x for x in e.args}.values():
                    done_with(x)
        return got

    out = {}
    for name, e in exprs.items():
        v = ev(e)
        done_with(e)
        if isinstance(v, Vec):
            v = Vec(np.broadcast_to(v.data, (n,)), np.broadcast_to(v.valid, (n,)))
            if name in flags:
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
        # the diffs inside a dropped row, start .. start + len - 2 (its last is a row's last):
        # indexed directly, so the work is the dropped rows' values, not the whole buffer's
        starts, inner = (ends - lens)[drop], lens[drop] - 1
        if len(starts):
            first = np.cumsum(inner) - inner
            keep_flat[np.arange(int(inner.sum())) + np.repeat(starts - first, inner)] = False
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


def evaluate_arrow(exprs: Mapping[str, Expr], table, kinds: Mapping[str, str],
                   limits: Mapping[str, Mapping[str, float]], flags=frozenset()) -> dict:
    """``{name: expression}`` over an Arrow table by pyarrow.compute: an array each (nulls
    where a value is null; ``flags`` never null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    memo: dict[int, object] = {}

    def ev(e: Expr):
        got = memo.get(id(e))
        if got is None:
            got = memo[id(e)] = _arrow(e, ev, table, kinds, limits, n, pa, pc)
        return got

    out = {}
    for name, e in exprs.items():
        v = ev(e)
        if isinstance(v, pa.Scalar):
            v = pa.array([v.as_py()] * n, v.type)
        if isinstance(v, pa.ChunkedArray):
            v = v.combine_chunks()
        out[name] = pc.fill_null(v, False) if name in flags else v
    return out


def _arrow(e: Expr, ev, table, kinds, limits, n, pa, pc):
    if isinstance(e, Col):
        col = table.column(e.name)
        return col if kinds[e.name] != "int" else pc.cast(col, pa.int64())
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
    return getattr(pc, _ARROW.get(e.op, e.op))(*a)


# pyarrow.compute's names of the operations, where they differ
_ARROW = {"sub": "subtract", "div": "divide", "eq": "equal", "le": "less_equal",
          "gt": "greater", "and": "and_kleene", "or": "or_kleene", "not": "invert",
          "if": "if_else"}
