"""The one definition of every metric kvbench reports, as pure vectorised functions.

Two steps. ``request_frame`` turns the raw ``requests`` table (schema v1) into a pandas frame
with one row per request and the derived per-request values (TTFT, TPOT, E2E, lateness in ms,
SLO verdicts, the pooled inter-token gaps as an Arrow list column). Then every metric is a
function ``frame -> float`` in ``METRICS``; ``statistic(frame, name)`` evaluates one and
``bootstrap(frame, name)`` gives its seeded bootstrap confidence interval. The gate (issue 7)
uses exactly these, so a report and a gate verdict can never disagree on a definition.

Definitions (DESIGN.md; printed in every report's appendix from ``DEFINITIONS``):
latency metrics count successful requests only; lateness counts every request sent; rates
divide by the wall time of the load stages the rows came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

NS_PER_MS = 1e6
QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99, "p999": 0.999}
# Prompt-length buckets (tokens): powers of two from 256; 512 is the seeds' P/D crossover.
BUCKET_EDGES_TOKENS = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"

DEFINITIONS = {
    "TTFT": "time to first token: arrival of the first chunk carrying a generated token, "
            "minus t_sent (successful requests).",
    "TPOT": "time per output token: (E2E - TTFT) / (completion_tokens - 1), per request, "
            "when completion_tokens > 1.",
    "ITL": "inter-token latency: gaps between consecutive token-carrying chunks, pooled over "
           "successful requests; a chunk carrying k tokens is one gap.",
    "E2E": "end to end: last byte of the response minus t_sent (successful requests).",
    "lateness": "client lateness: t_sent - t_scheduled, every request sent (the load "
                "generator's own delay; never hidden).",
    "throughput": "requests finished (any status) per second of load-stage wall time; input and "
                  "output tokens/s count successful requests' server-reported usage.",
    "goodput": "requests that succeeded and met every SLO of their class (TTFT, TPOT, E2E), per "
               "second of load-stage wall time; errors count as misses.",
    "hit ratio": "prefix-cache hit ratio: sum(cached_tokens) / sum(prompt_tokens) over "
                 "successful requests reporting cached_tokens; engine: delta "
                 f"{PREFIX_HITS} / delta {PREFIX_QUERIES}.",
    "error rate": "requests with a status other than ok / all requests.",
    "percentiles": "linear interpolation between order statistics (numpy's default); "
                   "confidence intervals by a seeded bootstrap over requests.",
    "wall time": "sum over the load stages in the rows of (t_end - t_start) from run.json; "
                 "without it, last response end minus first scheduled send per stage.",
}

FRAME_COLUMNS = ("endpoint", "topology", "workload", "request_class", "session_id", "worker",
                 "status", "error", "server_replica", "server_region", "stage", "turn",
                 "http_status", "prompt_tokens", "prompt_tokens_client", "completion_tokens",
                 "completion_tokens_client", "cached_tokens", "shared_prefix_tokens",
                 "t_scheduled", "t_sent", "ttft_ns", "e2e_ns", "server_queue_ns",
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


def slo_met(frame_cols: Mapping[str, np.ndarray], classes: pd.Categorical,
            slo: Mapping[str, object] | None) -> np.ndarray:
    """True where the request succeeded and met every SLO set for its class.

    A class with no SLO table only needs success; a single-token response has no TPOT, so a
    TPOT SLO does not apply to it."""
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
    """One row per request with every derived per-request value; see ``DEFINITIONS``.

    Needs the columns in ``FRAME_COLUMNS`` (plus ``chunk_offsets_ns`` unless ``gaps`` gives
    the requests' ITL gaps, with failed requests' gaps left out).

    ``stages``: run.json ``stages`` (their t_start_ns/t_end_ns give the wall time for rates);
    ``slo``: {class: SLO or dict with ttft_ms/tpot_ms/e2e_ms}."""
    n = table.num_rows
    status = _categorical(table.column("status"))
    ok = np.asarray(status == "ok")
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
        "server_queue_ms": _f64(table, "server_queue_ns") / NS_PER_MS,
        "server_prefill_ms": _f64(table, "server_prefill_ns") / NS_PER_MS,
        "server_kv_transfer_ms": _f64(table, "server_kv_transfer_ns") / NS_PER_MS,
        "server_first_decode_ms": _f64(table, "server_first_decode_ns") / NS_PER_MS,
    })
    cols["prompt_bucket"] = prompt_buckets(prompt)
    cols["slo_met"] = slo_met(cols, cols["request_class"], slo)
    key, wall = _stage_walls(table, cols, stages, e2e_ns)
    cols["stage_key"] = key
    cols["stage_wall_s"] = wall
    if gaps is None:
        gaps = GapStore.from_offsets(table.column("chunk_offsets_ns"), keep=ok)
    if len(gaps) != n:
        raise ValueError(f"gap store has {len(gaps)} rows for {n} requests")
    cols["itl_row"] = np.arange(n, dtype=np.int64)
    frame = pd.DataFrame(cols, index=pd.RangeIndex(n))
    frame.attrs["itl"] = gaps
    return frame


def _stage_walls(table: pa.Table, cols: dict, stages: Sequence[Mapping],
                 e2e_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: an id of its (endpoint, workload, stage) and that stage's wall time in s."""
    ep_codes = np.asarray(cols["endpoint"].codes, np.int64)
    wl_codes = np.asarray(cols["workload"].codes, np.int64)
    stage = np.asarray(cols["stage"], np.int64)
    n_wl = max(len(cols["workload"].categories), 1)
    key = (ep_codes * n_wl + wl_codes) * 10_000 + stage
    wall = np.full(len(key), np.nan)
    if len(key) == 0:
        return key, wall
    uniq, inv = np.unique(key, return_inverse=True)
    # Fallback from the data: last response end minus first scheduled send, per stage.
    t_sched = np.asarray(cols["t_scheduled_ns"], np.float64)
    t_end = np.asarray(cols["t_sent_ns"], np.float64) + np.nan_to_num(e2e_ns)
    first = np.full(len(uniq), np.inf)
    last = np.full(len(uniq), -np.inf)
    np.minimum.at(first, inv, t_sched)
    np.maximum.at(last, inv, t_end)
    data_wall = (last - first) / 1e9
    by_stage = {}
    raw_ep = table.column("endpoint")
    ep_names = list(_categorical(raw_ep).categories)
    wl_names = list(cols["workload"].categories)
    for st in stages or ():
        try:
            k = (ep_names.index(st["endpoint"]) * n_wl + wl_names.index(st["workload"])) \
                * 10_000 + int(st["index"])
            by_stage[k] = (int(st["t_end_ns"]) - int(st["t_start_ns"])) / 1e9
        except (KeyError, ValueError, TypeError):
            continue
    walls = np.array([by_stage.get(int(k), d) for k, d in zip(uniq, data_wall)])
    walls = np.where(walls > 0, walls, np.nan)
    return key, walls[inv]


# --------------------------------------------------------------------------------------------
# primitives


def quantile(values: np.ndarray, q: float) -> float:
    v = _clean(values)
    return float(np.quantile(v, q)) if len(v) else math.nan


def mean(values: np.ndarray) -> float:
    v = _clean(values)
    return float(v.mean(dtype=np.float64)) if len(v) else math.nan


def itl_values(frame: pd.DataFrame) -> np.ndarray:
    """Pooled inter-token gaps (ms) of the requests in ``frame`` (failed ones have none)."""
    store = frame.attrs.get("itl")
    if store is None:
        raise ValueError("frame has no ITL gap store; build it with reports.metrics."
                         "request_frame (and concatenate frames with reports.data.concat)")
    return store.gather(frame["itl_row"].to_numpy())


def wall_s(frame: pd.DataFrame) -> float:
    """Wall time of the stages the rows come from (each stage once)."""
    if len(frame) == 0:
        return math.nan
    keys = frame["stage_key"].to_numpy()
    walls = frame["stage_wall_s"].to_numpy()
    _, first = np.unique(keys, return_index=True)
    total = np.nansum(walls[first])
    return float(total) if total > 0 else math.nan


def _rate(count: float, frame: pd.DataFrame) -> float:
    w = wall_s(frame)
    return float(count) / w if w == w and w > 0 else math.nan


def throughput_rps(frame: pd.DataFrame) -> float:
    return _rate(len(frame), frame)


def goodput_rps(frame: pd.DataFrame) -> float:
    return _rate(int(frame["slo_met"].sum()), frame)


def input_tps(frame: pd.DataFrame) -> float:
    return _rate(np.nansum(frame["prompt_tokens"].to_numpy()[frame["ok"].to_numpy()]), frame)


def output_tps(frame: pd.DataFrame) -> float:
    return _rate(np.nansum(frame["completion_tokens"].to_numpy()[frame["ok"].to_numpy()]), frame)


def error_rate(frame: pd.DataFrame) -> float:
    n = len(frame)
    return float((~frame["ok"].to_numpy()).sum()) / n if n else math.nan


def slo_attainment(frame: pd.DataFrame) -> float:
    n = len(frame)
    return float(frame["slo_met"].to_numpy().sum()) / n if n else math.nan


def hit_ratio(frame: pd.DataFrame) -> float:
    cached = frame["cached_tokens"].to_numpy()
    prompt = frame["prompt_tokens"].to_numpy()
    rows = frame["ok"].to_numpy() & ~np.isnan(cached) & ~np.isnan(prompt)
    total = prompt[rows].sum()
    return float(cached[rows].sum() / total) if total > 0 else math.nan


def error_breakdown(frame: pd.DataFrame, by: Sequence[str] = ("endpoint",)) -> pd.DataFrame:
    """Counts of requests by status (and ``by``), with each status's share of the group."""
    g = frame.groupby(list(by) + ["status"], observed=True).size().rename("requests")
    out = g.reset_index()
    out["share"] = out["requests"] / out.groupby(list(by), observed=True)["requests"].transform(
        "sum")
    return out


def counter_delta(t_ns: np.ndarray, series: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Increase of each counter series over its samples, counting resets as restarts from 0.

    Returns one delta per distinct ``series`` id (sorted ids)."""
    if len(values) == 0:
        return np.zeros(0)
    order = np.lexsort((t_ns, series))
    s, v = series[order], values[order]
    d = np.diff(v)
    same = s[1:] == s[:-1]
    inc = np.where(d >= 0, d, v[1:])  # after a reset the counter counts from zero again
    inc = np.where(same, inc, 0.0)
    uniq, first = np.unique(s, return_index=True)
    sums = np.add.reduceat(np.concatenate([[0.0], inc]), first) if len(inc) else np.zeros(
        len(uniq))
    return sums


def engine_counter_increase(engine: pa.Table, metric: str) -> dict[str, float]:
    """Total increase of a counter per endpoint (summed over its label sets)."""
    if engine.num_rows == 0:
        return {}
    rows = engine.filter(pc.equal(engine.column("metric"), metric))
    if rows.num_rows == 0:
        return {}
    labels = [str(sorted(x)) if x else "" for x in rows.column("labels").to_pylist()]
    ep = rows.column("endpoint").to_pylist()
    keys = pd.Categorical([f"{e}\x00{lab}" for e, lab in zip(ep, labels)])
    codes = np.asarray(keys.codes, np.int64)
    deltas = counter_delta(rows.column("t_ns").to_numpy(), codes,
                           rows.column("value").to_numpy(zero_copy_only=False))
    out: dict[str, float] = {}
    for code, delta in zip(np.unique(codes), deltas):
        name = keys.categories[code].split("\x00", 1)[0]
        out[name] = out.get(name, 0.0) + float(delta)
    return out


def engine_hit_ratio(engine: pa.Table) -> dict[str, float]:
    """Per endpoint: delta prefix_cache_hits_total / delta prefix_cache_queries_total."""
    hits = engine_counter_increase(engine, PREFIX_HITS)
    queries = engine_counter_increase(engine, PREFIX_QUERIES)
    return {ep: hits.get(ep, 0.0) / q for ep, q in queries.items() if q > 0}


# --------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class Metric:
    name: str
    fn: Callable[[pd.DataFrame], float]
    unit: str
    higher_is_better: bool
    column: str | None = None  # per-request column a quantile/mean is taken over
    q: float | None = None  # the quantile, for quantile metrics
    label: str = ""


def _quantile_metric(column: str, q: float) -> Callable[[pd.DataFrame], float]:
    if column == "itl_ms":
        return lambda f: quantile(itl_values(f), q)
    return lambda f: quantile(f[column].to_numpy(), q)


def _mean_metric(column: str) -> Callable[[pd.DataFrame], float]:
    if column == "itl_ms":
        return lambda f: mean(itl_values(f))
    return lambda f: mean(f[column].to_numpy())


def _build_registry() -> dict[str, Metric]:
    reg: dict[str, Metric] = {}
    for base, col, label in (("ttft", "ttft_ms", "TTFT"), ("tpot", "tpot_ms", "TPOT"),
                             ("itl", "itl_ms", "ITL"), ("e2e", "e2e_ms", "E2E"),
                             ("lateness", "lateness_ms", "client lateness")):
        for qn, q in QUANTILES.items():
            reg[f"{base}_{qn}"] = Metric(f"{base}_{qn}", _quantile_metric(col, q), "ms", False,
                                         col, q, f"{label} {qn.replace('p999', 'p99.9')}")
        reg[f"{base}_mean"] = Metric(f"{base}_mean", _mean_metric(col), "ms", False, col, None,
                                     f"{label} mean")
    for name, fn, unit, hib, label in (
        ("throughput_rps", throughput_rps, "req/s", True, "throughput"),
        ("goodput_rps", goodput_rps, "req/s", True, "goodput at SLO"),
        ("input_tps", input_tps, "tok/s", True, "input tokens/s"),
        ("output_tps", output_tps, "tok/s", True, "output tokens/s"),
        ("error_rate", error_rate, "fraction", False, "error rate"),
        ("slo_attainment", slo_attainment, "fraction", True, "SLO attainment"),
        ("hit_ratio", hit_ratio, "fraction", True, "prefix hit ratio"),
    ):
        reg[name] = Metric(name, fn, unit, hib, label=label)
    return reg


METRIC_INFO: dict[str, Metric] = _build_registry()
# The registry the gate uses: name -> function(frame) -> float.
METRICS: dict[str, Callable[[pd.DataFrame], float]] = {k: m.fn for k, m in METRIC_INFO.items()}


def metric_name(name: str) -> str:
    """Canonical registry name (accepts ``ttft_p99.9`` for ``ttft_p999``, ``e2el_`` for
    vLLM's E2EL)."""
    key = name.strip().lower().replace("p99.9", "p999")
    if key.startswith("e2el_"):
        key = "e2e_" + key[len("e2el_"):]
    if key not in METRIC_INFO:
        from kvbench.core.errors import UserError

        raise UserError(f"unknown metric {name!r}; use one of {', '.join(sorted(METRIC_INFO))}")
    return key


def statistic(frame: pd.DataFrame, name: str) -> float:
    """The value of metric ``name`` (see ``METRICS``) on the rows of ``frame``."""
    return METRIC_INFO[metric_name(name)].fn(frame)


# --------------------------------------------------------------------------------------------
# bootstrap: every path yields replicates; intervals are their percentiles


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


def _clean(values) -> np.ndarray:
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
    v = _clean(values)
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
                    max_rows: int = 20_000) -> tuple[float, np.ndarray]:
    """Vectorised bootstrap replicates of the mean (blocks of resamples as one index matrix).

    Above ``max_rows`` it bootstraps a seeded subsample of ``max_rows`` and rescales the spread
    by sqrt(m / n) (m-out-of-n bootstrap; valid for the mean, which is root-n consistent)."""
    v = _clean(values)
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
                     rng: np.random.Generator, max_rows: int = 20_000
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


def index_replicates(frame: pd.DataFrame, fn: Callable[[pd.DataFrame], float], resamples: int,
                     rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """Generic (slow) bootstrap: resample requests with replacement, recompute ``fn``."""
    n = len(frame)
    est = fn(frame)
    if n == 0:
        return est, np.full(resamples, np.nan)
    return est, np.array([fn(frame.iloc[rng.integers(0, n, n)]) for _ in range(resamples)])


def _rate_replicates(frame: pd.DataFrame, m: Metric, resamples: int,
                     rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """Rates and ratios are sums over requests, resampled with the stage wall time fixed.

    A count of a yes/no per request resamples exactly as Binomial(n, k/n) (O(resamples));
    token sums and the hit ratio use ``mean_replicates``/``ratio_replicates``."""
    est = m.fn(frame)
    n = len(frame)
    if n == 0 or est != est:
        return est, np.full(resamples, np.nan)
    ok = frame["ok"].to_numpy()
    w = wall_s(frame)
    flags = {"throughput_rps": np.ones(n, bool), "goodput_rps": frame["slo_met"].to_numpy(),
             "error_rate": ~ok, "slo_attainment": frame["slo_met"].to_numpy()}
    if m.name in flags:
        k = int(flags[m.name].sum())
        draws = rng.binomial(n, k / n, size=resamples).astype(np.float64)
        return est, draws / w if m.name.endswith("_rps") else draws / n
    if m.name in ("input_tps", "output_tps"):
        col = "prompt_tokens" if m.name == "input_tps" else "completion_tokens"
        per_row = np.where(ok, np.nan_to_num(frame[col].to_numpy()), 0.0)
        _, reps = mean_replicates(per_row, resamples, rng)
        return est, reps * n / w
    if m.name == "hit_ratio":
        c = frame["cached_tokens"].to_numpy()
        p = frame["prompt_tokens"].to_numpy()
        rows = ok & ~np.isnan(c) & ~np.isnan(p)
        _, reps = ratio_replicates(c[rows], p[rows], resamples, rng)
        return est, reps
    return index_replicates(frame, m.fn, resamples, rng)


# ITL: a cluster bootstrap over requests. Gaps of one request share its load, batch and
# output length, so they are correlated; resampling gaps as if independent would give an
# interval several times too narrow. A replicate draws requests with replacement and pools
# the gaps of the drawn requests with multiplicity: per replicate a vector of request counts
# (multinomial weights), and the quantile of the weighted pooled gaps is found in one global
# sort plus a cumulative weight over a slab of the sorted gaps around the quantile.

ITL_MAX_REQUESTS = 20_000  # m-out-of-n above this many requests with gaps
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


def itl_replicates(frame: pd.DataFrame, q: float | None, resamples: int,
                   rng: np.random.Generator, max_requests: int = ITL_MAX_REQUESTS,
                   pooled: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """(estimate, cluster-bootstrap replicates) of the pooled-ITL q-quantile (mean if q None).

    Requests with gaps are resampled with replacement and each replicate pools the gaps of
    the drawn requests; above ``max_requests`` a seeded subsample of m requests is
    bootstrapped and the spread rescaled by sqrt(m / n) (m-out-of-n, as ``mean_replicates``),
    which assumes the quantile is root-n smooth. ``pooled``: the frame's pooled gaps, if
    already gathered (only used for the estimate)."""
    store = frame.attrs.get("itl")
    if store is None:
        itl_values(frame)  # raises the explanatory error
    rows = np.asarray(frame["itl_row"].to_numpy(), np.int64)
    lens = store.offsets[rows + 1] - store.offsets[rows]
    rows, lens = rows[lens > 0], lens[lens > 0]
    v = _clean(store.gather(rows) if pooled is None else pooled)
    if len(v) == 0:
        return math.nan, np.full(resamples, np.nan)
    est = quantile(v, q) if q is not None else mean(v)
    n = len(rows)
    m = min(n, max(int(max_requests), 1))
    if m < n:
        pick = np.sort(rng.choice(n, m, replace=False))
        rows, lens = rows[pick], lens[pick]
    vals = store.gather(rows)
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


def bootstrap_replicates(frame: pd.DataFrame, name: str, resamples: int = 1000,
                         seed: int = 0) -> tuple[float, np.ndarray]:
    """(estimate, seeded bootstrap replicates) of metric ``name`` over the requests of
    ``frame``: exact order-statistic draws for quantiles, vectorised resampling for means,
    binomial draws for counts, and for ITL a cluster bootstrap over requests
    (``itl_replicates``: the gaps of one request are not independent)."""
    m = METRIC_INFO[metric_name(name)]
    rng = np.random.default_rng(seed)
    if m.column is None:
        return _rate_replicates(frame, m, resamples, rng)
    if m.column == "itl_ms":
        return itl_replicates(frame, m.q, resamples, rng)
    values = column_values(frame, m.column)
    if m.q is not None:
        return quantile_replicates(values, m.q, resamples, rng)
    return mean_replicates(values, resamples, rng)


def bootstrap(frame: pd.DataFrame, name: str, resamples: int = 1000, confidence: float = 0.95,
              seed: int = 0) -> CI:
    """Seeded bootstrap percentile interval of metric ``name`` (see ``bootstrap_replicates``)."""
    return interval(*bootstrap_replicates(frame, name, resamples, seed), confidence)


def quantile_bootstrap(values: np.ndarray, q: float, resamples: int = 1000,
                       confidence: float = 0.95, seed: int = 0) -> CI:
    return interval(*quantile_replicates(values, q, resamples, np.random.default_rng(seed)),
                    confidence)


def column_values(frame: pd.DataFrame, column: str) -> np.ndarray:
    """The per-request (or, for ``itl_ms``, pooled per-gap) values a metric is taken over."""
    return itl_values(frame) if column == "itl_ms" else frame[column].to_numpy()


def evaluate(frame: pd.DataFrame, names: Iterable[str], ci: bool = False,
             resamples: int = 1000, confidence: float = 0.95,
             seed: int = 0) -> dict[str, float | CI]:
    """Several metrics at once, extracting each column (ITL pooled once) a single time.

    Same definitions and replicates as ``statistic``/``bootstrap``; CI tuples when ``ci``."""
    names = [metric_name(x) for x in names]
    by_col: dict[str, list[Metric]] = {}
    out: dict[str, float | CI] = {}
    for name in names:
        m = METRIC_INFO[name]
        if m.column is None:
            out[name] = (interval(*_rate_replicates(frame, m, resamples,
                                                    np.random.default_rng(seed)), confidence)
                         if ci else m.fn(frame))
        else:
            by_col.setdefault(m.column, []).append(m)
    for col, ms in by_col.items():
        v = _clean(column_values(frame, col))
        if ci:
            for m in ms:
                rng = np.random.default_rng(seed)
                if col == "itl_ms":
                    out[m.name] = interval(*itl_replicates(frame, m.q, resamples, rng,
                                                           pooled=v), confidence)
                    continue
                reps = (quantile_replicates(v, m.q, resamples, rng) if m.q is not None
                        else mean_replicates(v, resamples, rng))
                out[m.name] = interval(*reps, confidence)
            continue
        qs = [m for m in ms if m.q is not None]
        if qs:
            vals = np.quantile(v, [m.q for m in qs]) if len(v) else [math.nan] * len(qs)
            out.update({m.name: float(x) for m, x in zip(qs, vals)})
        for m in ms:
            if m.q is None:
                out[m.name] = float(v.mean(dtype=np.float64)) if len(v) else math.nan
    return {n: out[n] for n in names}


# --------------------------------------------------------------------------------------------
# group-bys

# Columns the registry's metrics read (besides the group keys).
METRIC_COLUMNS = ("ok", "slo_met", "stage_key", "stage_wall_s", "prompt_tokens",
                  "completion_tokens", "cached_tokens", "ttft_ms", "tpot_ms", "e2e_ms",
                  "lateness_ms", "itl_row")


def slim(frame: pd.DataFrame, keep: Iterable[str] = ()) -> pd.DataFrame:
    """Only the columns metrics need (plus ``keep``): cheaper to subset and group."""
    cols = list(dict.fromkeys([*keep, *METRIC_COLUMNS]))
    return frame[cols]


GROUP_KEYS = ("endpoint", "topology", "request_class", "stage", "prompt_bucket", "workload")


def summarise(frame: pd.DataFrame, by: Sequence[str] = ("endpoint",),
              metrics: Iterable[str] = ("throughput_rps", "goodput_rps", "ttft_p50", "ttft_p99",
                                        "tpot_p50", "e2e_p99", "error_rate"),
              min_rows: int = 1) -> pd.DataFrame:
    """One row per group of ``by`` with each metric as a column (groups in sorted order)."""
    names = [metric_name(m) for m in metrics]
    rows = []
    frame = slim(frame, by)
    for key, sub in frame.groupby(list(by), observed=True, sort=True):
        if len(sub) < min_rows:
            continue
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(by, key))
        row["requests"] = len(sub)
        row.update(evaluate(sub, names))
        rows.append(row)
    return pd.DataFrame(rows, columns=list(by) + ["requests"] + names)


def cdf_points(values: np.ndarray, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """(x, F(x)) for plotting a CDF without shipping raw points: quantiles at ``points``
    levels, or above 1M values a histogram on log-spaced bins (exact at the bin edges, O(n))."""
    v = _clean(values)
    if len(v) == 0:
        return np.zeros(0), np.zeros(0)
    if len(v) > 1_000_000:
        lo = max(float(v.min()), 1e-3)
        hi = max(float(v.max()), lo * 1.001)
        logs = np.log(np.maximum(v, lo, dtype=np.float32))
        counts, edges = np.histogram(logs, bins=points * 4, range=(math.log(lo),
                                                                   math.log(hi) + 1e-9))
        return np.exp(edges[1:]), np.cumsum(counts) / len(v)
    levels = np.concatenate([np.linspace(0, 0.99, points - 40, endpoint=False),
                             np.linspace(0.99, 1.0, 40)])
    return np.quantile(v, levels), levels
