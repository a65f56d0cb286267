"""Everything a report needs from one or more result directories, read once through the
results store (``kvbench.core.store.scan``)."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.core import checks
from kvbench.core.contract import SLO, EndpointEntry, StageEntry, slo_map
from kvbench.core.errors import DataError
from kvbench.core.store import RunMeta, align_worker_clocks, read_meta, read_table, scan
from kvbench.reports.measures.frame import FRAME_COLUMNS, GapStore, concat, request_frame

BATCH_ROWS = 65_536  # requests per streamed batch when deriving ITL gaps
# the scalar columns read: the frame's, and the request id the record checks need
_SCALARS = (*FRAME_COLUMNS, "request_id")
_CHUNKED = ("chunk_offsets_ns", "status", "ttft_ns")  # what the gaps and chunk checks read


@dataclass
class _Run:
    path: Path
    meta: RunMeta
    requests: pa.Table  # FRAME_COLUMNS only
    gaps: GapStore
    gpu: pa.Table
    engine: pa.Table


def _read_run(path: Path | str) -> _Run:
    """One run through the store's reader. The requests' chunk lists are streamed in batches
    and turned into ITL gaps at once, so 1M requests x 50 chunks never sit in memory twice.

    The compacted parquet is immutable: its scalar columns are read while its chunk batches
    decode and a worker turns them into gaps (decoding and numpy release the GIL). Live shards
    may grow while they are read, so they are read in one pass for both.

    Records that cannot be true are a ``DataError`` (``core.checks``): the chunk checks run on
    each batch beside its gaps, the others on the scalar columns."""
    run_dir = Path(path)
    meta = read_meta(run_dir)
    problems: list[checks.Problems] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        scalar = pool.submit(read_table, run_dir, "requests", _SCALARS, shards=False,
                             strict=True)
        gaps = _stream_gaps(scan(run_dir, "requests", columns=_CHUNKED,
                                 batch_size=BATCH_ROWS, shards=False, strict=True), pool, [],
                            problems)
        tables = [scalar.result()]
        live: list[pa.RecordBatch] = []
        gaps = _stream_gaps(_keep_scalars(scan(
            run_dir, "requests", columns=(*_SCALARS, "chunk_offsets_ns"),
            batch_size=BATCH_ROWS, parquet=False, strict=True), live), pool, gaps, problems)
    if live:
        tables.append(pa.Table.from_batches(live))
    store = GapStore.concat(gaps) if gaps else GapStore(np.zeros(0, np.float32),
                                                        np.zeros(1, np.int64))
    scalars = pa.concat_tables(tables)
    checks.raise_problems(checks.merge([checks.scalar_problems(scalars), *problems]),
                          checks.records_source(run_dir))
    requests = align_worker_clocks(scalars.drop_columns(["request_id"]),
                                   meta.worker_clock_offsets_ns)
    return _Run(run_dir, meta, requests, store,
                read_table(run_dir, "gpu", strict=True), read_table(run_dir, "engine", strict=True))


_MAX_PENDING = 4  # batches of chunk lists waiting for a gap worker (bounds memory)


def _keep_scalars(batches, scalars: list):
    """Yield each batch's (chunk_offsets_ns, status, ttft_ns), keeping its other columns in
    ``scalars``."""
    for batch in batches:
        scalars.append(batch.drop_columns(["chunk_offsets_ns"]))
        yield batch.select(list(_CHUNKED))


def _stream_gaps(batches, pool: ThreadPoolExecutor, done: list,
                 problems: list) -> list[GapStore]:
    """``done`` plus the gaps of each (chunk_offsets_ns, status, ttft_ns) batch, computed in
    ``pool`` while the next batch decodes; each batch's impossible chunks go to ``problems``."""
    pending: deque = deque()

    def take(future) -> None:
        store, found = future.result()
        done.append(store)
        problems.append(found)

    for batch in batches:
        pending.append(pool.submit(_batch_gaps, batch.column(0), batch.column(1),
                                   batch.column(2)))
        while len(pending) > _MAX_PENDING:
            take(pending.popleft())
    for f in pending:
        take(f)
    return done


def _batch_gaps(offsets: pa.Array, status: pa.Array, ttft: pa.Array
                ) -> tuple[GapStore, checks.Problems]:
    found = checks.chunk_problems(offsets, status, ttft)
    return (GapStore.itl(pa.record_batch([offsets, status], ["chunk_offsets_ns", "status"])),
            found)


@dataclass
class ReportData:
    frame: pd.DataFrame  # reports.frame.request_frame over every run
    runs: list[RunMeta]  # run.json of each run (in the order given)
    paths: list[Path]
    gpu: pa.Table
    engine: pa.Table
    slo: dict[str, SLO]  # by request class
    endpoints: dict[str, EndpointEntry] = field(default_factory=dict)  # by label
    endpoint_runs: dict[str, str] = field(default_factory=dict)  # label -> run_id it ran in
    stages: list[StageEntry] = field(default_factory=list)  # run.json stages, endpoint = label
    workloads: dict[str, dict] = field(default_factory=dict)  # name -> describe() dict
    # per endpoint and workload: describe() of the requests actually sent (run.json
    # workloads_sent), as rows {endpoint, workload, **describe}
    workloads_sent: list[dict] = field(default_factory=list)

    @property
    def endpoint_names(self) -> list[str]:
        return [str(c) for c in self.frame["endpoint"].cat.categories
                if (self.frame["endpoint"] == c).any()]

    def endpoint(self, ep: str) -> EndpointEntry:
        """Endpoint label ``ep``'s run.json entry; a blank one (every field unknown) where its
        run did not record it."""
        return self.endpoints.get(ep) or EndpointEntry(name=ep)

    def declared_hardware(self, ep: str) -> bool:
        """True when the config declares endpoint ``ep``'s hardware: a built-in endpoint
        (run.json ``kind == "builtin"``), whose constants the cost model describes; a real
        server (``openai``) runs on hardware kvbench does not know."""
        return self.endpoint(ep).kind == "builtin"


def _slo(slo: Mapping) -> dict[str, SLO]:
    """``{class: SLO}`` of the SLOs given: contract ``SLO``s, or bench.toml's validated
    ``[slo.*]`` models (``--slo-config``)."""
    return slo_map({cls: cfg.model_dump() if hasattr(cfg, "model_dump") else cfg
                    for cls, cfg in (slo or {}).items()})


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
            merged.update(r.meta.slo)
        slo = merged
    slo_d = _slo(slo)
    frames, gpus, engines = [], [], []
    endpoints: dict[str, EndpointEntry] = {}
    endpoint_runs: dict[str, str] = {}
    stages: list[StageEntry] = []
    workloads: dict[str, dict] = {}
    sent: list[dict] = []
    for r in results:
        run_id = str(r.meta.run_id or r.path.name)

        def label(name: str, run_id=run_id) -> str:
            return name if names.get(name, 0) <= 1 else f"{name}@{run_id}"

        frames.append(request_frame(r.requests, stages=r.meta.stages, slo=slo_d,
                                    endpoint_label=label, gaps=r.gaps))
        stages.extend(s.replace(endpoint=label(str(s.endpoint))) for s in r.meta.stages)
        for ep in r.meta.endpoints:
            if ep.name:
                endpoints[label(ep.name)] = ep
                endpoint_runs[label(ep.name)] = run_id
        for wname, desc in r.meta.workloads.items():
            if isinstance(desc, dict):
                workloads.setdefault(wname, desc)
        for ep, per_wl in (r.meta.workloads_sent or {}).items():
            for wname, desc in (per_wl or {}).items():
                if isinstance(desc, dict):
                    sent.append({**desc, "endpoint": label(str(ep)), "workload": wname})
        gpus.append(_relabel(r.gpu, label))
        engines.append(_relabel(r.engine, label))
    frame = concat(frames)
    return ReportData(frame=frame, runs=[r.meta for r in results],
                      paths=[r.path for r in results], gpu=pa.concat_tables(gpus),
                      engine=pa.concat_tables(engines), slo=slo_d, endpoints=endpoints,
                      endpoint_runs=endpoint_runs, stages=stages, workloads=workloads,
                      workloads_sent=sent)


def _relabel(t: pa.Table, label) -> pa.Table:
    if t.num_rows == 0:
        return t
    i = t.schema.get_field_index("endpoint")
    col = t.column(i)
    uniq = {str(x) for x in col.unique().to_pylist() if x is not None}
    if all(label(u) == u for u in uniq):
        return t
    for u in uniq:
        col = pc.if_else(pc.equal(col, u), label(u), col)
    return t.set_column(i, "endpoint", col)
