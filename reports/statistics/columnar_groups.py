"""Exact figures of named metrics per (endpoint, request_class) over every request of a run,
in bounded memory (issue 34): what the gate compares when a run is too large to load whole.

``columnar.aggregate`` groups by (endpoint, workload, request_class, stage) and (endpoint,
workload); a gate rule selects an endpoint and a class (or ``*``, every class) across
workloads and stages, and an exact percentile of such a selection cannot be assembled from its
groups' percentiles. This module computes the registry's metrics (``reports.statistics.
metrics``) for such selections from the run's Parquet records, read in batches:

* per-request values (TTFT, TPOT, E2E, lateness: a ``PerRequest`` metric) are the request
  frame's own columns (``measures.frame.request_frame`` on each batch, so one definition),
  kept as float64 for the selections only (8 bytes a request: 80 MB at 10M) and taken by
  ``numpy.quantile`` itself, so the figure is the in-memory one to the last bit;
* counts, rates and ratios (``Count``, ``Goodput``, ``TokenRate``, ``PrefixHitRatio``) sum the
  metric's own flags over batches; a rate's window (a stage's achieved, offered or started
  interval, summed over the selection's stages) is a min or max over a stage's rows, so the
  rows reaching each extreme are kept (a few per stage per batch) and the request frame of
  those rows alone gives every stage's window exactly as the whole frame would;
* ITL (``PooledGaps``: ~47 gaps a request, 470M at 10M requests) by a two-pass selection over
  the float32 ms gaps the frame's gap store holds: pass 1 counts gaps per bucket (the float's
  top bits, monotone in the value) per selection; pass 2 keeps only the gaps of the buckets
  holding the wanted order statistics, sorted here, and interpolated as ``numpy.quantile``
  does for a Python float q (``_lerp``: float32 arithmetic, a weak float64 weight). ITL's
  mean is a float64 sum over batches (equal to numpy's pairwise sum to about 1e-15 relative,
  not bit for bit).

Only compacted Parquet records are read (``columnar.parquet_files``): the gate samples and
counts the same files (``gate.load_bounded``); worker clock offsets are applied as the store's
reader applies them (``compact.align_worker_clocks``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbench.core.schema import REQUESTS
from kvbench.reports.measures import definitions as D
from kvbench.reports.measures.frame import GapStore, achieved_s, defined, request_frame
from kvbench.reports.statistics import metrics as M
from kvbench.reports.statistics.columnar import parquet_files
from kvbench.reports.statistics.metric_kinds import (Count, Goodput, PerRequest, PooledGaps,
                                                     PrefixHitRatio, TokenRate, _rate)

BATCH_ROWS = 131_072  # requests per batch (one row group of the compacted layout)
ITL_BATCH_ROWS = 16_384  # ~800k gaps: ITL's temporaries stay a few MB
_LISTS = ("chunk_offsets_ns", "chunk_tokens")
SCALAR_COLUMNS = tuple(f.name for f in REQUESTS if f.name not in _LISTS)
# what the registry's metrics read of a request (its definitions' inputs, the group keys and
# the stage times); the request frame's other columns are given as nulls, never read
METRIC_INPUTS = frozenset({*D.inputs([k for k in D.DEFINITIONS if k != "itl_gaps_ns"]),
                           "endpoint", "workload", "request_class", "stage", "t_scheduled",
                           "t_sent", "ttft_ns", "e2e_ns"})
# an ITL bucket: the float32's bits above the 10 top mantissa bits (1024 per octave)
_SHIFT = 23 - 10
_BUCKETS = 1 << (32 - _SHIFT)
_STAGE = ("endpoint", "workload", "stage")

Selection = tuple[str, str]  # (endpoint, request_class or "*")


def _batches(run_dir: Path, columns: Sequence[str], offsets_ns, batch_rows: int,
             read: frozenset | None = None):
    """``columns`` of the run's Parquet records as tables of at most ``batch_rows`` rows:
    partition keys and columns an older file lacks (or not in ``read``, when given) filled in
    as nulls of their ``REQUESTS`` types, worker clocks aligned."""
    from kvbench.core.compact import align_worker_clocks

    if read is not None and offsets_ns and any(int(o) for o in offsets_ns.values()):
        read = read | {"worker"}
    schema = pa.schema([REQUESTS.field(c) for c in columns])
    for f, keys in parquet_files(run_dir):
        have = set(pq.read_schema(f).names) & (read if read is not None else set(columns))
        own = [c for c in columns if c in have and c not in keys]
        # read in row groups' worth, handed on in slices (fewer, larger reads)
        for whole in pq.ParquetFile(f, pre_buffer=False).iter_batches(
                batch_size=max(batch_rows, BATCH_ROWS), columns=own):
            for start in range(0, whole.num_rows, batch_rows):
                b = whole.slice(start, batch_rows)
                n = b.num_rows
                cols = []
                for c in columns:
                    field = REQUESTS.field(c)
                    if c in keys:
                        cols.append(pa.array([keys[c]] * n).cast(field.type))
                    elif c in own:
                        col = b.column(c)
                        cols.append(col if col.type == field.type else col.cast(field.type))
                    else:
                        cols.append(pa.nulls(n, field.type))
                t = pa.Table.from_arrays(cols, schema=schema)
                yield align_worker_clocks(t, offsets_ns) if "worker" in columns else t


def _no_gaps(n: int) -> GapStore:
    return GapStore(np.zeros(0, np.float32), np.zeros(n + 1, np.int64))


def _mask(frame: pd.DataFrame, sel: Selection) -> np.ndarray:
    rows = np.asarray(frame["endpoint"] == sel[0])
    if sel[1] != "*":
        rows = rows & np.asarray(frame["request_class"] == sel[1])
    return rows


def _extremes(table: pa.Table, frame: pd.DataFrame) -> np.ndarray:
    """Row numbers reaching, per stage, each extreme ``frame._stage_walls`` takes."""
    t_sched = frame["t_scheduled_ns"].to_numpy(np.float64)
    t_sent = frame["t_sent_ns"].to_numpy(np.float64)
    t_end = frame["t_done_ns"].to_numpy(np.float64)
    ttft = pc.cast(table.column("ttft_ns"), pa.float64()).to_numpy()
    sent = t_sent > 0
    done = ~frame["cancelled"].to_numpy(bool) & sent
    has_tok = frame["ok"].to_numpy(bool) & sent & ~np.isnan(ttft)
    key = frame["stage_key"].to_numpy()
    rows = []
    for values, where, largest in ((t_sched, None, False), (t_sched, None, True),
                                   (t_end, None, True), (t_sent, sent, False),
                                   (t_end, done, True), (t_sent + ttft, has_tok, True)):
        idx = np.arange(len(key)) if where is None else np.flatnonzero(where)
        if not len(idx):
            continue
        s = pd.Series(values[idx], index=idx)
        g = s.groupby(key[idx], sort=False)
        rows.append((g.idxmax() if largest else g.idxmin()).to_numpy())
    return np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)


class _Acc:
    """What one selection needs over the batches for the non-ITL metrics."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.values: dict[str, list[np.ndarray]] = {}
        self.stages: set[tuple] = set()
        self.has_slo = False

    def add(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0) + value


def _stage_ids(frame: pd.DataFrame, rows: np.ndarray) -> set[tuple]:
    sub = frame.loc[rows, list(_STAGE)]
    return set(map(tuple, sub.astype(object).drop_duplicates().itertuples(index=False,
                                                                         name=None)))


def _scan(run: int, run_dir: Path, stages, slo, offsets_ns, needs: Mapping[Selection, list],
          accs: Mapping[Selection, "_Acc"], batch_rows: int) -> pd.DataFrame:
    """One pass over run number ``run``: each selection's sums and per-request values into
    ``accs``; returns the frame of the rows at each stage's extremes (its windows)."""
    keep: list[pa.Table] = []
    for t in _batches(run_dir, SCALAR_COLUMNS, offsets_ns, batch_rows, METRIC_INPUTS):
        f = request_frame(t, stages=stages, slo=slo, gaps=_no_gaps(t.num_rows))
        ext = _extremes(t, f)
        if len(ext):
            keep.append(t.take(pa.array(ext)))
        for sel, metrics in needs.items():
            rows = _mask(f, sel)
            if not rows.any():
                continue
            acc = accs[sel]
            acc.stages |= {(run, *k) for k in _stage_ids(f, rows)}
            acc.add("rows", int(rows.sum()))
            for m in metrics:
                _accumulate(acc, m, f, rows)
    table = (pa.concat_tables(keep) if keep
             else pa.Table.from_pylist([], schema=pa.schema([REQUESTS.field(c)
                                                             for c in SCALAR_COLUMNS])))
    return request_frame(table, stages=stages, slo=slo, gaps=_no_gaps(table.num_rows))


def _accumulate(acc: _Acc, m, f: pd.DataFrame, rows: np.ndarray) -> None:
    if isinstance(m, PerRequest):
        v = f[m.source].to_numpy(np.float64)[rows]
        acc.values.setdefault(m.source, []).append(v[~np.isnan(v)])
    elif isinstance(m, Count):
        flags = np.asarray(m.flag(f), bool)
        acc.add(f"{m.name}:flag", int(flags[rows].sum()))
        if m.over is not None:
            over = np.asarray(m.over(f), bool) & rows
            acc.add(f"{m.name}:over_flag", int(flags[over].sum()))
            acc.add(f"{m.name}:over", int(over.sum()))
        if isinstance(m, Goodput):
            acc.has_slo = acc.has_slo or bool(np.asarray(defined(f, "has_slo"))[rows].any())
    elif isinstance(m, TokenRate):
        ok = f["ok"].to_numpy(bool) & rows
        acc.add(f"{m.name}:sum", float(np.nansum(f[m.column].to_numpy(np.float64)[ok])))
    elif isinstance(m, PrefixHitRatio):
        counted = np.asarray(defined(f, "hit_counted"), bool) & rows
        acc.add(f"{m.name}:cached", float(f["cached_tokens"].to_numpy(np.float64)[counted]
                                          .sum()))
        acc.add(f"{m.name}:prompt", float(f["prompt_tokens"].to_numpy(np.float64)[counted]
                                          .sum()))


def _windows(walls: Sequence[pd.DataFrame], stages: set) -> pd.DataFrame:
    """The extremes frames' rows of the selection's ``stages`` ((run, endpoint, workload,
    stage)), every run's stage keys kept apart (``frame.concat``)."""
    from kvbench.reports.measures.frame import concat

    parts = []
    for i, w in enumerate(walls):
        ids = pd.Series([(i, *k) for k in w[list(_STAGE)].astype(object).itertuples(
            index=False, name=None)], index=w.index, dtype=object)
        parts.append(w[ids.isin(stages).to_numpy()])
    return concat(parts)


def _value(m, acc: _Acc, walls: Sequence[pd.DataFrame]) -> float:
    """The metric from a selection's accumulated sums (``metric_kinds``' own formulas)."""
    if isinstance(m, PerRequest):
        parts = acc.values.get(m.source) or [np.zeros(0)]
        return m.of(np.concatenate(parts))
    w = _windows(walls, acc.stages)
    s = acc.sums
    if isinstance(m, Count):
        if isinstance(m, Goodput) and not acc.has_slo:
            return math.nan
        if not acc.sums.get("rows"):
            return math.nan if not m.per_second else _rate(0, w, m.window)
        if m.per_second:
            return _rate(s.get(f"{m.name}:flag", 0), w, m.window)
        if m.over is None:
            n = s.get("rows", 0)
            return s.get(f"{m.name}:flag", 0) / n if n else math.nan
        n = s.get(f"{m.name}:over", 0)
        return s.get(f"{m.name}:over_flag", 0) / n if n else math.nan
    if isinstance(m, TokenRate):
        return _rate(s.get(f"{m.name}:sum", 0.0), w, achieved_s)
    if isinstance(m, PrefixHitRatio):
        total = s.get(f"{m.name}:prompt", 0.0)
        return float(s.get(f"{m.name}:cached", 0.0) / total) if total > 0 else math.nan
    raise TypeError(f"no exact evaluation of {m!r}")


# --------------------------------------------------------------------------------------------
# ITL: two passes over the pooled gaps

def _bucket(v: np.ndarray) -> np.ndarray:
    """A bucket per float32 gap in [0, _BUCKETS), monotone (non-decreasing) in the value."""
    bits = v.view(np.int32).astype(np.int64)
    bits = np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # negatives below, by magnitude
    return (bits >> _SHIFT) + _BUCKETS // 2


def _itl_batches(run_dir: Path, offsets_ns, batch_rows: int):
    """(endpoint, request_class, GapStore) per batch: the frame's own ITL gaps."""
    cols = list(dict.fromkeys(["endpoint", "request_class", *D.inputs(["itl_gaps_ns"])]))
    for t in _batches(run_dir, cols, offsets_ns, batch_rows):
        yield (t.column("endpoint").to_numpy(zero_copy_only=False),
               t.column("request_class").to_numpy(zero_copy_only=False), GapStore.itl(t))


def _lerp(lo: np.ndarray, hi: np.ndarray, index: float) -> float:
    """numpy's 'linear' quantile between order statistics ``lo`` (at floor(index)) and
    ``hi`` (the next), as ``numpy.quantile(values, q)`` computes it for a Python float ``q``:
    the weight a Python float, so the arithmetic stays in the values' dtype."""
    gamma = float(index - math.floor(index))
    diff = hi - lo
    out = hi - diff * (1 - gamma) if gamma >= 0.5 else lo + diff * gamma
    return float(out[0])


def _all_itl(runs: Sequence[tuple], batch_rows: int):
    for run_dir, _, offsets_ns in runs:
        yield from _itl_batches(Path(run_dir), offsets_ns, min(batch_rows, ITL_BATCH_ROWS))


def _gap_mask(ep: np.ndarray, cls: np.ndarray, store: GapStore, sel: Selection) -> np.ndarray:
    rows = ep == sel[0]
    if sel[1] != "*":
        rows = rows & (cls == sel[1])
    return np.repeat(rows, np.diff(store.offsets))


def _itl(runs: Sequence[tuple], needs: Mapping[Selection, list],
         batch_rows: int) -> dict[tuple[Selection, str], float]:
    sels = [s for s, ms in needs.items() if any(isinstance(m, PooledGaps) for m in ms)]
    if not sels:
        return {}
    hist = {s: np.zeros(_BUCKETS, np.int64) for s in sels}
    total = {s: 0.0 for s in sels}
    for ep, cls, store in _all_itl(runs, batch_rows):
        if not len(store.flat):
            continue
        b = _bucket(store.flat)
        for s in sels:
            g = _gap_mask(ep, cls, store, s)
            hist[s] += np.bincount(b[g], minlength=_BUCKETS)
            total[s] += float(store.flat[g].sum(dtype=np.float64))
    wanted: dict[Selection, list] = {}
    keep = {}
    for s in sels:
        c = np.cumsum(hist[s])
        n = int(c[-1])
        picks = []
        for m in needs[s]:
            if isinstance(m, PooledGaps) and m.q is not None and n:
                index = (n - 1) * np.asarray([m.q], np.float64)
                k = min(int(np.floor(index[0])), n - 1)
                pair = []
                for kk in (k, min(k + 1, n - 1)):
                    i = int(np.searchsorted(c, kk, side="right"))
                    pair.append((i, kk - (int(c[i - 1]) if i else 0)))
                picks.append((m, index, pair))
        wanted[s] = (n, picks)
        keep[s] = np.zeros(_BUCKETS, bool)
        for _, _, pair in picks:
            for i, _ in pair:
                keep[s][i] = True
    # the gaps of each wanted (selection, bucket), float32 as the store holds them: 4 bytes a
    # kept gap (a bucket near a mode of the gaps may hold a few % of them)
    got: dict[tuple, list] = {}
    if any(keep[s].any() for s in sels):
        for ep, cls, store in _all_itl(runs, batch_rows):
            if not len(store.flat):
                continue
            b = _bucket(store.flat)
            for s in sels:
                g = _gap_mask(ep, cls, store, s) & keep[s][b]
                if not g.any():
                    continue
                bs, vs = b[g], store.flat[g]
                for bk in np.flatnonzero(keep[s]).tolist():
                    mine = vs[bs == bk]
                    if len(mine):
                        got.setdefault((s, bk), []).append(mine)
    out = {}
    for s in sels:
        n, picks = wanted[s]
        cells: dict[int, np.ndarray] = {}
        for m in needs[s]:
            if isinstance(m, PooledGaps) and m.q is None:
                out[(s, m.name)] = total[s] / n if n else math.nan
            elif isinstance(m, PooledGaps) and not n:
                out[(s, m.name)] = math.nan
        for m, index, ((b0, r0), (b1, r1)) in picks:
            for bk in (b0, b1):
                if bk not in cells:
                    parts = got.pop((s, bk), [])
                    cells[bk] = np.sort(np.concatenate(parts)) if parts else \
                        np.zeros(0, np.float32)
            lo, hi = cells[b0][r0:r0 + 1], cells[b1][r1:r1 + 1]
            out[(s, m.name)] = _lerp(lo, hi, float(index[0]))
    return out


def exact_figures(runs: Sequence[tuple], wants: Iterable[tuple[str, str, str]], *,
                  slo: Mapping | None = None,
                  batch_rows: int = BATCH_ROWS) -> dict[tuple[str, str, str], float]:
    """{(metric, endpoint, request_class): value} for each wanted triple (class ``*``: every
    class of the endpoint), over all the compacted records of ``runs`` pooled (each a
    (run_dir, stages, worker_clock_offsets_ns) as run.json gives them; several runs keep
    their stages apart, as ``frame.concat`` does), by the registry's own definitions (module
    docstring); ``slo`` as ``request_frame`` takes it."""
    needs: dict[Selection, list] = {}
    for metric, ep, cls in wants:
        m = M.METRIC_INFO[M.metric_name(metric)]
        ms = needs.setdefault((ep, cls), [])
        if m not in ms:
            ms.append(m)
    out: dict[tuple[str, str, str], float] = {}
    plain = {s: [m for m in ms if not isinstance(m, PooledGaps)] for s, ms in needs.items()}
    plain = {s: ms for s, ms in plain.items() if ms}
    if plain:
        accs = {s: _Acc() for s in plain}
        walls = [_scan(i, Path(d), stages, slo, offsets, plain, accs, batch_rows)
                 for i, (d, stages, offsets) in enumerate(runs)]
        for s, ms in plain.items():
            for m in ms:
                out[(m.name, *s)] = _value(m, accs[s], walls)
            accs[s].values.clear()  # this selection's per-request values, freed early
        del accs
    for (s, name), v in _itl(runs, needs, batch_rows).items():
        out[(name, *s)] = v
    return out
