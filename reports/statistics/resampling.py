"""The bootstrap engine: seeded replicates of statistics, apart from what the metrics mean.

Every path yields (estimate, replicates); an interval is the replicates' percentiles. Exact
order-statistic draws for quantiles, vectorised index draws for means and ratios (m-out-of-n
above ``MAX_ROWS``), binomial draws for counts, Poisson count noise for rates whose number of
arrivals is itself random, a cluster bootstrap for values correlated within a cluster (the ITL
gaps of one request), and a paired bootstrap for two runs that replayed the same requests.
Which strategy a metric uses is the metric's own business (``reports.metrics``), as scipy keeps
``_resampling.py`` apart from its distributions.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, NamedTuple

import numpy as np

MAX_ROWS = 20_000  # mean and ratio: m-out-of-n above this many rows

class CI(NamedTuple):
    estimate: float
    low: float
    high: float


def interval(estimate: float, replicates: np.ndarray, confidence: float = 0.95) -> CI:
    """Percentile interval of bootstrap replicates (NaN replicates dropped)."""
    reps = np.asarray(replicates, np.float64)
    reps = reps[~np.isnan(reps)]
    if len(reps) == 0:
        return CI(estimate, math.nan, math.nan)
    a = (1 - confidence) / 2
    lo, hi = np.quantile(reps, [a, 1 - a])
    return CI(estimate, float(lo), float(hi))



def drop_nan(values) -> np.ndarray:
    """Floats without NaN; float32 stays float32 (ITL gaps), and a clean array is not copied."""
    v = np.asarray(values)
    if v.dtype not in (np.float32, np.float64):
        v = v.astype(np.float64)
    nan = np.isnan(v)
    return v[~nan] if nan.any() else v


def quantile_replicates(values: np.ndarray, q: float, resamples: int,
                        rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """Bootstrap replicates of the q-quantile, drawn exactly in O(n + resamples).

    The k-th order statistic of n draws with replacement from the sorted sample is
    sorted[floor(n * U_(k))] with U_(k) ~ Beta(k, n - k + 1); U_(k+1) is U_(k) plus the minimum
    of n - k uniforms on the rest, so both neighbours of the interpolated quantile are drawn
    jointly. Same distribution as resampling indices, without materialising n x B indices."""
    v = drop_nan(values)
    n = len(v)
    if n == 0:
        return math.nan, np.full(resamples, np.nan)
    if n == 1:
        return float(v[0]), np.full(resamples, float(v[0]))
    h = (n - 1) * q  # numpy 'linear': between order statistics floor(h) and floor(h)+1 (0-based)
    lo_i = int(math.floor(h))
    frac = h - lo_i
    k = lo_i + 1  # 1-based rank
    u_k = rng.beta(k, n - k + 1, size=resamples)
    idx_k = np.minimum((u_k * n).astype(np.int64), n - 1)
    use_next = frac > 0 and k < n
    if use_next:
        u_next = u_k + (1.0 - u_k) * rng.beta(1, n - k, size=resamples)
        idx_next = np.minimum((u_next * n).astype(np.int64), n - 1)
    # Only the order statistics the draws touch are needed: partition around that slab and
    # sort it (O(n) instead of a full sort).
    need_lo = min(int(idx_k.min()), lo_i)
    need_hi = max(int(idx_next.max()) if use_next else int(idx_k.max()), min(lo_i + 1, n - 1))
    part = np.partition(v, [need_lo, need_hi]) if need_hi > need_lo else np.partition(
        v, need_lo)
    part[need_lo:need_hi + 1].sort()
    est = float(part[lo_i] + frac * (part[min(lo_i + 1, n - 1)] - part[lo_i]))
    reps = part[idx_k]
    if use_next:
        reps = reps + frac * (part[idx_next] - part[idx_k])
    return est, reps


def mean_replicates(values: np.ndarray, resamples: int, rng: np.random.Generator,
                    max_rows: int = MAX_ROWS) -> tuple[float, np.ndarray]:
    """Vectorised bootstrap replicates of the mean (blocks of resamples as one index matrix).

    Above ``max_rows`` it bootstraps a seeded subsample of ``max_rows`` and rescales the spread
    by sqrt(m / n) (m-out-of-n bootstrap; valid for the mean, which is root-n consistent)."""
    v = drop_nan(values)
    n = len(v)
    if n == 0:
        return math.nan, np.full(resamples, np.nan)
    est = float(v.mean(dtype=np.float64))
    m = min(n, max_rows)
    sample = v if m == n else v[rng.choice(n, m, replace=False)]
    reps = np.empty(resamples)
    block = max(1, 4_000_000 // m)
    for s in range(0, resamples, block):
        e = min(s + block, resamples)
        reps[s:e] = sample[rng.integers(0, m, (e - s, m))].mean(axis=1)
    return est, est + (reps - sample.mean()) * math.sqrt(m / n)


def ratio_replicates(num: np.ndarray, den: np.ndarray, resamples: int,
                     rng: np.random.Generator, max_rows: int = MAX_ROWS
                     ) -> tuple[float, np.ndarray]:
    """Replicates of sum(num) / sum(den) over resampled rows (m-out-of-n above ``max_rows``)."""
    n = len(num)
    if n == 0 or den.sum() <= 0:
        return math.nan, np.full(resamples, np.nan)
    est = float(num.sum() / den.sum())
    m = min(n, max_rows)
    if m < n:
        pick = rng.choice(n, m, replace=False)
        num, den = num[pick], den[pick]
    centre = num.sum() / den.sum() if den.sum() > 0 else est
    reps = np.empty(resamples)
    block = max(1, 4_000_000 // m)
    for s in range(0, resamples, block):
        e = min(s + block, resamples)
        idx = rng.integers(0, m, (e - s, m))
        with np.errstate(invalid="ignore", divide="ignore"):
            reps[s:e] = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    return est, est + (reps - centre) * math.sqrt(m / n)


def count_replicates(flags: np.ndarray, resamples: int,
                     rng: np.random.Generator) -> np.ndarray:
    """Replicates of how many rows are flagged: resampling n rows with replacement draws the
    count exactly as Binomial(n, k/n), in O(resamples)."""
    n = len(flags)
    return rng.binomial(n, int(flags.sum()) / n, size=resamples).astype(np.float64)


def proportion_replicates(met: int, n: int, resamples: int,
                          rng: np.random.Generator) -> np.ndarray:
    """Replicates of a proportion ``met / n`` drawn from its Jeffreys posterior
    Beta(met + 1/2, n - met + 1/2): the smoothed (Bayesian) bootstrap of a binary outcome. The
    plain bootstrap of an all-success sample is the point 1.0 whatever n is (5/5 would "show"
    100%); this one widens as n shrinks (5/5: about [0.6, 1.0] at 95%)."""
    return rng.beta(met + 0.5, n - met + 0.5, size=resamples)


def proportion_interval(met: int, n: int, resamples: int, rng: np.random.Generator,
                        confidence: float = 0.95) -> CI:
    """Interval of ``met / n`` from ``proportion_replicates``, with the Jeffreys interval's
    usual edges: it reaches 0 when nothing met, 1 when everything did."""
    ci = interval(met / n, proportion_replicates(met, n, resamples, rng), confidence)
    return CI(ci.estimate, 0.0 if met == 0 else ci.low, 1.0 if met == n else ci.high)


def poisson_count_noise(reps: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Replicates of a rate over a fixed window with its number of arrivals redrawn as
    Poisson(n): the count of a Poisson process in a fixed window is itself random."""
    if n <= 0:
        return reps
    return reps * (rng.poisson(n, size=len(reps)) / n)


def quantile_bootstrap(values: np.ndarray, q: float, resamples: int = 1000,
                       confidence: float = 0.95, seed: int = 0) -> CI:
    """Seeded percentile interval of the q-quantile of independent values."""
    return interval(*quantile_replicates(values, q, resamples, np.random.default_rng(seed)),
                    confidence)


# --------------------------------------------------------------------------------------------
# paired: two runs that sent the same requests


PAIRED_MAX = 50_000  # a seeded subsample of pairs above this (wider, never narrower)
_PAIRED_BLOCK_ELEMENTS = 4_000_000


def paired_ratio_replicates(base: np.ndarray, cur: np.ndarray,
                            stat: Callable[[np.ndarray], np.ndarray], resamples: int,
                            rng: np.random.Generator,
                            max_pairs: int = PAIRED_MAX) -> tuple[np.ndarray, int]:
    """(replicates of stat(cur) / stat(base), pairs used), resampling pair indices: the same
    draw in both runs, so what the pairs share cancels out of the ratio's noise.

    ``stat`` maps a (replicates x pairs) matrix to one value per row, ignoring NaN (failed
    requests)."""
    n = len(base)
    if n > max_pairs:
        keep = rng.choice(n, max_pairs, replace=False)
        base, cur, n = base[keep], cur[keep], max_pairs
    reps = np.empty(resamples)
    block = max(1, _PAIRED_BLOCK_ELEMENTS // n)
    for s in range(0, resamples, block):
        e = min(s + block, resamples)
        idx = rng.integers(0, n, (e - s, n))
        with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows (failed requests)
            reps[s:e] = stat(cur[idx]) / stat(base[idx])
    return reps, n


# --------------------------------------------------------------------------------------------
# cluster bootstrap

# ITL: a cluster bootstrap over requests. Gaps of one request share its load, batch and
# output length, so they are correlated; resampling gaps as if independent would give an
# interval several times too narrow. A replicate draws requests with replacement and pools
# the gaps of the drawn requests with multiplicity: per replicate a vector of request counts
# (multinomial weights), and the quantile of the weighted pooled gaps is found in one global
# sort plus a cumulative weight over a slab of the sorted gaps around the quantile.

CLUSTER_MAX = 20_000  # m-out-of-n above this many clusters (requests with gaps)
_SLAB_SDS = 6.0  # initial slab: the quantile's position +- this many bootstrap sds
_BLOCK_ELEMENTS = 1_000_000  # per temporary in the ITL bootstrap (8 MB of float64)


def _count_blocks(m: int, resamples: int, rng: np.random.Generator):
    """Yield (start, end, W): W[b, r] = how often replicate b drew request r (float64)."""
    block = max(1, _BLOCK_ELEMENTS // m)
    for s in range(0, resamples, block):
        e = min(s + block, resamples)
        idx = rng.integers(0, m, (e - s, m))
        idx += (np.arange(e - s, dtype=np.int64) * m)[:, None]
        w = np.bincount(idx.ravel(), minlength=(e - s) * m).reshape(e - s, m)
        yield s, e, w.astype(np.float64)


class _SortedGaps:
    """Gaps of m requests sorted once: values, the request of each, and slab caches."""

    def __init__(self, vals: np.ndarray, req: np.ndarray, m: int):
        order = np.argsort(vals, kind="stable")
        self.v = vals[order]
        self.r = req[order]
        self.m = m
        self._below: dict[int, np.ndarray] = {}

    def below(self, a: int) -> np.ndarray:
        """Per request, how many of its gaps sort before position ``a``."""
        if a not in self._below:
            self._below[a] = np.bincount(self.r[:a], minlength=self.m).astype(np.float64)
        return self._below[a]

    def locate(self, w: np.ndarray, ranks: np.ndarray, centre: int, half: int) -> np.ndarray:
        """Sorted positions of the 0-based ``ranks`` (rows x k) in each row's weighted pool.

        Position j holds rank k when cum(j - 1) <= k < cum(j), cum being the running sum of
        the weights of the sorted gaps. Only a slab [centre - half, centre + half] is
        scanned; rows whose ranks fall outside retry with a slab four times as wide."""
        g = len(self.v)
        out = np.full(ranks.shape, -1, np.int64)
        todo = np.arange(len(w))
        while len(todo):
            a, z = max(centre - half, 0), min(centre + half + 1, g)
            below, rs = self.below(a), self.r[a:z]
            span = z - a
            step = max(1, _BLOCK_ELEMENTS // max(span, 1))
            for s in range(0, len(todo), step):
                rows = todo[s:s + step]
                wr = w[rows]
                base = wr @ below
                cum = np.cumsum(wr[:, rs], axis=1)
                cum += base[:, None]
                for j in range(ranks.shape[1]):
                    k = ranks[rows, j]
                    cnt = (cum <= k[:, None]).sum(axis=1)
                    found = (base <= k) & (cnt < span)
                    out[rows[found], j] = a + cnt[found]
            todo = todo[(out[todo] < 0).any(axis=1)]
            if a == 0 and z == g:  # the whole pool: every rank < N is found
                break
            half *= 4
        return out


def weighted_pool_quantiles(sg: "_SortedGaps", lens: np.ndarray, w: np.ndarray, q: float,
                            half: int | None = None) -> np.ndarray:
    """numpy-'linear' q-quantile of each row's pool (request r's gaps taken w[b, r] times).

    ``half``: initial slab half-width in sorted positions (default from ``_slab_half``)."""
    g = len(sg.v)
    n_b = w @ lens
    h = (n_b - 1) * q
    k = np.floor(h)
    frac = h - k
    ranks = np.stack([k, np.minimum(k + 1, n_b - 1)], axis=1)
    empty = n_b <= 0
    ranks[empty] = 0
    centre = int(round((g - 1) * q))
    if half is None:
        half = _slab_half(sg, lens, q)
    pos = sg.locate(w, ranks, centre, max(int(half), 1))
    lo, hi = sg.v[pos[:, 0]].astype(np.float64), sg.v[pos[:, 1]].astype(np.float64)
    out = lo + frac * (hi - lo)
    out[empty] = np.nan
    return out


def _slab_half(sg: "_SortedGaps", lens: np.ndarray, q: float) -> int:
    """Half-width (positions) covering the replicate quantiles with high probability.

    Delta method: at the pooled quantile t, the replicate's fraction of gaps <= t is
    sum w c / sum w len with c[r] = request r's gaps <= t; its sd is
    sqrt(sum (c - q len)^2) / sum len. Misses only cost a wider retry."""
    g = len(sg.v)
    t = sg.v[int(round((g - 1) * q))]
    c = np.bincount(sg.r[:np.searchsorted(sg.v, t, side="right")], minlength=sg.m)
    sd = math.sqrt(float(((c - q * lens) ** 2).sum())) / g
    return int(_SLAB_SDS * sd * g) + 16



def cluster_replicates(values_of: Callable[[np.ndarray], np.ndarray], lens: np.ndarray,
                       q: float | None, resamples: int, rng: np.random.Generator,
                       max_clusters: int = CLUSTER_MAX,
                       pooled: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """(estimate, cluster-bootstrap replicates) of the q-quantile (mean if q None) of values
    pooled over clusters.

    ``lens[i]``: cluster i's number of values; ``values_of(ids)``: the pooled values of the
    clusters ``ids`` (sorted), in that order. Clusters with values are resampled with
    replacement and each replicate pools the values of the drawn clusters; above
    ``max_clusters`` a seeded subsample of m clusters is bootstrapped and the spread rescaled
    by sqrt(m / n) (m-out-of-n, as ``mean_replicates``), which assumes the quantile is root-n
    smooth. ``pooled``: every cluster's values, if already gathered (only for the estimate)."""
    ids = np.flatnonzero(lens > 0)
    lens = lens[ids]
    v = drop_nan(values_of(ids) if pooled is None else pooled)
    if len(v) == 0:
        return math.nan, np.full(resamples, np.nan)
    est = float(np.quantile(v, q)) if q is not None else float(v.mean(dtype=np.float64))
    n = len(ids)
    m = min(n, max(int(max_clusters), 1))
    if m < n:
        pick = np.sort(rng.choice(n, m, replace=False))
        ids, lens = ids[pick], lens[pick]
    vals = values_of(ids)
    req = np.repeat(np.arange(m, dtype=np.int64), lens)
    bad = np.isnan(vals)
    if bad.any():
        vals, req = vals[~bad], req[~bad]
        lens = np.bincount(req, minlength=m)
    lens = lens.astype(np.float64)
    reps = np.empty(resamples)
    if q is None:
        sums = np.bincount(req, weights=vals, minlength=m)
        centre = sums.sum() / lens.sum()
        for s, e, w in _count_blocks(m, resamples, rng):
            with np.errstate(invalid="ignore", divide="ignore"):
                reps[s:e] = (w @ sums) / (w @ lens)
    else:
        sg = _SortedGaps(vals, req, m)
        h = (len(sg.v) - 1) * q
        i = int(math.floor(h))
        centre = float(sg.v[i]) + (h - i) * (float(sg.v[min(i + 1, len(sg.v) - 1)])
                                             - float(sg.v[i]))
        half = _slab_half(sg, lens, q)
        for s, e, w in _count_blocks(m, resamples, rng):
            reps[s:e] = weighted_pool_quantiles(sg, lens, w, q, half)
    if m < n:
        return est, est + (reps - centre) * math.sqrt(m / n)
    return est, reps
