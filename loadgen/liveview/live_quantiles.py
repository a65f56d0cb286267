"""What the live view keeps of one endpoint x request class (``KeyStats``: a sliding window
and everything since the start), in exact quantile structures: numpy's linear quantiles of a
sorted array or of an unsorted one (partitioned at the ranks they need), every value since the
start kept sorted with new ones merged when a quantile is asked for, and exact counts of
integer microseconds (ITL: tens of thousands of gaps a second, too many to sort at every
refresh). Each is exact, not binned: ``tests/test_live.py`` holds them equal to
``numpy.quantile``; only past ``EXACT_MAX`` values of a metric (a soak's hours) are the
since-start ones folded into geometric bins, within 0.05%, so that memory stays flat (the
summary's ``quantiles_exact`` says which; ``tests/test_soak_bounded.py``)."""

from __future__ import annotations

import collections
import math

import numpy as np

QS = (0.5, 0.9, 0.99)


def quantiles(sorted_values: np.ndarray, qs=QS) -> list[float | None]:
    """numpy's 'linear' quantiles of an already sorted array (None when it is empty)."""
    n = len(sorted_values)
    if n == 0:
        return [None for _ in qs]
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        a, b = float(sorted_values[lo]), float(sorted_values[hi])
        out.append(a + (b - a) * (pos - lo))
    return out


def quantiles_of(values: np.ndarray, qs=QS) -> list[float | None]:
    """The same quantiles of an unsorted array, by partitioning at the ranks they need (O(n),
    no full sort)."""
    n = len(values)
    if n == 0:
        return [None for _ in qs]
    ranks = sorted({r for q in qs for r in (int(math.floor(q * (n - 1))),
                                            min(int(math.floor(q * (n - 1))) + 1, n - 1))})
    part = np.partition(values, ranks)
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = int(math.floor(pos))
        a, b = float(part[lo]), float(part[min(lo + 1, n - 1)])
        out.append(a + (b - a) * (pos - lo))
    return out


EXACT_MAX = 1 << 18  # values one SinceStart keeps exactly (2 MB); past it, LogBins (issue 34)


class LogBins:
    """Counts of values in geometric bins of ratio ``RATIO`` from ``LO`` to ``HI`` ms (35k
    bins, 280 kB): a bounded stand-in for every value of a metric once a soak has sent too
    many to keep. A value is read back as its bin's geometric middle, within ``REL_ERROR``
    of itself (values below ``LO``, zeros, read as 0; above ``HI`` as ``HI``)."""

    RATIO = 1.001
    REL_ERROR = math.sqrt(RATIO) - 1  # 0.05%
    LO, HI = 1e-6, 1e9  # ms: a nanosecond to eleven days
    _LOG = math.log(RATIO)
    N = int(math.ceil(math.log(HI / LO) / _LOG)) + 2  # bin 0: below LO; the last: HI and over

    def __init__(self) -> None:
        self.counts = np.zeros(self.N, np.int64)
        self.n = 0

    def add(self, values: np.ndarray) -> None:
        if not len(values):
            return
        v = np.asarray(values, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.floor(np.log(np.maximum(v, self.LO * 0.5) / self.LO) / self._LOG) + 1
        k = np.clip(np.nan_to_num(k, nan=0.0), 0, self.N - 1).astype(np.int64)
        self.counts += np.bincount(k, minlength=self.N)
        self.n += len(v)

    def value(self, k: int) -> float:
        if k <= 0:
            return 0.0
        if k >= self.N - 1:
            return self.HI
        return self.LO * math.exp((k - 1 + 0.5) * self._LOG)

    def at(self, ranks: list[int], cum: np.ndarray | None = None) -> list[float]:
        """The values of these ranks (0-based, in sorted order)."""
        cum = np.cumsum(self.counts) if cum is None else cum
        return [self.value(int(np.searchsorted(cum, r, side="right"))) for r in ranks]


class SinceStart:
    """Every value of one metric since the start, kept sorted: new values wait in ``pending``
    and are merged (``np.insert`` at their sorted places: one copy of the array) when a
    quantile is asked for, so an unwatched run pays only the appends. Past ``EXACT_MAX``
    values (a soak: hours of requests) they are folded into ``LogBins`` and the quantiles are
    within ``LogBins.REL_ERROR`` (``exact`` is False): memory and the cost of a quantile stay
    flat however long the run goes (every value kept grew 8 bytes a request, and each merge
    copied them all; issue 34)."""

    def __init__(self, exact_max: int = EXACT_MAX) -> None:
        self.sorted = np.empty(0)
        self.pending: list[np.ndarray] = []
        self.n_pending = 0
        self.exact_max = exact_max
        self.bins: LogBins | None = None  # set once past exact_max: no value kept since

    @property
    def exact(self) -> bool:
        return self.bins is None

    def __len__(self) -> int:
        return len(self.sorted) + self.n_pending + (self.bins.n if self.bins else 0)

    def add(self, values: np.ndarray) -> None:
        if not len(values):
            return
        if self.bins is not None:
            self.bins.add(values)
            return
        self.pending.append(values)
        self.n_pending += len(values)
        if len(self.sorted) + self.n_pending > self.exact_max:
            self.bins = LogBins()
            self.bins.add(self.sorted)
            for p in self.pending:
                self.bins.add(p)
            self.sorted, self.pending, self.n_pending = np.empty(0), [], 0
        elif len(self.pending) > 64:  # keep the list short; still unsorted
            self.pending = [np.concatenate(self.pending)]

    def quantiles(self, qs=QS) -> list[float | None]:
        if self.bins is not None:
            return _binned_quantiles(self.bins, qs)
        if self.pending:
            new = np.sort(np.concatenate(self.pending))
            self.sorted = np.insert(self.sorted, np.searchsorted(self.sorted, new), new)
            self.pending, self.n_pending = [], 0
        return quantiles(self.sorted, qs)


def _binned_quantiles(bins: LogBins, qs=QS) -> list[float | None]:
    """numpy's linear quantiles over the binned values."""
    n = bins.n
    if n == 0:
        return [None for _ in qs]
    cum = np.cumsum(bins.counts)
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = int(math.floor(pos))
        a, b = bins.at([lo, min(lo + 1, n - 1)], cum)
        out.append(a + (b - a) * (pos - lo))
    return out


class MicroHist:
    """Exact counts of integer-microsecond values (ITL: tens of thousands of gaps a second,
    too many to sort at every refresh): one bin per microsecond below ``BINS`` us, with
    per-block sums to find a rank without a pass over every bin; the rare larger values are
    kept exactly apart. Quantiles (``micro_quantiles``) are numpy's linear ones over the
    values in microseconds."""

    BINS = 1 << 19  # 0.52 s of 1-us bins (4 MB)
    SHIFT = 9  # blocks of 512 us

    def __init__(self) -> None:
        self.counts = np.zeros(self.BINS, np.int64)
        self.blocks = np.zeros(self.BINS >> self.SHIFT, np.int64)
        self.n = 0
        self.big = SinceStart()

    @classmethod
    def split(cls, us: np.ndarray) -> tuple:
        """Integer us values -> (the small ones, the large ones as float)."""
        small = us < cls.BINS
        return us[small], us[~small].astype(np.float64)

    def add(self, part: tuple, sign: int = 1, into: "MicroHist | None" = None) -> None:
        """Add (sign 1) or take away (-1) a batch's values; ``into``: add what is taken away
        to that histogram (the window's expired values go to the archive)."""
        small, big = part
        if len(small):
            lo = int(small.min())  # only the occupied range of bins is touched
            fine = np.bincount(small - lo)
            clo = lo >> self.SHIFT
            coarse = np.bincount((small >> self.SHIFT) - clo)
            f, c = slice(lo, lo + len(fine)), slice(clo, clo + len(coarse))
            for h, sg in ((self, sign), (into, 1)):
                if h is None:
                    continue
                if sg > 0:
                    h.counts[f] += fine
                    h.blocks[c] += coarse
                else:
                    h.counts[f] -= fine
                    h.blocks[c] -= coarse
                h.n += sg * len(small)
        if len(big):
            if sign > 0:
                self.big.add(big)
            if into is not None:
                into.big.add(big)

    def __len__(self) -> int:
        return self.n + len(self.big)


def micro_quantiles(hists: list, qs=QS) -> list[float | None]:
    """Quantiles (ms) of the values of several histograms together."""
    n = sum(h.n for h in hists)
    bigs = []
    for h in hists:
        h.big.quantiles((0.0,))  # merges what waits
        bigs.append(h.big.sorted)
    binned = None  # a soak's many large values: binned (within LogBins.REL_ERROR)
    if any(h.big.bins is not None for h in hists):
        binned = LogBins()
        for h in hists:
            if h.big.bins is not None:
                binned.counts += h.big.bins.counts
                binned.n += h.big.bins.n
            else:
                binned.add(h.big.sorted)
        big_cum = np.cumsum(binned.counts)
    big = bigs[0] if len(bigs) == 1 else (
        np.sort(np.concatenate(bigs)) if any(len(b) for b in bigs) else np.empty(0))
    total = n + (binned.n if binned is not None else len(big))
    if total == 0:
        return [None for _ in qs]
    cum_blocks = np.cumsum(sum(h.blocks for h in hists))
    width = 1 << MicroHist.SHIFT

    def at(rank: int) -> float:
        if rank >= n:
            if binned is not None:
                return binned.at([rank - n], big_cum)[0]
            return float(big[rank - n])
        k = int(np.searchsorted(cum_blocks, rank, side="right"))
        before = int(cum_blocks[k - 1]) if k else 0
        block = np.cumsum(sum(h.counts[k * width:(k + 1) * width] for h in hists))
        return float(k * width + np.searchsorted(block, rank - before, side="right"))

    out = []
    for q in qs:
        pos = q * (total - 1)
        lo = int(math.floor(pos))
        a = at(lo)
        b = at(min(lo + 1, total - 1))
        out.append((a + (b - a) * (pos - lo)) / 1e3)  # us -> ms
    return out


def _zeros() -> dict:
    return {"done": 0, "ok": 0, "errors": 0, "cancelled": 0, "slo_judged": 0, "slo_met": 0,
            "prompt_tokens": 0, "cached_tokens": 0}


PER_REQUEST = ("ttft", "tpot", "lateness")
SINCE_EVERY_S = 10.0  # since-start quantiles of a long run: recomputed this often (they move
SINCE_CHEAP = 100_000  # slowly); below this many requests, at every summary (a cheap merge)


class KeyStats:
    """One endpoint x request class: window chunks and since-start values and counts. The
    per-request metrics are kept as exact float ms; ITL as exact microsecond counts."""

    def __init__(self) -> None:
        self.window: collections.deque = collections.deque()  # (t_ns, arrays, counts)
        self.since = {m: SinceStart() for m in PER_REQUEST}
        self.itl_window = MicroHist()
        self.itl_archive = MicroHist()  # what left the window: since start = both
        self.counts = _zeros()
        self._since_q: tuple[float, dict] | None = None

    def add(self, t_ns: int, arrays: dict, counts: dict) -> None:
        part = MicroHist.split(arrays["itl_us"])
        self.window.append((t_ns, arrays, counts, part))
        for m in PER_REQUEST:
            self.since[m].add(arrays[m])
        self.itl_window.add(part)
        for k, v in counts.items():
            self.counts[k] += v

    def trim(self, now_ns: int, window_s: float) -> None:
        edge = now_ns - int(window_s * 1e9)
        while self.window and self.window[0][0] < edge:
            part = self.window.popleft()[3]
            self.itl_window.add(part, -1, into=self.itl_archive)
            if len(part[1]):  # the rare ITL above BINS us: rebuilt from the window
                self.itl_window.big = SinceStart()
                for *_, p in self.window:
                    self.itl_window.big.add(p[1])

    def summary(self, window_s: float, now_ns: int, since_s: float) -> dict:
        self.trim(now_ns, window_s)
        win = _zeros()
        vals = {m: [] for m in PER_REQUEST}
        for _, arrays, counts, _us in self.window:
            for k, v in counts.items():
                win[k] += v
            for m in PER_REQUEST:
                vals[m].append(arrays[m])
        span_s = min(window_s, since_s) if since_s > 0 else window_s
        out = {"window": _figures(win, span_s), "since": _figures(self.counts, since_s)}
        for m in PER_REQUEST:
            w = np.concatenate(vals[m]) if vals[m] else np.empty(0)
            out["window"][m] = quantiles_of(w)
        out["window"]["itl"] = micro_quantiles([self.itl_window])
        mono = now_ns / 1e9
        small = len(self.since["ttft"]) < SINCE_CHEAP
        if small or self._since_q is None or mono - self._since_q[0] >= SINCE_EVERY_S:
            q = {m: self.since[m].quantiles() for m in PER_REQUEST}
            q["itl"] = micro_quantiles([self.itl_window, self.itl_archive])
            self._since_q = (mono, q)
        out["since"].update(self._since_q[1], quantiles_age_s=mono - self._since_q[0],
                            quantiles_exact=all(self.since[m].exact for m in PER_REQUEST)
                            and self.itl_archive.big.exact and self.itl_window.big.exact)
        return out


def _figures(c: dict, span_s: float) -> dict:
    """The figures of counts over ``span_s``: as the report's metrics define them (throughput
    counts requests that finished, goodput those within SLO), over the live view's own time
    (the window, or since the start), not a stage's achieved interval."""
    judged = c["slo_judged"]
    return {**c,
            "slo_attainment": c["slo_met"] / judged if judged else None,
            "goodput_rps": c["slo_met"] / span_s if judged and span_s > 0 else None,
            "throughput_rps": (c["done"] - c["cancelled"]) / span_s if span_s > 0 else None,
            "hit_ratio": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else None}
