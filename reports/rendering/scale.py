"""The report of runs too large to hold as a request frame (issue 34): over ``MAX_REQUESTS``
compacted requests (the gate's bound), nothing per request of the whole run is held.

Over 400 lines, kept whole: the sample, the exact figures and their placing in the context
are one contract (which figure is exact, which the sample's, and the report's words for it).

- The Summary (requests, cancelled, every rate, SLO attainment, error rate, hit ratio, the
  exact TTFT/TPOT/ITL/E2E/lateness percentiles, the means, per-GPU output and stage time) and
  the header's request counts are computed where the records lie: ``columnar.aggregate`` (the
  counts and the two-pass exact percentiles) and ``columnar.stage_figures`` (per stage the
  times its windows are made of and the token sums), then put together here with the request
  frame's own window rules (``stage_windows``, ``frame._stage_walls``' rules on per-stage
  extremes instead of rows). The percentiles and counts equal the in-memory path's to the last
  digit; a rate or mean may differ from it in the last bits of a float (a sum in another
  order), never in a printed digit (``tests/test_report_scale.py``).
- Every other section (the per-class, per-stage, per-prompt-length and error tables, the
  diagnosis, the rankings, the plots) is built by the in-memory path over a seeded uniform
  sample of about ``SAMPLE`` requests (drawn while the exact ITL pass reads the chunk lists:
  ``Sampler``), written into a temporary run beside the original's run.json and telemetry; the report says so at its top (``ctx["scale"]``), and each such
  table's counts are the sample's.
- No bootstrap interval in the exact Summary: resampling requests is what cannot be held, and
  the sample's intervals would describe the sample, not the run.

A run with a capacity search (short probes, each judged on its own requests) is reported in
memory as before whatever its size: its verdict needs every probe's requests.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

MAX_REQUESTS = 200_000  # above this many compacted requests a run is reported out of core
SAMPLE = 50_000  # requests in the sample the sections other than the Summary are built over
SAMPLE_SEED = 0


@dataclass(frozen=True)
class Scale:
    """A report out of core: ``n`` requests in all, ``m`` of them in the sample."""

    n: int
    m: int


def compacted_requests(run_dir: Path) -> int:
    """Requests in the run's compacted Parquet (its footers only)."""
    import pyarrow.parquet as pq

    from kvbench.reports.statistics.columnar import parquet_files

    return sum(pq.ParquetFile(f).metadata.num_rows for f, _ in parquet_files(run_dir))


def wanted(paths: Sequence[Path], limit: int | None = None) -> bool:
    """True when the runs are reported out of core: more than ``limit`` compacted requests
    in all, and none of them ran a capacity search."""
    from kvbench.core.store import read_meta

    limit = MAX_REQUESTS if limit is None else limit
    try:
        n = sum(compacted_requests(Path(p)) for p in paths)
    except Exception:  # a damaged file: the in-memory reader says so in one sentence
        return False
    if n <= limit:
        return False
    return not any(s.search is not None for p in paths for s in read_meta(Path(p)).stages)


class Sampler:
    """A seeded uniform sample of about ``limit`` of a run's ``n`` requests, drawn batch by
    batch as ``columnar.aggregate``'s first ITL pass reads them (``on_batch``): the chunk
    lists are decoded once for both. That pass reads only what ITL needs (``PASS``, the
    list among them), so the sample's other ``COLUMNS`` are read afterwards in large batches
    (``table``: a per-batch read of 30 scalar columns cost more than the list itself)."""

    # what the report reads of a request: the frame's columns, the request id (the record
    # checks, the server traces' join), the chunk offsets (ITL) and the server's request id
    COLUMNS = None  # set below from the frame's
    PASS = None  # those the ITL pass reads anyway: taken from its batches

    def __init__(self, limit: int, n: int, seed: int = SAMPLE_SEED):
        self.p = limit / max(n, 1)
        self.rng = np.random.default_rng(seed)
        self.parts: list = []
        self.rows: list[np.ndarray] = []  # the sampled rows' positions in the run
        self.n, self.m, self.seen = n, 0, 0

    def __call__(self, batch) -> None:
        import pyarrow as pa

        # one uniform draw per row in file order: the same rows whatever the batches' size
        rows = np.flatnonzero(self.rng.random(batch.num_rows) < self.p)
        if len(rows):
            self.parts.append(batch.select(self.PASS).take(pa.array(rows)))
            self.rows.append(rows + self.seen)
            self.m += len(rows)
        self.seen += batch.num_rows

    def table(self, run_dir: Path):
        """The sample as a table of the ``REQUESTS`` schema (columns not read: nulls); the
        columns the ITL pass did not read come from ``run_dir`` now, row for row."""
        import pyarrow as pa

        from kvbench.core.schema import REQUESTS
        from kvbench.reports.statistics.columnar import record_batches

        got = pa.Table.from_batches(self.parts) if self.parts else None
        self.parts = []
        rest = [c for c in self.COLUMNS if c not in self.PASS]
        if got is not None and rest:
            want = np.concatenate(self.rows)
            taken, start = [], 0
            for batch in record_batches(run_dir, rest):
                lo, hi = np.searchsorted(want, [start, start + batch.num_rows])
                if hi > lo:
                    taken.append(batch.take(pa.array(want[lo:hi] - start)))
                start += batch.num_rows
                if hi == len(want):
                    break
            more = pa.Table.from_batches(taken)
            for c in rest:
                got = got.append_column(c, more.column(c))
        cols = [got.column(f.name).cast(f.type) if got is not None and f.name in self.COLUMNS
                else pa.nulls(self.m, f.type) for f in REQUESTS]
        return pa.Table.from_arrays(cols, schema=REQUESTS)


def _sample_columns() -> list[str]:
    from kvbench.reports.measures.frame import FRAME_COLUMNS

    return list(dict.fromkeys([*FRAME_COLUMNS, "request_id", "chunk_offsets_ns",
                               "server_request_id"]))


def _pass_columns() -> list[str]:
    from kvbench.reports.statistics.columnar import itl_columns

    return [c for c in Sampler.COLUMNS if c in itl_columns()]


def sampled_copy(run_dir: Path, into: Path, sampler: Sampler) -> tuple[Path, int, int]:
    """A run folder at ``into`` holding ``run_dir``'s run.json and every table but the
    requests, whose ``requests.parquet`` is ``sampler``'s sample. (path, m, n)."""
    import pyarrow.parquet as pq

    run_dir = Path(run_dir)
    into.mkdir(parents=True)
    for entry in run_dir.iterdir():
        if entry.name.startswith("requests") or entry.name.startswith("report"):
            continue  # the records (the sample below), an older report
        if entry.is_dir():
            shutil.copytree(entry, into / entry.name)
        else:
            shutil.copy2(entry, into / entry.name)
    pq.write_table(sampler.table(run_dir), into / "requests.parquet", compression="zstd")
    return into, sampler.m, sampler.n


# --------------------------------------------------------------------------- exact figures

STAGE = ("endpoint", "workload", "stage")
# the figures drawn from the per-stage table (exact over every request): the others are the
# sample's and say so in their caption
EXACT_FIGURES = ("latency_vs_load", "goodput_vs_load")


def stage_windows(figs: pd.DataFrame, stages) -> pd.DataFrame:
    """Per (endpoint, workload, stage) of ``figs`` (``columnar.stage_figures``, summed over
    classes): ``wall``, ``achieved``, ``offered``, ``started`` in s, by the request frame's
    rules (``frame._stage_walls``: run.json's stage record first, the data's extremes else)."""
    from kvbench.core.contract import StageEntry

    g = figs.groupby(list(STAGE), dropna=False, sort=True).agg(
        first_sched=("first_sched", "min"), last_sched=("last_sched", "max"),
        last_end=("last_end", "max"), first_sent=("first_sent", "min"),
        last_done=("last_done", "max"), last_token=("last_token", "max")).reset_index()
    data_wall = (g["last_end"] - g["first_sched"]).to_numpy() / 1e9
    data_offered = (g["last_sched"] - g["first_sched"]).to_numpy() / 1e9
    with np.errstate(invalid="ignore"):
        achieved = (g["last_done"] - g["first_sent"]).to_numpy() / 1e9
        started = (g["last_token"] - g["first_sent"]).to_numpy() / 1e9
    g["achieved"] = np.where(np.isfinite(achieved) & (achieved > 0), achieved, np.nan)
    g["started"] = np.where(np.isfinite(started) & (started > 0), started, np.nan)
    pos = {}
    for i, (e, w, s) in enumerate(g[list(STAGE)].itertuples(index=False, name=None)):
        if s == s and s is not None:  # a record without a stage has no stage record
            pos[(str(e), str(w), int(s))] = i
    walls, offers = data_wall.copy(), data_offered.copy()
    for st in stages or ():
        if not isinstance(st, StageEntry):
            st = StageEntry.from_dict(st)
        try:
            k = (str(st.endpoint), str(st.workload), int(st.index))
            t0, t1 = int(st.t_start_ns), int(st.t_end_ns)
        except (ValueError, TypeError):
            continue
        i = pos.get(k)
        if i is None:
            continue
        offered = math.nan
        if st.pacing == "trace":
            if g["last_sched"].iat[i] > t0:
                offered = (g["last_sched"].iat[i] - t0) / 1e9
        elif st.rate_rps:
            offered = float(st.duration_s or (t1 - t0) / 1e9)
        elif not st.users:
            offered = data_offered[i]
        walls[i], offers[i] = (t1 - t0) / 1e9, offered
    g["wall"] = np.where(walls > 0, walls, np.nan)
    g["offered"] = np.where(offers > 0, offers, np.nan)
    return g


def _window(w: pd.DataFrame, col: str) -> float:
    total = np.nansum(w[col].to_numpy())
    return float(total) if total > 0 else math.nan


def _rate(count: float, window: float) -> float:
    return float(count) / window if window == window and window > 0 else math.nan


def endpoint_figures(agg_ep: pd.Series, figs: pd.DataFrame, windows: pd.DataFrame
                     ) -> dict[str, float]:
    """The Summary's metrics of one endpoint from its aggregates: ``agg_ep`` its row of the
    per-endpoint level of ``columnar.aggregate``, ``figs`` its ``stage_figures`` rows,
    ``windows`` its ``stage_windows``. The same definitions as ``statistics.metrics``'."""
    achieved = _window(windows, "achieved")
    finished = float(figs["finished"].sum())
    met, judged = float(agg_ep["met"]), float(agg_ep["judged"])
    has_slo = float(figs["has_slo"].sum()) > 0
    hit_prompt = float(figs["hit_prompt_tokens"].sum())
    out = {
        "offered_rps": _rate(agg_ep["requests"], _window(windows, "offered")),
        "throughput_rps": _rate(finished, achieved),
        "started_rps": _rate(agg_ep["ok"], _window(windows, "started")),
        "goodput_rps": _rate(met, achieved) if has_slo else math.nan,
        "slo_attainment": met / judged if judged else math.nan,
        "output_tps": _rate(np.nansum(figs["ok_completion_tokens"]), achieved),
        "input_tps": _rate(np.nansum(figs["ok_prompt_tokens"]), achieved),
        "error_rate": float(agg_ep["errors"]) / finished if finished else math.nan,
        "hit_ratio": (float(np.nansum(figs["hit_cached_tokens"])) / hit_prompt
                      if hit_prompt > 0 else math.nan),
        "wall_s": _window(windows, "wall"),
    }
    for m in ("ttft", "tpot", "itl", "e2e", "lateness", "ttft_intended", "e2e_intended"):
        for p in ("p50", "p90", "p99", "p999"):
            out[f"{m}_{p}"] = float(agg_ep.get(f"{m}_{p}", math.nan))
    for m in ("ttft", "tpot", "e2e", "lateness", "ttft_intended", "e2e_intended"):
        n = float(figs[f"{m}_count"].sum())
        out[f"{m}_mean"] = float(figs[f"{m}_sum"].sum()) / n if n else math.nan
    return out


@dataclass
class Exact:
    """The figures over every request: per endpoint label (``endpoint_figures`` and outcome
    counts), and per (endpoint, workload, stage) the rows of ``overload.rates`` (``rates``)
    and of ``tables.stage_table``'s figures (``stages``)."""

    endpoints: dict[str, dict]
    rates: pd.DataFrame
    stages: pd.DataFrame


def exact_figures(paths: Sequence[Path], labels: Sequence, slo,
                  samplers: Sequence[Sampler | None] | None = None) -> Exact:
    """``Exact`` of the runs in ``paths`` (``labels[i]``: run i's endpoint name -> label),
    from ``columnar.aggregate`` and ``columnar.stage_figures``: two scans of the scalar
    columns, two of the chunk lists, nothing per request held; ``samplers[i]`` draws its
    sample of run i in the first of those."""
    from kvbench.core.store import read_meta
    from kvbench.reports.analysis import overload as O
    from kvbench.reports.rendering.tables import STAGE_METRICS
    from kvbench.reports.statistics import columnar as C

    q = {"p50": 0.50, "p90": 0.90, "p99": 0.99, "p999": 0.999}
    eps: dict[str, dict] = {}
    rates, stages = [], []
    for i, (path, label) in enumerate(zip(paths, labels)):
        meta = read_meta(Path(path))
        sampler = samplers[i] if samplers else None
        agg = C.aggregate(path, slo, quantiles=q, levels={
            "by_endpoint": ("endpoint",), "by_stage_only": STAGE}, on_batch=sampler,
            batch_columns=sampler.PASS if sampler else (), base=False)
        figs = C.stage_figures(path, slo)
        windows = stage_windows(figs, meta.stages)
        ep_of = figs["endpoint"].astype(str)
        for row in agg.extra["by_endpoint"].to_dict("records"):
            ep = str(row["endpoint"])
            got = endpoint_figures(pd.Series(row), figs[ep_of == ep],
                                   windows[windows["endpoint"].astype(str) == ep])
            got.update({"requests": int(row["requests"]), "ok": int(row["ok"]),
                        "errors": int(row["errors"]), "cancelled": int(row["cancelled"]),
                        "no_slo": not float(figs[ep_of == ep]["has_slo"].sum()) > 0})
            eps[label(ep)] = got
        win = {k: i for i, k in enumerate(windows[list(STAGE)].astype(str).itertuples(
            index=False, name=None))}
        fig_key = figs[list(STAGE)].astype(str).apply(tuple, axis=1)
        for row in agg.extra["by_stage_only"].to_dict("records"):
            if row["stage"] is None or row["stage"] != row["stage"]:
                continue  # a record outside any stage: in no stage's row
            k = (str(row["endpoint"]), str(row["workload"]), str(row["stage"]))
            w = windows.iloc[[win[k]]]
            mine = figs[fig_key == k]
            got = endpoint_figures(pd.Series(row), mine, w)
            keys = {"endpoint": label(str(row["endpoint"])), "workload": str(row["workload"]),
                    "stage": int(row["stage"])}
            n_slo = int(mine["has_slo"].sum())
            rates.append(O.stage_row(
                keys, int(row["requests"]), int(mine["finished"].sum()), int(row["ok"]),
                int(row["met"]), n_slo, int(row["cancelled"]), float(w["achieved"].iat[0]),
                float(w["offered"].iat[0]), float(w["started"].iat[0])))
            stages.append({**keys, "requests": int(row["requests"]),
                           **{m: got[m] for m in STAGE_METRICS}, "_no_slo": n_slo == 0})
    by = ["endpoint", "workload", "stage"]
    rates_f = pd.DataFrame(rates, columns=by + list(O.COLUMNS))
    stages_f = pd.DataFrame(stages, columns=by + ["requests", *STAGE_METRICS, "_no_slo"])
    return Exact(eps, rates_f.sort_values(by, kind="stable").reset_index(drop=True),
                 stages_f.sort_values(by, kind="stable").reset_index(drop=True))


def ordered_like(t: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """``t``'s (endpoint, workload, stage) rows in the order a group-by of ``frame`` gives
    them (its categories' order, as the in-memory tables are sorted)."""
    if t.empty:
        return t
    rank = {}
    for c in ("endpoint", "workload"):
        cats = [str(x) for x in frame[c].cat.categories] if len(frame) else []
        pos = {x: i for i, x in enumerate(cats)}
        rank[c] = t[c].astype(str).map(lambda x, pos=pos: pos.get(x, len(pos)))
    order = np.lexsort((t["stage"].to_numpy(), rank["workload"].to_numpy(),
                        rank["endpoint"].to_numpy()))
    return t.iloc[order].reset_index(drop=True)


def scale_windows(d, fractions: dict[str, float]) -> None:
    """The sample's stage intervals times its fraction of the run (``fractions``: per run id),
    so that every rate the sampled frame gives (per class, per prompt length, the plots'
    points) estimates the whole run's: a sample's count over the interval it spans is that
    fraction of the run's."""
    if not fractions or not len(d.frame):
        return
    run_of = d.endpoint_runs
    ep = d.frame["endpoint"].astype(str).to_numpy()
    factor = np.ones(len(ep))
    for label in set(ep.tolist()):
        factor[ep == label] = fractions.get(run_of.get(label, ""), 1.0)
    for col in ("stage_wall_s", "stage_achieved_s", "stage_offered_s", "stage_started_s"):
        d.frame[col] = d.frame[col].to_numpy() * factor


def apply(ctx: dict, d, exact: Exact, scale: Scale) -> dict:
    """``ctx`` (``build_context`` over the sample) with the exact figures put in: the header's
    request count, the outcomes, the cancelled, and the Summary's rows (no intervals); the
    Summary's other rows (the overload flags, the engine counters) are the sample's stages'
    and the engine's, as they were. ``ctx["scale"]`` tells the templates."""
    from kvbench.reports.analysis import pareto as P
    from kvbench.reports.rendering.cells import SLO_METRICS, metric_row
    from kvbench.reports.rendering.context import SUMMARY_METRICS
    from kvbench.reports.statistics import metrics as M

    exact = exact.endpoints
    ctx["n_requests"] = sum(e["requests"] for e in exact.values())
    ctx["outcomes"] = {ep: {k: e[k] for k in ("requests", "ok", "errors", "cancelled")}
                       for ep, e in exact.items()}
    ctx["cancelled"] = [{"endpoint": ep, "n": e["cancelled"],
                         "text": f"{e['cancelled']:,} cancelled at the stop"}
                        for ep, e in exact.items() if e["cancelled"]]
    for t in ctx["summaries"]:
        if t["key"] != "stages":
            continue
        cols = t["columns"]
        ex = [exact.get(ep, {}) for ep in cols]
        no_slo = [bool(e.get("no_slo", True)) for e in ex]
        rows = {"requests": metric_row("requests", "count",
                                       [e.get("requests", 0) for e in ex], None)}
        cancelled = [e.get("cancelled", 0) for e in ex]
        if any(cancelled):
            rows["cancelled at the stop (not errors)"] = metric_row(
                "cancelled at the stop (not errors)", "count", cancelled, None)
        for name in SUMMARY_METRICS:
            info = M.METRIC_INFO[name]
            rows[info.label] = metric_row(
                info.label, info.unit, [e.get(name, math.nan) for e in ex],
                None if name in ("offered_rps", "started_rps") else info.higher_is_better,
                None, no_slo=no_slo if name in SLO_METRICS else None)
        figs = [P.endpoint_figures_of(_positive(e.get("output_tps", math.nan)), d.endpoint(ep))
                for ep, e in zip(cols, ex)]
        rows["output tokens/s per GPU"] = metric_row(
            "output tokens/s per GPU", "tok/s", [f["tps_per_gpu"] for f in figs], True)
        cost = [r for r in t["rows"] if r["label"].startswith("cost per million output")]
        if cost:
            rows[cost[0]["label"]] = metric_row(cost[0]["label"], "$",
                                                [f["cost_per_m"] for f in figs], False)
        rows["stage wall time"] = metric_row("stage wall time", "s",
                                             [e.get("wall_s", math.nan) for e in ex], None)
        out, used = [], set()
        for r in t["rows"]:
            if r["label"] == "requests" and "cancelled at the stop (not errors)" in rows:
                out += [rows["requests"], rows["cancelled at the stop (not errors)"]]
                used |= {"requests", "cancelled at the stop (not errors)"}
                continue
            if r["label"] in used:
                continue
            out.append(rows.get(r["label"], r))
            used.add(r["label"])
        t["rows"] = out
        t["note"] = ((t["note"] + " ") if t["note"] else "") + (
            f"Exact over all {ctx['n_requests']:,} requests, computed out of core (no "
            "bootstrap intervals at this size).")
    ctx["summary"] = ctx["summaries"][0]["rows"] if ctx["summaries"] else []
    for f in ctx.get("figures") or []:  # every figure but the per-stage ones: the sample's
        if f["key"] in EXACT_FIGURES:
            continue
        said = (f"Of a seeded uniform sample of {scale.m:,} of the {scale.n:,} requests"
                " (rates scaled to the whole run).")
        f["note"] = (f["note"] + " " + said) if f["note"] else said
    ctx["scale"] = {"n": scale.n, "m": scale.m,
                    "text": f"{scale.n:,} requests: the Summary's counts, rates and "
                            "percentiles and the per-stage table are exact over every request "
                            "(computed out of core); the other tables, the plots and the diagnosis are of a seeded "
                            f"uniform sample of {scale.m:,} requests (their counts are the "
                            "sample's; their rates are scaled to the whole run)."}
    return ctx


def _positive(x: float) -> float:
    return x if x > 0 else math.nan  # ``pareto.output_tps``: no output is no figure


Sampler.COLUMNS = _sample_columns()
Sampler.PASS = _pass_columns()
