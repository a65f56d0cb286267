"""Everything a report needs from one or more result directories, read once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import pyarrow as pa

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbench.core.errors import DataError
from kvbench.core.schema import TABLES
from kvbench.core.store import read_meta, read_shards, read_table
from kvbench.reports.metrics import FRAME_COLUMNS, GapStore, request_frame

BATCH_ROWS = 65_536  # requests per streamed batch when deriving ITL gaps


@dataclass
class _Run:
    path: Path
    meta: dict
    requests: pa.Table  # FRAME_COLUMNS only
    gaps: GapStore
    gpu: pa.Table
    engine: pa.Table


def _read_run(path: Path | str) -> _Run:
    """Like kvbench.store.load_results, but the requests' chunk lists are streamed in batches
    and turned into ITL gaps at once: 1M requests x 50 chunks never sit in memory twice."""
    run_dir = Path(path)
    meta = read_meta(run_dir)
    schema = TABLES["requests"]
    tables, gap_parts = [], []
    pfile = run_dir / "requests.parquet"
    if pfile.exists():
        from concurrent.futures import ThreadPoolExecutor

        pf = pq.ParquetFile(pfile)
        have = set(pf.schema_arrow.names)
        cols = [c for c in FRAME_COLUMNS if c in have]
        # Decoding and numpy both release the GIL: the scalar columns, the chunk batches and
        # their gaps are worked on at the same time (separate file handles per thread).
        with ThreadPoolExecutor(max_workers=2) as pool:
            scalar = pool.submit(lambda: pq.ParquetFile(pfile).read(columns=cols))
            futures = []
            if "chunk_offsets_ns" in have:
                for batch in pf.iter_batches(batch_size=BATCH_ROWS,
                                             columns=["chunk_offsets_ns", "status"]):
                    futures.append(pool.submit(_batch_gaps, batch))
            t = _conform(scalar.result(), schema)
            gap_parts.extend(f.result() for f in futures)
        tables.append(t)
        if "chunk_offsets_ns" not in have:
            gap_parts.append(GapStore(np.zeros(0, np.float32), np.zeros(t.num_rows + 1,
                                                                         np.int64)))
    live = read_shards(run_dir, "requests")
    if live.num_rows:
        ok = pc.fill_null(pc.equal(live.column("status"), "ok"), False).to_numpy(
            zero_copy_only=False)
        gap_parts.append(GapStore.from_offsets(live.column("chunk_offsets_ns"), keep=ok))
        tables.append(live.select(list(FRAME_COLUMNS)))
    requests = pa.concat_tables(tables) if tables else schema.empty_table().select(
        list(FRAME_COLUMNS))
    gaps = GapStore.concat(gap_parts) if gap_parts else GapStore(
        np.zeros(0, np.float32), np.zeros(1, np.int64))
    return _Run(run_dir, meta, requests, gaps, read_table(run_dir, "gpu"),
                read_table(run_dir, "engine"))


def _batch_gaps(batch: pa.RecordBatch) -> GapStore:
    ok = pc.fill_null(pc.equal(batch.column(1), "ok"), False).to_numpy(zero_copy_only=False)
    return GapStore.from_offsets(batch.column(0), keep=ok)


def _conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """The FRAME_COLUMNS of ``t`` with schema v1 types (missing columns as nulls)."""
    cols = []
    for name in FRAME_COLUMNS:
        typ = schema.field(name).type
        cols.append(t.column(name).cast(typ) if name in t.column_names
                    else pa.nulls(t.num_rows, typ))
    return pa.table(cols, names=list(FRAME_COLUMNS))


@dataclass
class ReportData:
    frame: pd.DataFrame  # reports.metrics.request_frame over every run
    runs: list[dict]  # run.json of each run (in the order given)
    paths: list[Path]
    gpu: pa.Table
    engine: pa.Table
    slo: dict[str, dict]  # class -> {ttft_ms, tpot_ms, e2e_ms}
    endpoints: dict[str, dict] = field(default_factory=dict)  # label -> run.json endpoint entry
    stages: list[dict] = field(default_factory=list)  # run.json stages, endpoint = label
    workloads: dict[str, dict] = field(default_factory=dict)  # name -> describe() dict
    # per endpoint and workload: describe() of the requests actually sent (run.json
    # workloads_sent), as rows {endpoint, workload, **describe}
    workloads_sent: list[dict] = field(default_factory=list)

    @property
    def endpoint_names(self) -> list[str]:
        return [str(c) for c in self.frame["endpoint"].cat.categories
                if (self.frame["endpoint"] == c).any()]


def _slo_dict(slo: Mapping) -> dict[str, dict]:
    out = {}
    for cls, cfg in (slo or {}).items():
        if hasattr(cfg, "model_dump"):
            cfg = cfg.model_dump()
        out[str(cls)] = {k: cfg.get(k) for k in ("ttft_ms", "tpot_ms", "e2e_ms")
                         if cfg.get(k) is not None}
    return out


def load(paths: Sequence[Path | str], slo: Mapping | None = None) -> ReportData:
    """Read the runs; endpoint names that repeat across runs become ``name@run_id``.

    ``slo``: {class: SLO}; None takes the ``slo`` tables of the runs' resolved configs."""
    results: list[_Run] = [_read_run(p) for p in paths]
    if not results:
        raise DataError("no results given; pass one or more results directories")
    names: dict[str, int] = {}
    for r in results:
        for ep in {str(x) for x in r.requests.column("endpoint").unique().to_pylist()}:
            names[ep] = names.get(ep, 0) + 1
    if slo is None:
        merged: dict = {}
        for r in results:
            merged.update((r.meta.get("config") or {}).get("slo") or {})
        slo = merged
    slo_d = _slo_dict(slo)
    frames, gpus, engines = [], [], []
    endpoints: dict[str, dict] = {}
    stages: list[dict] = []
    workloads: dict[str, dict] = {}
    sent: list[dict] = []
    for r in results:
        run_id = str(r.meta.get("run_id") or r.path.name)

        def label(name: str, run_id=run_id) -> str:
            return name if names.get(name, 0) <= 1 else f"{name}@{run_id}"

        run_stages = [dict(s) for s in r.meta.get("stages") or []]
        frames.append(request_frame(r.requests, stages=run_stages, slo=slo_d,
                                    endpoint_label=label, gaps=r.gaps))
        for s in run_stages:
            s["endpoint"] = label(str(s.get("endpoint")))
            stages.append(s)
        for ep in r.meta.get("endpoints") or []:
            if isinstance(ep, dict) and "name" in ep:
                endpoints[label(str(ep["name"]))] = {**ep, "run_id": run_id}
        for wname, desc in (r.meta.get("workloads") or {}).items():
            if isinstance(desc, dict):
                workloads.setdefault(wname, desc)
        for ep, per_wl in (r.meta.get("workloads_sent") or {}).items():
            for wname, desc in (per_wl or {}).items():
                if isinstance(desc, dict):
                    sent.append({**desc, "endpoint": label(str(ep)), "workload": wname})
        gpus.append(_relabel(r.gpu, label))
        engines.append(_relabel(r.engine, label))
    frame = concat(frames)
    return ReportData(frame=frame, runs=[r.meta for r in results],
                      paths=[r.path for r in results], gpu=pa.concat_tables(gpus),
                      engine=pa.concat_tables(engines), slo=slo_d, endpoints=endpoints,
                      stages=stages, workloads=workloads, workloads_sent=sent)


def _relabel(t: pa.Table, label) -> pa.Table:
    if t.num_rows == 0:
        return t
    i = t.schema.get_field_index("endpoint")
    col = t.column(i)
    uniq = {str(x) for x in col.unique().to_pylist() if x is not None}
    if all(label(u) == u for u in uniq):
        return t
    import pyarrow.compute as pc

    for u in uniq:
        col = pc.if_else(pc.equal(col, u), label(u), col)
    return t.set_column(i, "endpoint", col)


def concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Frames of several runs as one: categories unioned, stage keys and ITL rows kept apart."""
    if len(frames) == 1:
        return frames[0]
    from pandas.api.types import union_categoricals

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
