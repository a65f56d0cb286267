"""The live summary of a run, for watching it while it runs: exact TTFT / TPOT / ITL / lateness
percentiles per endpoint and class over a sliding window and since start, SLO attainment,
goodput, hit ratio, requests in flight and dropped, and what the collectors of ``kvbench run``
write beside the records (engine KV usage, queue, prefix hits; GPU SM and HBM by role).

Nothing here runs per request: the record sink hands each batch it wrote (about twice a second,
its column lists by name) to ``LiveStats.tap``, which only queues it; a greenlet turns the
queued batches into numpy arrays every ``TICK_S``. No pyarrow in a load process (issue 13): it
is imported only to read the collectors' Arrow shards, when a view of them is asked for. Percentiles are numpy's linear ones over the records' own values
(as the reports take them), never Locust's rounded histogram: TTFT, TPOT and lateness as exact
floats, ITL (tens of thousands of gaps a second) as exact counts per microsecond.
A worker sends what it derived to the master (``kvbench_live`` messages), so the master's
summary is exact over every worker's requests. ``bench/live_cost.py`` measures the cost.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Mapping

import numpy as np

from kvbench.runs.progress import live_path

WINDOW_S = 30.0  # the sliding window of the "now" figures (by completion time)
TICK_S = 0.5  # how often queued batches are derived (a worker sends them to the master)
PROGRESS_TICKS = 2  # the progress file is rewritten every this many ticks (a second)
QS = (0.5, 0.9, 0.99)
LIVE_MSG = "kvbench_live"  # worker -> master: derived arrays of a tick
LIVE_STATE_MSG = "kvbench_live_state"  # worker -> master: in flight / dropped / stage now
LIVE_WANTED_MSG = "kvbench_live_wanted"  # master with a web UI -> workers: send your values
RECENT_TTFT = 1000  # TTFT values a progress file carries (kvbench run's p50 over processes)


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


class SinceStart:
    """Every value of one metric since the start, kept sorted: new values wait in ``pending``
    and are merged (``np.insert`` at their sorted places: one copy of the array) when a
    quantile is asked for, so an unwatched run pays only the appends."""

    def __init__(self) -> None:
        self.sorted = np.empty(0)
        self.pending: list[np.ndarray] = []
        self.n_pending = 0

    def __len__(self) -> int:
        return len(self.sorted) + self.n_pending

    def add(self, values: np.ndarray) -> None:
        if not len(values):
            return
        self.pending.append(values)
        self.n_pending += len(values)
        if len(self.pending) > 64:  # keep the list short; still unsorted
            self.pending = [np.concatenate(self.pending)]

    def quantiles(self, qs=QS) -> list[float | None]:
        if self.pending:
            new = np.sort(np.concatenate(self.pending))
            self.sorted = np.insert(self.sorted, np.searchsorted(self.sorted, new), new)
            self.pending, self.n_pending = [], 0
        return quantiles(self.sorted, qs)


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
    big = bigs[0] if len(bigs) == 1 else (
        np.sort(np.concatenate(bigs)) if any(len(b) for b in bigs) else np.empty(0))
    total = n + len(big)
    if total == 0:
        return [None for _ in qs]
    cum_blocks = np.cumsum(sum(h.blocks for h in hists))
    width = 1 << MicroHist.SHIFT

    def at(rank: int) -> float:
        if rank >= n:
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
        out["since"].update(self._since_q[1], quantiles_age_s=mono - self._since_q[0])
        return out


def _figures(c: dict, span_s: float) -> dict:
    judged = c["slo_judged"]
    return {**c,
            "slo_attainment": c["slo_met"] / judged if judged else None,
            "goodput_rps": c["slo_met"] / span_s if judged and span_s > 0 else None,
            "throughput_rps": c["ok"] / span_s if span_s > 0 else None,
            "hit_ratio": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else None}


def _np(col: list, fill: float = np.nan) -> np.ndarray:
    """A numeric column (a list, None for a missing value) as float64, None as ``fill``."""
    a = np.array(col, dtype=np.float64)  # None -> nan
    if not np.isnan(fill):
        a[np.isnan(a)] = fill
    return a


def _columns(batch) -> Mapping[str, list]:
    """A batch as the sink hands it over ({column: list}); an Arrow batch or table (tests,
    benches) through its ``to_pydict``, so pyarrow is never imported here."""
    return batch.to_pydict() if hasattr(batch, "to_pydict") else batch


def derive(batch, slo: dict) -> dict:
    """A REQUESTS batch ({column: list of values}) -> {(endpoint, class): (arrays, counts)};
    vectorised (no per-row Python but the list conversions and the per-class split).
    Definitions as in DESIGN.md: TPOT over requests with more than one token, ITL = gaps
    between consecutive chunks of successful requests, errors are misses, cancelled requests
    (a stop cut them) are neither."""
    batch = _columns(batch)
    status = np.array(batch["status"], dtype=object)
    if len(status) == 0:
        return {}
    ok = status == "ok"
    cancelled = status == "cancelled"
    ttft = _np(batch["ttft_ns"]) / 1e6
    e2e = _np(batch["e2e_ns"]) / 1e6
    n_tok = _np(batch["completion_tokens"], 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_tok > 1, (e2e - ttft) / (n_tok - 1), np.nan)
    # epoch ns exceed a float's exact range: subtract as integers first
    late = _np([s - c if s is not None and c is not None else None
                for s, c in zip(batch["t_sent"], batch["t_scheduled"])]) / 1e6
    prompt = _np(batch["prompt_tokens"])
    cached = _np(batch["cached_tokens"])
    both = ~np.isnan(prompt) & ~np.isnan(cached)
    # ITL: the flat offsets' diffs, minus those that cross into the next request
    offs = batch["chunk_offsets_ns"]
    lens = np.fromiter((len(x) if x else 0 for x in offs), np.int64, len(offs))
    flat = np.fromiter(itertools.chain.from_iterable(x for x in offs if x), np.int64,
                       int(lens.sum()))
    row_of = np.repeat(np.arange(len(lens)), lens)
    gap_row = row_of[1:]
    gap_ok = gap_row == row_of[:-1]
    # to the nearest microsecond, in integers (ns offsets are exact there)
    gaps = (np.diff(flat) + 500) // 1000 if len(flat) > 1 else np.empty(0, np.int64)
    ok_gap = gap_ok & ok[gap_row] if len(gaps) else np.empty(0, bool)
    groups = list(_groups(batch["endpoint"], batch["request_class"]))
    out = {}
    for key, rows in groups:
        r_ok = rows & ok
        met = r_ok.copy()
        limits = slo.get(key[1]) or {}
        judged = any(limits.get(k) is not None for k in ("ttft_ms", "tpot_ms", "e2e_ms"))
        for name, v in (("ttft_ms", ttft), ("tpot_ms", tpot), ("e2e_ms", e2e)):
            lim = limits.get(name)
            if lim is not None:
                fine = v <= float(lim)
                if name == "tpot_ms":  # a one-token answer has no TPOT: the SLO does not apply
                    fine |= np.isnan(v)
                met &= fine
        finished = rows & ~cancelled
        g = ok_gap if len(groups) == 1 else ok_gap & rows[gap_row]
        arrays = {"ttft": ttft[r_ok & ~np.isnan(ttft)], "tpot": tpot[r_ok & ~np.isnan(tpot)],
                  "itl_us": gaps[g],
                  "lateness": late[rows & ~np.isnan(late)]}
        counts = {"done": int(rows.sum()), "ok": int(r_ok.sum()),
                  "errors": int((finished & ~ok).sum()), "cancelled": int((rows & cancelled).sum()),
                  "slo_judged": int(finished.sum()) if judged else 0,
                  "slo_met": int(met.sum()) if judged else 0,
                  "prompt_tokens": int(prompt[rows & both].sum()),
                  "cached_tokens": int(cached[rows & both].sum())}
        out[key] = (arrays, counts)
    stage = np.array(batch["stage"], dtype=object)
    for s in sorted({v for v in batch["stage"] if v is not None}):  # per stage, for kvbench
        rows = stage == s  # run's progress line
        fin = rows & ~cancelled
        out[("", f"stage:{int(s)}")] = ({}, {"done": int(rows.sum()),
                                            "errors": int((fin & ~ok).sum())})
    return out


def _groups(ep_col: list, cls_col: list):
    """(endpoint, class) -> its rows (a bool mask), vectorised per distinct value."""
    eps, classes = list(dict.fromkeys(ep_col)), list(dict.fromkeys(cls_col))
    n = len(ep_col)
    ep_arr = np.array(ep_col, dtype=object) if len(eps) > 1 else None
    cls_arr = np.array(cls_col, dtype=object) if len(classes) > 1 else None
    for ep in eps:
        on_ep = np.ones(n, bool) if ep_arr is None else _equal(ep_arr, ep)
        for cls in classes:
            rows = on_ep if cls_arr is None else on_ep & _equal(cls_arr, cls)
            if rows.any():
                yield (ep, cls), rows


def _equal(values: np.ndarray, value) -> np.ndarray:
    """Elementwise ``values == value`` of an object array as bools (None matches None)."""
    return np.fromiter((v == value for v in values), bool, len(values)) if value is None else (
        values == value)


class LiveStats:
    """One per load process (and one on a distributed run's master, fed by its workers)."""

    def __init__(self, slo: dict | None = None, window_s: float = WINDOW_S,
                 clock=time.time_ns) -> None:
        self.slo = {k: dict(v) for k, v in (slo or {}).items()}
        self.window_s = window_s
        self.keys: dict[tuple, KeyStats] = {}
        self.stages: dict[int, dict] = {}  # stage -> done, errors
        self.inbox: collections.deque = collections.deque()  # batches from the sink's thread
        self.outbox: list = []  # a worker's derived chunks for the master
        self.clock = clock  # epoch ns (a bench replays time faster)
        self.t0_ns = clock()
        self.recent_ttft: collections.deque = collections.deque(maxlen=RECENT_TTFT)
        self.state: dict = {}  # in flight, dropped, stage now (this process)
        self.remote_state: dict[str, dict] = {}  # a master's: per worker
        self.telemetry = None  # TelemetryTail where the run directory is known
        self.derive_s = 0.0  # CPU seconds spent deriving (bench/live_cost.py reads it)

    # -- the load process side
    def tap(self, batch) -> None:
        """The sink wrote ``batch`` ({column: list}; any thread): queue it (a deque append)."""
        self.inbox.append(batch)

    def drain(self, keep_for_master: bool = False) -> None:
        """Derive what the sink queued."""
        t = time.thread_time()
        now = self.clock()
        while self.inbox:
            derived = derive(self.inbox.popleft(), self.slo)
            self.add(now, derived)
            if keep_for_master:
                self.outbox.append(_wire(derived))
        self.derive_s += time.thread_time() - t

    def add(self, t_ns: int, derived: dict) -> None:
        for key, (arrays, counts) in derived.items():
            if key[1].startswith("stage:"):
                st = self.stages.setdefault(int(key[1][6:]), {"done": 0, "errors": 0})
                for k in st:
                    st[k] += counts[k]
                continue
            ks = self.keys.get(key)
            if ks is None:
                ks = self.keys[key] = KeyStats()
            ks.add(t_ns, arrays, counts)
            ks.trim(t_ns, self.window_s)  # unwatched, the window still forgets
            if len(arrays["ttft"]):
                self.recent_ttft.extend(arrays["ttft"][-RECENT_TTFT:].tolist())

    # -- the master side
    def add_remote(self, data: dict) -> None:
        self.add(self.clock(), _unwire(data))

    # -- the views
    def summary(self) -> dict:
        now = self.clock()
        since_s = (now - self.t0_ns) / 1e9
        rows = []
        for (ep, cls), ks in sorted(self.keys.items()):
            s = ks.summary(self.window_s, now, since_s)
            rows.append({"endpoint": ep, "request_class": cls, **s,
                         "slo": self.slo.get(cls) or {}})
        state = dict(self.state)
        for w in self.remote_state.values():
            for k in ("in_flight", "dropped_at_cap", "started"):
                state[k] = state.get(k, 0) + (w.get(k) or 0)
            if w.get("open_stage") is not None:
                state["open_stage"] = w["open_stage"]
        tele = self.telemetry.summary(self.window_s) if self.telemetry is not None else {
            "note": "no run directory yet"}
        return {"t_ns": now, "since_s": since_s, "window_s": self.window_s, "rows": rows,
                "state": state, "workers": len(self.remote_state), "telemetry": tele,
                "stages": {str(k): v for k, v in sorted(self.stages.items())}}

    def progress(self) -> dict:
        """What kvbench run's progress line needs from this process (cheap: no sort)."""
        return {"t_ns": self.clock(), "pid": os.getpid(), "state": self.state,
                "stages": {str(k): v for k, v in self.stages.items()},
                "ttft_ms_recent": np.round(np.fromiter(self.recent_ttft, float), 3).tolist()}


_WIRE = {"ttft": np.float64, "tpot": np.float64, "lateness": np.float64, "itl_us": np.int64}


def _wire(derived: dict) -> dict:
    """Derived chunks as msgpack-able data (arrays as float64 bytes)."""
    return {"keys": [[k[0], k[1], {m: a.astype(_WIRE[m]).tobytes() for m, a in arrays.items()},
                      counts] for k, (arrays, counts) in derived.items()]}


def _unwire(data: dict) -> dict:
    return {(ep, cls): ({m: np.frombuffer(b, _WIRE[m]) for m, b in arrays.items()}, counts)
            for ep, cls, arrays, counts in data["keys"]}


# --------------------------------------------------------------------------- collectors' shards

class ShardTail:
    """Reads the batches appended to an Arrow IPC stream file since the last call (a shard
    another process is writing: a partial last message is left for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.schema = None

    def read(self) -> list:
        import pyarrow as pa  # only where a collector writes shards and a view is asked for

        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        src = pa.BufferReader(data)
        out, pos = [], 0
        while pos < len(data):
            try:
                msg = pa.ipc.read_message(src)
            except (pa.ArrowInvalid, EOFError, OSError, StopIteration):
                break
            if msg is None:
                break
            pos = src.tell()
            if msg.type == "schema":
                self.schema = pa.ipc.read_schema(msg)
            elif msg.type == "record batch" and self.schema is not None:
                out.append(pa.ipc.read_record_batch(msg, self.schema))
        self.offset += pos
        return out


class TelemetryTail:
    """What the collectors of ``kvbench run`` (its own threads, another process) write to the
    run directory: ``engine-*.arrows`` and ``gpu-*.arrows``, read as they grow. A plain locust
    run starts no collectors, and this says so."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.tails: dict[Path, ShardTail] = {}
        self.engine: collections.deque = collections.deque(maxlen=200_000)  # (t, ep, m, v)
        self.gpu: dict[tuple, dict] = {}  # (host, gpu) -> latest row

    def poll(self) -> None:
        for path in sorted(self.run_dir.glob("engine-*.arrows")) + sorted(
                self.run_dir.glob("gpu-*.arrows")):
            tail = self.tails.setdefault(path, ShardTail(path))
            for b in tail.read():
                if path.name.startswith("engine-"):
                    t, ep, m, v = (b.column(c).to_pylist() for c in
                                   ("t_ns", "endpoint", "metric", "value"))
                    self.engine.extend(zip(t, ep, m, v))
                else:
                    for row in b.to_pylist():
                        self.gpu[(row["host"], row["gpu"])] = row

    def summary(self, window_s: float) -> dict:
        from kvbench.engines import detect

        self.poll()
        if not self.tails:
            return {"note": "collectors not running (kvbench run starts them; a plain locust "
                            "run has no engine or GPU figures)"}
        engines = {}
        by_ep: dict[str, dict] = {}
        for t, ep, m, v in self.engine:
            by_ep.setdefault(ep, {}).setdefault(m, []).append((t, v))
        for ep, series in by_ep.items():
            a = detect(series)
            if a is None:
                continue
            last = {m: sum(v for _, v in _latest_set(s)) for m, s in series.items()}
            hits = a.hit_counters()
            ratio = None
            if hits:
                inc = [_increase(series.get(n, []), window_s) for n in hits]
                ratio = a.hit_ratio(*inc) if None not in inc else None
            engines[ep] = {"engine": a.name, "kv_usage": last.get(a.kv_usage),
                           "waiting": last.get(a.waiting), "running": last.get(a.running),
                           "hit_ratio": ratio}
        roles: dict[str, dict] = {}
        for row in self.gpu.values():
            r = roles.setdefault(row.get("role") or "unknown", {"gpus": 0, "sm": [],
                                                                "hbm_used": 0, "hbm_total": 0})
            r["gpus"] += 1
            sm = row.get("sm_active")
            if sm is None and row.get("gpu_util_pct") is not None:
                sm = row["gpu_util_pct"] / 100.0
            if sm is not None:
                r["sm"].append(sm)
            r["hbm_used"] += row.get("hbm_used_bytes") or 0
            r["hbm_total"] += row.get("hbm_total_bytes") or 0
        gpu = {k: {"gpus": v["gpus"], "sm_active": sum(v["sm"]) / len(v["sm"]) if v["sm"]
                   else None, "hbm_used_bytes": v["hbm_used"], "hbm_total_bytes": v["hbm_total"]}
               for k, v in roles.items()}
        return {"engines": engines, "gpu_by_role": gpu}


def _latest_set(points: list) -> list:
    """The samples of the last scrape of a series (several label sets share its time)."""
    t = points[-1][0]
    return [p for p in points if p[0] == t]


def _increase(points: list, window_s: float) -> float | None:
    """A counter's increase over the window (sum over its label sets at the first and last
    scrape inside it)."""
    if not points:
        return None
    t_end = points[-1][0]
    inside = [p for p in points if p[0] >= t_end - window_s * 1e9]
    t_first = inside[0][0]
    first = sum(v for t, v in inside if t == t_first)
    last = sum(v for t, v in inside if t == t_end)
    return max(last - first, 0.0)


# --------------------------------------------------------------------------- in a load process

def attach(ctx) -> LiveStats:
    """The live summary of a load context: taps its sink, derives once a second in a greenlet,
    and (under ``kvbench run``) keeps ``live-<host>-<pid>.json`` for its progress line."""
    import gevent
    from locust.runners import WorkerRunner

    from kvbench.loadgen.context import job_file_given

    env = ctx.environment
    stats = LiveStats(ctx.job.slo)
    stats.telemetry = TelemetryTail(ctx.run_dir)
    ctx.sink.taps.append(stats.tap)
    env.kvbench_live = stats
    runner = env.runner
    worker = isinstance(runner, WorkerRunner)
    path = live_path(ctx.run_dir) if job_file_given(env) else None
    if path is not None:  # gone with the process (kvbench run also sweeps them after a job)
        atexit.register(path.unlink, missing_ok=True)

    ticks = [0]
    _warm(ctx.job.slo)

    def tick() -> None:
        while True:
            gevent.sleep(TICK_S)
            try:
                # a worker sends its values only to a master with a web UI (it says so)
                send = worker and getattr(env, "kvbench_live_wanted", False)
                stats.drain(keep_for_master=send)
                d = ctx.dispatcher
                in_flight = d.in_flight if d is not None else max(
                    0, ctx.sink.started - ctx.sink.written - len(ctx.sink))
                stats.state = {"in_flight": in_flight, "started": ctx.sink.started,
                               "dropped_at_cap": d.dropped_at_cap if d is not None else 0,
                               "open_stage": st.to_dict() if (st := ctx.sink.meta.open_stage)
                               else None,
                               "pacing": ctx.pacing}
                if send:
                    for data in stats.outbox:
                        runner.send_message(LIVE_MSG, data)
                    stats.outbox = []
                    runner.send_message(LIVE_STATE_MSG, stats.state)
                ticks[0] += 1
                if path is not None and not ctx.sink.closed and ticks[0] % PROGRESS_TICKS == 0:
                    _write_json(path, stats.progress())
            except Exception:  # noqa: BLE001 - watching must never break the load
                import logging

                logging.getLogger("kvbench.live").debug("live tick failed", exc_info=True)
            if ctx.sink.closed:
                if path is not None:
                    path.unlink(missing_ok=True)
                return

    gevent.spawn(tick)
    return stats


def _warm(slo: dict | None) -> None:
    """Derive a two-row batch once before any load, into a throwaway summary: the first
    derivation's one-time costs (numpy's code paths) otherwise land in the first tick of the
    run, a 10 ms pause of every stream at 256 of them (bench/locust_path.py)."""
    from kvbench.core.rows import REQUEST_COLUMNS

    given = {"endpoint": ["w", "w"], "request_class": ["c", "c"], "status": ["ok", "cancelled"],
             "ttft_ns": [1_000_000, None], "e2e_ns": [3_000_000, None],
             "completion_tokens": [3, None], "prompt_tokens": [8, 8], "cached_tokens": [0, 0],
             "t_scheduled": [1, 1], "t_sent": [2, 2], "stage": [0, 0],
             "chunk_offsets_ns": [[1_000_000, 2_000_000, 3_000_000], []]}
    try:
        batch = {name: given.get(name, [None, None]) for name in REQUEST_COLUMNS}
        s = LiveStats(slo)
        s.tap(batch)
        s.drain()
        s.progress()
    except Exception:  # noqa: BLE001 - a warm-up must never stop the load
        import logging

        logging.getLogger("kvbench.live").debug("live warm-up failed", exc_info=True)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


def listen_as_worker(environment) -> None:
    """A worker sends its live values once its master asks (a master with a web UI)."""
    def on_wanted(environment, msg, **kw) -> None:
        environment.kvbench_live_wanted = True

    environment.runner.register_message(LIVE_WANTED_MSG, on_wanted)


def attach_master(environment, slo: dict | None, run_dir: Path | None) -> LiveStats:
    """A master's live summary, fed by its workers' messages."""
    stats = LiveStats(slo)
    if run_dir is not None:
        stats.telemetry = TelemetryTail(run_dir)
    environment.kvbench_live = stats
    runner = environment.runner

    def on_live(environment, msg, **kw) -> None:
        stats.add_remote(msg.data)

    def on_state(environment, msg, **kw) -> None:
        stats.remote_state[msg.node_id] = msg.data

    runner.register_message(LIVE_MSG, on_live)
    runner.register_message(LIVE_STATE_MSG, on_state)
    return stats
