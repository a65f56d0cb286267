"""The request frame: one row per request with every derived per-request value (ms, SLO
verdicts, stage wall times), built from the ``requests`` table (schema v1), vectorised. The
per-request values are ``reports.definitions``' (evaluated here, never restated), under the
same names.

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

from kvbench.core.contract import StageEntry
from kvbench.reports.measures import definitions as D
from kvbench.reports.measures.definitions import NS_PER_MS

# Prompt-length buckets (tokens): powers of two from 256; 512 is the seeds' P/D crossover.
BUCKET_EDGES_TOKENS = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

FRAME_COLUMNS = ("endpoint", "topology", "workload", "request_class", "session_id", "worker",
                 "status", "error", "server_replica", "server_region", "stage", "turn",
                 "http_status", "prompt_tokens", "prompt_tokens_client", "completion_tokens",
                 "completion_tokens_client", "cached_tokens", "shared_prefix_tokens",
                 "t_scheduled", "t_sent", "connect_ns", "ttft_ns", "e2e_ns", "server_queue_ns",
                 "server_prefill_ns", "server_kv_transfer_ns", "server_first_decode_ns",
                 "streamed", "parent_session_id", "subagent_index")
# the per-request definitions a frame holds as columns of the same names (the ITL gaps beside it)
_DEFINED = [k for k in D.DEFINITIONS if k != "itl_gaps_ns"]
_STRING_COLS = ("endpoint", "topology", "workload", "request_class", "session_id", "worker",
                "status", "error", "server_replica", "server_region", "parent_session_id")


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
    def from_offsets(cls, offsets: pa.ChunkedArray | pa.Array, keep: np.ndarray | None = None
                     ) -> "GapStore":
        """Gaps between consecutive chunk offsets per request (float32 ms); rows where ``keep``
        is False get none."""
        lists = D.from_arrow(pa.table({"chunk_offsets_ns": offsets}), ["chunk_offsets_ns"])
        got = D.gaps(*lists["chunk_offsets_ns"][:2], keep, convert=D.gap_ms32, dtype=np.float32)
        return cls(got.values, got.offsets)

    @classmethod
    def itl(cls, records: pa.Table | pa.RecordBatch) -> "GapStore":
        """The ITL gaps of ``records`` (``definitions.ITL_GAPS_NS``: their ``chunk_offsets_ns``
        and ``status``), as float32 ms."""
        names = D.inputs(["itl_gaps_ns"])
        got = D.evaluate(["itl_gaps_ns"], D.from_arrow(records, names), n=records.num_rows,
                         gaps_as=(D.gap_ms32, np.float32))["itl_gaps_ns"]
        return cls(got.values, got.offsets)

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


def request_frame(table: pa.Table, *, stages: Sequence[StageEntry | Mapping] = (),
                  slo: Mapping[str, object] | None = None,
                  endpoint_label: Callable[[str], str] | None = None,
                  gaps: "GapStore | None" = None) -> pd.DataFrame:
    """One row per request with every derived per-request value (``reports.definitions``).

    Needs the columns in ``FRAME_COLUMNS`` (plus ``chunk_offsets_ns`` unless ``gaps`` gives
    the requests' ITL gaps, with failed requests' gaps left out).

    ``stages``: run.json ``stages`` (their t_start_ns/t_end_ns give the wall time for rates);
    ``slo``: {class: SLO or dict with ttft_ms/tpot_ms/e2e_ms}."""
    n = table.num_rows
    d = D.evaluate(_DEFINED, D.from_arrow(table, D.inputs(_DEFINED)), slo, n=n)
    ttft_ns = _f64(table, "ttft_ns")
    e2e_ns = _f64(table, "e2e_ns")
    t_sent = table.column("t_sent").to_numpy(zero_copy_only=False)
    t_sched = table.column("t_scheduled").to_numpy(zero_copy_only=False)
    cols: dict[str, object] = {}
    for c in _STRING_COLS:
        cols[c] = _categorical(table.column(c))
    if endpoint_label is not None:
        cols["endpoint"] = cols["endpoint"].rename_categories(
            [endpoint_label(c) for c in cols["endpoint"].categories])
    cols.update({
        "stage": table.column("stage").to_numpy(zero_copy_only=False),
        "turn": table.column("turn").to_numpy(zero_copy_only=False),
        # a sub-agent's order among its siblings (-1, or NaN on older records: top level)
        "subagent_index": _f64(table, "subagent_index"),
        "ok": d["ok"].data,
        "cancelled": d["cancelled"].data,
        "http_status": _f64(table, "http_status"),
        "prompt_tokens": D.floats(d["prompt_tokens"]),
        "completion_tokens": D.floats(d["completion_tokens"]),
        "cached_tokens": D.floats(d["cached_tokens"]),
        "shared_prefix_tokens": _f64(table, "shared_prefix_tokens"),
        "t_scheduled_ns": t_sched,
        "t_sent_ns": t_sent,
        **{name: D.floats(d[name]) for name in ("ttft_ms", "tpot_ms", "e2e_ms", "lateness_ms",
                                                "ttft_intended_ms", "e2e_intended_ms")},
        "connect_ms": _f64(table, "connect_ns") / NS_PER_MS,
        # when the request stopped (last byte, or the error): the end of the achieved interval
        "t_done_ns": t_sent.astype(np.float64) + np.nan_to_num(e2e_ns),
        "server_queue_ms": _f64(table, "server_queue_ns") / NS_PER_MS,
        "server_prefill_ms": _f64(table, "server_prefill_ns") / NS_PER_MS,
        "server_kv_transfer_ms": _f64(table, "server_kv_transfer_ns") / NS_PER_MS,
        "server_first_decode_ms": _f64(table, "server_first_decode_ns") / NS_PER_MS,
    })
    cols["prompt_bucket"] = prompt_buckets(cols["prompt_tokens"])
    cols["slo_met"] = d["slo_met"].data
    cols["has_slo"] = d["has_slo"].data
    key, wall, achieved, offered, started = _stage_walls(table, cols, stages, e2e_ns, ttft_ns)
    cols["stage_key"] = key
    cols["stage_wall_s"] = wall
    cols["stage_achieved_s"] = achieved
    cols["stage_offered_s"] = offered
    cols["stage_started_s"] = started
    if gaps is None:
        gaps = GapStore.itl(table)
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
        if not isinstance(st, StageEntry):  # a run.json object (tests, hand-made runs)
            st = StageEntry.from_dict(st)
        try:
            k = (ep_names.index(st.endpoint) * n_wl + wl_names.index(st.workload)) \
                * 10_000 + int(st.index)
            t0, t1 = int(st.t_start_ns), int(st.t_end_ns)
        except (ValueError, TypeError):
            continue
        i = pos.get(k)
        offered = math.nan  # a closed loop offers users, not a rate
        if st.pacing == "trace":
            if i is not None and sched_last[i] > t0:
                offered = (sched_last[i] - t0) / 1e9
        elif st.rate_rps:
            offered = float(st.duration_s or (t1 - t0) / 1e9)
        elif not st.users and i is not None:  # a record that does not say: the data
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


class _Held(Mapping):
    """A frame's columns as ``definitions.evaluate`` takes them: the definitions it holds
    (``_DEFINED``, under the same names)."""

    def __init__(self, frame: pd.DataFrame):
        self.frame = frame

    def __getitem__(self, name: str) -> D.Vec:
        if name not in self:
            raise KeyError(name)
        if name in D.FLAGS:
            return D.Vec(self.frame[name].to_numpy(bool), True)
        a = self.frame[name].to_numpy(np.float64)
        return D.Vec(a, ~np.isnan(a))

    def __contains__(self, name) -> bool:
        return name in _DEFINED and name in self.frame.columns

    def __iter__(self):
        return (c for c in self.frame.columns if c in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def defined(frame: pd.DataFrame, name: str) -> np.ndarray:
    """Definition ``name`` (``reports.definitions``) over a frame's rows, evaluated from the
    definitions it holds (``failed`` from ``ok`` and ``cancelled``, ...)."""
    held = _Held(frame)
    return D.evaluate([name], held, n=len(frame), known=held)[name].data


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
