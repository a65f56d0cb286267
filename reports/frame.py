"""The request frame: one row per request with every derived per-request value (ms, SLO
verdicts, stage wall times), built from the ``requests`` table (schema v1), vectorised.

The ITL gaps of a frame's requests live beside it in a ``GapStore`` (``frame.attrs["itl"]``),
flat float32 ms with per-row offsets, so that subsetting a frame never copies 50M gaps. Metric
definitions over the frame are in ``reports.metrics``.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pandas.api.types import union_categoricals

NS_PER_MS = 1e6
# Prompt-length buckets (tokens): powers of two from 256; 512 is the seeds' P/D crossover.
BUCKET_EDGES_TOKENS = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

FRAME_COLUMNS = ("endpoint", "topology", "workload", "request_class", "session_id", "worker",
                 "status", "error", "server_replica", "server_region", "stage", "turn",
                 "http_status", "prompt_tokens", "prompt_tokens_client", "completion_tokens",
                 "completion_tokens_client", "cached_tokens", "shared_prefix_tokens",
                 "t_scheduled", "t_sent", "connect_ns", "ttft_ns", "e2e_ns", "server_queue_ns",
                 "server_prefill_ns", "server_kv_transfer_ns", "server_first_decode_ns")
_STRING_COLS = ("endpoint", "topology", "workload", "request_class", "session_id", "worker",
                "status", "error", "server_replica", "server_region")


# --------------------------------------------------------------------------------------------
# frame construction


def _f64(table: pa.Table, name: str) -> np.ndarray:
    """Column as float64 numpy, nulls as NaN."""
    return pc.cast(table.column(name), pa.float64()).to_numpy()


def _categorical(col: pa.ChunkedArray) -> pd.Categorical:
    enc = pc.dictionary_encode(col).combine_chunks()
    codes = pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int32)
    cats = pd.Index(enc.dictionary.to_pylist(), dtype=object)
    return pd.Categorical.from_codes(codes, categories=cats)


class GapStore:
    """The pooled inter-token gaps of a frame's requests: flat float32 ms plus per-row offsets.

    Kept outside the frame's columns (in ``frame.attrs["itl"]``, shared, never deep-copied) so
    that subsetting a frame never copies 50M gaps; each row's ``itl_row`` points here."""

    __slots__ = ("flat", "offsets")

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat = flat
        self.offsets = offsets  # int64, rows + 1

    def __deepcopy__(self, memo):  # immutable: pandas may deep-copy attrs on every subset
        return self

    def __copy__(self):
        return self

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_offsets(cls, offsets: pa.ChunkedArray | pa.Array, keep: np.ndarray | None = None,
                     block: int = 4_000_000) -> "GapStore":
        """Gaps between consecutive chunk offsets per request, done on the flat value buffer
        (no per-row Python); rows where ``keep`` is False get no gaps."""
        if isinstance(offsets, pa.ChunkedArray):
            offsets = offsets.combine_chunks() if offsets.num_chunks else pa.array(
                [], pa.list_(pa.int64()))
        lens = pc.fill_null(pc.list_value_length(offsets), 0).to_numpy(
            zero_copy_only=False).astype(np.int64)
        values = pc.list_flatten(offsets).to_numpy(zero_copy_only=False)
        n_gaps = np.maximum(lens - 1, 0)
        ends = np.cumsum(lens)
        # A diff at flat position i is a real gap unless i is the last chunk of its request
        # (or its request is not kept).
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
        out = np.empty(int(new_offsets[-1]), np.float32)
        pos = 0
        for s in range(0, len(keep_flat), block):  # bounded temporaries
            e = min(s + block, len(keep_flat))
            d = values[s + 1:e + 1] - values[s:e]
            d = d[keep_flat[s:e]]
            out[pos:pos + len(d)] = d / NS_PER_MS
            pos += len(d)
        return cls(out, new_offsets)

    @classmethod
    def concat(cls, stores: Sequence["GapStore"]) -> "GapStore":
        if len(stores) == 1:
            return stores[0]
        flat = np.concatenate([s.flat for s in stores]) if stores else np.zeros(0, np.float32)
        offs, base = [np.zeros(1, np.int64)], 0
        for s in stores:
            offs.append(s.offsets[1:] + base)
            base += int(s.offsets[-1])
        return cls(flat, np.concatenate(offs))

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The gaps of ``rows`` (row ids), pooled; a contiguous run of rows is a view."""
        rows = np.asarray(rows, np.int64)
        if len(rows) == 0:
            return np.zeros(0, np.float32)
        if rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
            return self.flat[self.offsets[rows[0]]:self.offsets[rows[-1] + 1]]
        starts = self.offsets[rows]
        lens = self.offsets[rows + 1] - starts
        total = int(lens.sum())
        if total == 0:
            return np.zeros(0, np.float32)
        shift = np.repeat(starts - (np.cumsum(lens) - lens), lens)
        return self.flat[shift + np.arange(total)]

    def lists(self) -> list[list[float]]:
        return [self.flat[a:b].tolist() for a, b in zip(self.offsets[:-1], self.offsets[1:])]


def chunk_gaps(offsets: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Per request, the gaps (float32 ms) between consecutive chunk offsets, as a list array."""
    g = GapStore.from_offsets(offsets)
    return pa.LargeListArray.from_arrays(pa.array(g.offsets), pa.array(g.flat))


def prompt_bucket_labels() -> list[str]:
    edges = BUCKET_EDGES_TOKENS
    labels = [f"{edges[i]}-{edges[i + 1] - 1}" for i in range(len(edges) - 1)]
    return labels + [f">={edges[-1]}"]


def prompt_buckets(prompt_tokens: np.ndarray) -> pd.Categorical:
    labels = prompt_bucket_labels()
    idx = np.searchsorted(np.asarray(BUCKET_EDGES_TOKENS), prompt_tokens, side="right") - 1
    idx = np.where(np.isnan(prompt_tokens), -1, idx).astype(np.int32)
    return pd.Categorical.from_codes(idx, categories=labels, ordered=True)


def _slo_get(slo_cfg, key: str):
    if slo_cfg is None:
        return None
    return slo_cfg.get(key) if isinstance(slo_cfg, Mapping) else getattr(slo_cfg, key, None)


def has_slo(classes: pd.Categorical, slo: Mapping[str, object] | None) -> np.ndarray:
    """True where the request's class has an SLO (at least one of TTFT, TPOT, E2E set).

    A class without one is shown as "no SLO": its requests are left out of SLO attainment and
    goodput (never counted as met by default)."""
    with_slo = [str(name) for name, cfg in (slo or {}).items()
                if any(_slo_get(cfg, k) is not None for k in ("ttft_ms", "tpot_ms", "e2e_ms"))]
    return np.asarray(pd.Series(classes.astype(object)).isin(with_slo).to_numpy(), bool)


def slo_met(frame_cols: Mapping[str, np.ndarray], classes: pd.Categorical,
            slo: Mapping[str, object] | None) -> np.ndarray:
    """True where the request succeeded and met every SLO set for its class.

    A class with no SLO table only needs success here, but ``has_slo`` leaves it out of
    attainment and goodput; a single-token response has no TPOT, so a TPOT SLO does not apply
    to it."""
    ok = frame_cols["ok"]
    met = ok.copy()
    if not slo:
        return met
    cls = np.asarray(classes.astype(object))
    for name, cfg in slo.items():
        rows = cls == name
        if not rows.any():
            continue
        for key, col in (("ttft_ms", "ttft_ms"), ("tpot_ms", "tpot_ms"), ("e2e_ms", "e2e_ms")):
            limit = _slo_get(cfg, key)
            if limit is None:
                continue
            v = frame_cols[col][rows]
            fine = (v <= float(limit)) | (np.isnan(v) & (key == "tpot_ms"))
            met[rows] &= fine
    return met


def request_frame(table: pa.Table, *, stages: Sequence[Mapping] = (),
                  slo: Mapping[str, object] | None = None,
                  endpoint_label: Callable[[str], str] | None = None,
                  gaps: "GapStore | None" = None) -> pd.DataFrame:
    """One row per request with every derived per-request value (``metrics.DEFINITIONS``).

    Needs the columns in ``FRAME_COLUMNS`` (plus ``chunk_offsets_ns`` unless ``gaps`` gives
    the requests' ITL gaps, with failed requests' gaps left out).

    ``stages``: run.json ``stages`` (their t_start_ns/t_end_ns give the wall time for rates);
    ``slo``: {class: SLO or dict with ttft_ms/tpot_ms/e2e_ms}."""
    n = table.num_rows
    status = _categorical(table.column("status"))
    ok = np.asarray(status == "ok")
    cancelled = np.asarray(status == "cancelled")  # cut by a stop: neither ok nor an error
    ttft_ns = _f64(table, "ttft_ns")
    e2e_ns = _f64(table, "e2e_ns")
    t_sent = table.column("t_sent").to_numpy(zero_copy_only=False)
    t_sched = table.column("t_scheduled").to_numpy(zero_copy_only=False)
    prompt = _f64(table, "prompt_tokens")
    prompt = np.where(np.isnan(prompt), _f64(table, "prompt_tokens_client"), prompt)
    completion = _f64(table, "completion_tokens")
    completion = np.where(np.isnan(completion), _f64(table, "completion_tokens_client"),
                          completion)
    ttft_ms = np.where(ok, ttft_ns / NS_PER_MS, np.nan)
    e2e_ms = np.where(ok, e2e_ns / NS_PER_MS, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot_ms = np.where(ok & (completion > 1), (e2e_ms - ttft_ms) / (completion - 1), np.nan)
    cols: dict[str, object] = {}
    for c in _STRING_COLS:
        cols[c] = _categorical(table.column(c))
    if endpoint_label is not None:
        cols["endpoint"] = cols["endpoint"].rename_categories(
            [endpoint_label(c) for c in cols["endpoint"].categories])
    cols.update({
        "stage": table.column("stage").to_numpy(zero_copy_only=False),
        "turn": table.column("turn").to_numpy(zero_copy_only=False),
        "ok": ok,
        "cancelled": cancelled,
        "http_status": _f64(table, "http_status"),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": _f64(table, "cached_tokens"),
        "shared_prefix_tokens": _f64(table, "shared_prefix_tokens"),
        "t_scheduled_ns": t_sched,
        "t_sent_ns": t_sent,
        "ttft_ms": ttft_ms,
        "tpot_ms": tpot_ms,
        "e2e_ms": e2e_ms,
        "lateness_ms": (t_sent - t_sched) / NS_PER_MS,
        "connect_ms": _f64(table, "connect_ns") / NS_PER_MS,
        # when the request stopped (last byte, or the error): the end of the achieved interval
        "t_done_ns": t_sent.astype(np.float64) + np.nan_to_num(e2e_ns),
        "server_queue_ms": _f64(table, "server_queue_ns") / NS_PER_MS,
        "server_prefill_ms": _f64(table, "server_prefill_ns") / NS_PER_MS,
        "server_kv_transfer_ms": _f64(table, "server_kv_transfer_ns") / NS_PER_MS,
        "server_first_decode_ms": _f64(table, "server_first_decode_ns") / NS_PER_MS,
    })
    cols["prompt_bucket"] = prompt_buckets(prompt)
    cols["slo_met"] = slo_met(cols, cols["request_class"], slo)
    cols["has_slo"] = has_slo(cols["request_class"], slo)
    key, wall, achieved, offered, started = _stage_walls(table, cols, stages, e2e_ns, ttft_ns)
    cols["stage_key"] = key
    cols["stage_wall_s"] = wall
    cols["stage_achieved_s"] = achieved
    cols["stage_offered_s"] = offered
    cols["stage_started_s"] = started
    if gaps is None:
        gaps = GapStore.from_offsets(table.column("chunk_offsets_ns"), keep=ok)
    if len(gaps) != n:
        raise ValueError(f"gap store has {len(gaps)} rows for {n} requests")
    cols["itl_row"] = np.arange(n, dtype=np.int64)
    frame = pd.DataFrame(cols, index=pd.RangeIndex(n))
    frame.attrs["itl"] = gaps
    return frame


def _stage_walls(table: pa.Table, cols: dict, stages: Sequence[Mapping],
                 e2e_ns: np.ndarray, ttft_ns: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per row: an id of its (endpoint, workload, stage) and four times of that stage, in s:

    - wall: the stage's t_end - t_start from run.json (fallback: last response end minus first
      scheduled send);
    - achieved: first send to last completion of a request that finished (drain included;
      requests cancelled at the stop do not complete), the interval of achieved throughput;
    - offered: the schedule window the stage's arrivals were drawn over: ``duration_s`` of an
      open-loop rate stage, stage start to last scheduled arrival of a trace replay (whose
      stage ends when the trace does), NaN for a closed loop (users, not a rate); without a
      stage record, first to last scheduled send;
    - started: first send to the last first token of a successful request: the interval over
      which the endpoint started serving the stage's requests (a long answer does not stretch
      it; a queue before the prefill does)."""
    ep_codes = np.asarray(cols["endpoint"].codes, np.int64)
    wl_codes = np.asarray(cols["workload"].codes, np.int64)
    stage = np.asarray(cols["stage"], np.int64)
    n_wl = max(len(cols["workload"].categories), 1)
    key = (ep_codes * n_wl + wl_codes) * 10_000 + stage
    wall = np.full(len(key), np.nan)
    if len(key) == 0:
        return key, wall, wall.copy(), wall.copy(), wall.copy()
    uniq, inv = np.unique(key, return_inverse=True)
    m = len(uniq)
    t_sched = np.asarray(cols["t_scheduled_ns"], np.float64)
    t_sent = np.asarray(cols["t_sent_ns"], np.float64)
    t_end = t_sent + np.nan_to_num(e2e_ns)
    first, last = np.full(m, np.inf), np.full(m, -np.inf)
    np.minimum.at(first, inv, t_sched)
    np.maximum.at(last, inv, t_end)
    data_wall = (last - first) / 1e9
    # achieved: first send of the stage to its last completion (finished requests only)
    sent = t_sent > 0
    done = ~np.asarray(cols["cancelled"], bool) & sent
    first_sent, last_done = np.full(m, np.inf), np.full(m, -np.inf)
    np.minimum.at(first_sent, inv[sent], t_sent[sent])
    np.maximum.at(last_done, inv[done], t_end[done])
    with np.errstate(invalid="ignore"):
        achieved = (last_done - first_sent) / 1e9
    achieved = np.where(np.isfinite(achieved) & (achieved > 0), achieved, np.nan)
    first_tok = t_sent + ttft_ns
    has_tok = np.asarray(cols["ok"], bool) & sent & ~np.isnan(ttft_ns)
    last_tok = np.full(m, -np.inf)
    np.maximum.at(last_tok, inv[has_tok], first_tok[has_tok])
    with np.errstate(invalid="ignore"):
        started = (last_tok - first_sent) / 1e9
    started = np.where(np.isfinite(started) & (started > 0), started, np.nan)
    sched_last = np.full(m, -np.inf)
    np.maximum.at(sched_last, inv, t_sched)
    with np.errstate(invalid="ignore"):
        data_offered = (sched_last - first) / 1e9
    by_stage: dict[int, tuple[float, float]] = {}
    raw_ep = table.column("endpoint")
    ep_names = list(_categorical(raw_ep).categories)
    wl_names = list(cols["workload"].categories)
    pos = {int(k): i for i, k in enumerate(uniq)}
    for st in stages or ():
        try:
            k = (ep_names.index(st["endpoint"]) * n_wl + wl_names.index(st["workload"])) \
                * 10_000 + int(st["index"])
            t0, t1 = int(st["t_start_ns"]), int(st["t_end_ns"])
        except (KeyError, ValueError, TypeError):
            continue
        i = pos.get(k)
        offered = math.nan  # a closed loop offers users, not a rate
        if st.get("pacing") == "trace":
            if i is not None and sched_last[i] > t0:
                offered = (sched_last[i] - t0) / 1e9
        elif st.get("rate_rps"):
            offered = float(st.get("duration_s") or (t1 - t0) / 1e9)
        elif not st.get("users") and i is not None:  # a record that does not say: the data
            offered = data_offered[i]
        by_stage[k] = ((t1 - t0) / 1e9, offered)
    walls, offers = np.empty(m), np.empty(m)
    for i, k in enumerate(uniq):
        got = by_stage.get(int(k))
        walls[i], offers[i] = got if got is not None else (data_wall[i], data_offered[i])
    walls = np.where(walls > 0, walls, np.nan)
    offers = np.where(offers > 0, offers, np.nan)
    return key, walls[inv], achieved[inv], offers[inv], started[inv]


# --------------------------------------------------------------------------------------------
# accessors


def itl_values(frame: pd.DataFrame) -> np.ndarray:
    """Pooled inter-token gaps (ms) of the requests in ``frame`` (failed ones have none)."""
    store = frame.attrs.get("itl")
    if store is None:
        raise ValueError("frame has no ITL gap store; build it with reports.frame."
                         "request_frame (and concatenate frames with reports.frame.concat)")
    return store.gather(frame["itl_row"].to_numpy())


def wall_s(frame: pd.DataFrame, column: str = "stage_wall_s") -> float:
    """Wall time of the stages the rows come from (each stage once); ``column`` picks which
    time of each stage (``stage_achieved_s``, ``stage_offered_s``: see ``request_frame``)."""
    if len(frame) == 0:
        return math.nan
    keys = frame["stage_key"].to_numpy()
    walls = frame[column].to_numpy()
    _, first = np.unique(keys, return_index=True)
    total = np.nansum(walls[first])
    return float(total) if total > 0 else math.nan


def achieved_s(frame: pd.DataFrame) -> float:
    """The achieved interval of the rows' stages (first send to last completion, summed)."""
    return wall_s(frame, "stage_achieved_s")


def started_s(frame: pd.DataFrame) -> float:
    """First send to last first token of the rows' stages, summed (``request_frame``)."""
    return wall_s(frame, "stage_started_s")


def offered_s(frame: pd.DataFrame) -> float:
    """The schedule windows of the rows' stages, summed (NaN for closed-loop stages only)."""
    return wall_s(frame, "stage_offered_s")


def concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Frames of several runs as one: categories unioned, stage keys and ITL rows kept apart."""
    if len(frames) == 1:
        return frames[0]
    cat_cols = [c for c in frames[0].columns if isinstance(frames[0][c].dtype,
                                                           pd.CategoricalDtype)]
    key_offset, row_offset = 0, 0
    parts = []
    for f in frames:
        store = f.attrs["itl"]
        f = f.copy()
        f["stage_key"] = f["stage_key"] + key_offset
        key_offset = int(f["stage_key"].max()) + 1 if len(f) else key_offset
        f["itl_row"] = f["itl_row"] + row_offset
        row_offset += len(store)
        f.attrs = {}
        parts.append(f)
    for c in cat_cols:
        if c == "prompt_bucket":
            continue
        u = union_categoricals([p[c].array for p in parts])
        for p in parts:
            p[c] = pd.Categorical(p[c].astype(object), categories=u.categories)
    out = pd.concat(parts, ignore_index=True)
    out.attrs["itl"] = GapStore.concat([f.attrs["itl"] for f in frames])
    return out
