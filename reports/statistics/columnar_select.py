"""The order-statistic machinery of ``columnar`` (issue 34): exact percentiles of values
streamed in batches, by a two-pass selection whose pass 1 counts values per (group, bucket)
and whose pass 2 keeps only the values of the buckets holding the wanted order statistics.

- ``_wants``/``_wanted``: from bucket counts, the (bucket, rank) of order statistics k and
  k+1 of each quantile (numpy's virtual index ``(n - 1) * q``); ``_pick`` and ``linear``: the
  quantile from the kept values, numpy's 'linear' arithmetic reproduced bit for bit.
- buckets monotone in the value: ``_gap_bucket`` (int64 ns gaps: float64 exponent and top
  mantissa bits), ``_value_bucket`` (float64 values, a narrow dense range), ``_bucket_floor``
  (a gap bucket's least uint32 ns).
- ``_Groups`` (stage-level groups numbered as met), ``_Hist`` (a dense (group, bucket) count
  matrix), ``_Spill`` (pass 1's ITL gaps on disk for pass 2).
"""

from __future__ import annotations

import math
import tempfile
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

STAGE_KEYS = ("endpoint", "workload", "request_class", "stage")


def _sum(frame: pd.DataFrame, keys: Sequence[str], cols: Sequence[str]) -> pd.DataFrame:
    return frame.groupby(list(keys), dropna=False, sort=True)[list(cols)].sum().reset_index()


def linear(lo: np.ndarray, hi: np.ndarray, index: np.ndarray) -> np.ndarray:
    """numpy's 'linear' quantile from order statistics ``floor(index)`` (``lo``) and the next
    (``hi``) at virtual index ``index``: numpy's own arithmetic, in its dtypes."""
    gamma = index - np.floor(index)
    diff = hi - lo
    out = lo + diff * gamma
    return np.where(gamma >= 0.5, hi - diff * (1 - gamma), out)


def _wants(hist: pd.DataFrame, keys: Sequence[str], qs: Sequence[float]) -> list[tuple]:
    """Per group of ``keys`` and metric: (group key, metric, n, [(bucket, rank) of order
    statistic k, of k+1] per quantile) from the bucket counts ``hist``."""
    out = []
    h = _sum(hist, [*keys, "m", "b"], ["n"])
    for key, g in h.groupby([*keys, "m"], dropna=False, sort=True):
        c = np.cumsum(g["n"].to_numpy(np.int64))
        b = g["b"].to_numpy()
        n = int(c[-1])
        picks = []
        for q in qs:
            index = (n - 1) * np.asarray([q], np.float64)
            k = min(int(np.floor(index[0])), n - 1)
            pair = []
            for kk in (k, min(k + 1, n - 1)):
                i = int(np.searchsorted(c, kk, side="right"))
                pair.append((int(b[i]), kk - (int(c[i - 1]) if i else 0)))
            picks.append((index, pair))
        out.append((key[:-1], key[-1], n, picks))
    return out


def _wanted(hist: pd.DataFrame, levels: Mapping[str, Sequence[str]],
            qs: Sequence[float]) -> tuple[dict, pd.DataFrame]:
    """The order statistics each level needs (``_wants``) and the (endpoint, m, b) buckets
    holding them (every level's keys start with the endpoint: a bucket of an endpoint is
    fetched for all its groups, which pass 2's per-group sort separates again)."""
    wants = {lvl: _wants(hist, keys, qs) for lvl, keys in levels.items()}
    w = pd.DataFrame([(key[0], m, bk) for ws in wants.values() for key, m, _, picks in ws
                      for _, pair in picks for bk, _ in pair],
                     columns=["endpoint", "m", "b"]).drop_duplicates()
    return wants, w.astype({"b": np.int64})


def _pick(vals: pd.DataFrame, wants: dict, levels: Mapping[str, Sequence[str]],
          convert) -> dict[str, dict]:
    """The quantiles from the values of the wanted buckets (``vals``: keys, m, b, v)."""
    out: dict[str, dict] = {lvl: {} for lvl in levels}
    for lvl, keys in levels.items():
        groups = vals.groupby([*keys, "m", "b"], dropna=False, sort=False).indices
        values = vals["v"].to_numpy()
        cache: dict = {}

        def bucket(key: tuple, m: str, bk: int):
            got = cache.get((key, m, bk))
            if got is None:
                idx = groups[(*key, m, bk)] if keys else groups[(m, bk)]
                got = cache[(key, m, bk)] = convert(np.sort(values[idx]))
            return got

        for key, m, n, picks in wants[lvl]:
            res = []
            for index, ((b0, r0), (b1, r1)) in picks:
                lo, hi = bucket(key, m, b0)[r0:r0 + 1], bucket(key, m, b1)[r1:r1 + 1]
                res.append(float(linear(lo, hi, index)[0]))
            out[lvl][(key, m)] = (n, res)
    return out


# float64 mantissa bits kept in an ITL bucket: 1024 buckets per octave (0.07% wide), so pass 2
# keeps few gaps; the histogram spans ~20 octaves of ns gaps: ~20k buckets per group
_MANTISSA_KEPT = 10
_CODE = 1 << 32  # (group, bucket) as one int64: group * _CODE + bucket (|bucket| < 2**31)


def _gap_bucket(v: np.ndarray) -> np.ndarray:
    """A bucket per int64 gap, monotone (non-decreasing) in the value: the float64's exponent
    and top mantissa bits (its bit pattern read as an integer is monotone in the value once a
    negative's magnitude bits are flipped; a negative gap sorts below every other)."""
    bits = v.astype(np.float64).view(np.int64)
    if len(v) and v.min() < 0:
        bits = bits ^ ((bits >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))
    bits >>= 52 - _MANTISSA_KEPT
    return bits


def _bucket_floor(buckets: np.ndarray) -> np.ndarray:
    """Per bucket, the least ns gap in [0, 2**32] whose ``_gap_bucket`` is at least it (by
    bisection: the bucket is monotone in the gap)."""
    lo = np.zeros(len(buckets), np.int64)
    hi = np.full(len(buckets), 1 << 32, np.int64)
    while (lo < hi).any():
        mid = (lo + hi) // 2
        up = _gap_bucket(mid) >= buckets
        hi, lo = np.where(up, mid, hi), np.where(up, lo, mid + 1)
    return lo


def _norm(v):
    """A key as the counts frame holds it (None for null)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


class _Groups:
    """Stage-level groups (``STAGE_KEYS``) numbered as they are met."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.keys: list[tuple] = []

    def of(self, batch) -> np.ndarray:
        """The group number of each row of ``batch``."""
        import pyarrow.compute as pc

        combo = np.zeros(batch.num_rows, np.int64)
        dicts = []
        for k in STAGE_KEYS:
            enc = pc.dictionary_encode(batch.column(k))
            values = enc.dictionary.to_pylist()
            codes = pc.fill_null(enc.indices, len(values)).to_numpy(zero_copy_only=False)
            combo = combo * (len(values) + 1) + codes
            dicts.append([*values, None])
        uniq, inv = np.unique(combo, return_inverse=True)
        lut = np.empty(len(uniq), np.int64)
        for i, c in enumerate(uniq.tolist()):
            key = []
            for d in reversed(dicts):
                c, r = divmod(c, len(d))
                key.append(_norm(d[r]))
            key = tuple(reversed(key))
            g = self.ids.get(key)
            if g is None:
                g = self.ids[key] = len(self.keys)
                self.keys.append(key)
            lut[i] = g
        return lut[inv.reshape(-1)]


class _Spill:
    """Pass 1's gaps, written as it meets them into an unlinked temporary file, so that
    pass 2 reads 4 bytes a gap back (from the page cache, mostly) instead of decoding every
    chunk list again: a gap as uint32 ns (4.29 s; one outside that range as the marker
    ``_FAR``, its value kept aside), its group from each row's group and gap count (held
    here: 8 bytes a request)."""

    _FAR = np.uint32(0xFFFFFFFF)

    def __init__(self, directory: str | None) -> None:
        self.file = tempfile.TemporaryFile(dir=directory, prefix="kvbench-itl-")
        self.parts: list[tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]] = []

    def write(self, rows: np.ndarray, per_row: np.ndarray, v: np.ndarray) -> None:
        far = np.flatnonzero((v < 0) | (v >= np.int64(self._FAR)))
        u = v.astype(np.uint32)
        if len(far):
            u[far] = self._FAR
        self.file.write(memoryview(u))
        self.parts.append((rows.astype(np.int32), per_row.astype(np.int32), len(v), far,
                           v[far]))

    GRAIN = 12  # a grain: 4096 consecutive ns values, those of a gap's ``u >> GRAIN``

    @classmethod
    def grains(cls, buckets: np.ndarray) -> np.ndarray:
        """A lookup over the grains of uint32 ns: True where a gap in one may fall into one
        of ``buckets`` (``_gap_bucket``'s), and for the grain of ``_FAR``."""
        buckets = np.unique(np.asarray(buckets, np.int64))
        lut = np.zeros(1 << (32 - cls.GRAIN), bool)
        lut[-1] = True
        if len(buckets):
            lo, hi = _bucket_floor(buckets), _bucket_floor(buckets + 1)
            for a, z in zip(lo.tolist(), hi.tolist()):
                if z > a:
                    lut[a >> cls.GRAIN:((z - 1) >> cls.GRAIN) + 1] = True
        return lut

    def read(self, grains: np.ndarray | None = None):
        """(group number, ns gap) per part written, in order: all of them, or (``grains``)
        those in a marked grain, with any others there may be."""
        self.file.seek(0)
        for rows, per_row, n, far, far_v in self.parts:
            u = np.empty(n, np.uint32)
            self.file.readinto(memoryview(u))
            if grains is None:
                v = u.astype(np.int64)
                v[far] = far_v
                yield np.repeat(rows.astype(np.int64), per_row), v
                continue
            at = np.flatnonzero(grains[u >> self.GRAIN])  # every far gap among them
            v = u[at].astype(np.int64)
            v[np.searchsorted(at, far)] = far_v
            row = np.searchsorted(np.cumsum(per_row), at, side="right")
            yield rows.astype(np.int64)[row], v

    def close(self) -> None:
        self.file.close()
        self.parts = []


class _Hist:
    """Counts per (group, bucket): a dense matrix over the buckets met so far."""

    def __init__(self) -> None:
        self.base, self.counts = 0, np.zeros((0, 0), np.int64)

    def add(self, g: np.ndarray, b: np.ndarray) -> None:
        lo, hi = int(b.min()), int(b.max())
        rows = max(int(g.max()) + 1, self.counts.shape[0])
        if self.counts.size == 0:
            self.base, self.counts = lo, np.zeros((rows, hi - lo + 1), np.int64)
        base = min(self.base, lo)
        width = max(self.base + self.counts.shape[1], hi + 1) - base
        if (rows, width) != self.counts.shape or base != self.base:
            grown = np.zeros((rows, width), np.int64)
            r, c = self.counts.shape
            grown[:r, self.base - base:self.base - base + c] = self.counts
            self.base, self.counts = base, grown
        width = hi - lo + 1
        n = np.bincount(g * width + (b - lo), minlength=rows * width).reshape(rows, width)
        self.counts[:, lo - self.base:lo - self.base + width] += n

    def frame(self, groups: _Groups, m: str = "itl") -> pd.DataFrame:
        gi, bi = np.nonzero(self.counts)
        keys = [groups.keys[i] for i in gi.tolist()]
        f = pd.DataFrame(keys, columns=list(STAGE_KEYS)) if keys else pd.DataFrame(
            columns=list(STAGE_KEYS))
        f["m"] = m
        f["b"] = (bi + self.base).astype(np.int64)
        f["n"] = self.counts[gi, bi]
        return f


# a per-request value's bucket: its float64 magnitude's exponent and top 8 mantissa bits,
# magnitudes below 2**-20 in one bucket, above 2**60 in one (a dense histogram stays narrow)
_VALUE_SHIFT = 52 - 8
_VALUE_FLOOR = int(np.float64(2.0 ** -20).view(np.int64)) >> _VALUE_SHIFT
_VALUE_CEIL = (int(np.float64(2.0 ** 60).view(np.int64)) >> _VALUE_SHIFT) - _VALUE_FLOOR


def _value_bucket(v: np.ndarray) -> np.ndarray:
    """A bucket per float64 value (no NaN), monotone (non-decreasing) in the value: every
    negative below every other, by magnitude."""
    mag = np.abs(v).view(np.int64) >> _VALUE_SHIFT
    mag = np.clip(mag - _VALUE_FLOOR, 0, _VALUE_CEIL)
    return np.where(v < 0, -mag - 1, mag)
