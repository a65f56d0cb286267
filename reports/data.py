"""Everything a report needs from one or more result directories, read once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import pyarrow as pa

from kvbench.errors import DataError
from kvbench.store import Results, load_results
from reports.metrics import request_frame


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
    results: list[Results] = [load_results(p) for p in paths]
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
    for r in results:
        run_id = str(r.meta.get("run_id") or r.path.name)

        def label(name: str, run_id=run_id) -> str:
            return name if names.get(name, 0) <= 1 else f"{name}@{run_id}"

        run_stages = [dict(s) for s in r.meta.get("stages") or []]
        frames.append(request_frame(r.requests, stages=run_stages, slo=slo_d,
                                    endpoint_label=label))
        for s in run_stages:
            s["endpoint"] = label(str(s.get("endpoint")))
            stages.append(s)
        for ep in r.meta.get("endpoints") or []:
            if isinstance(ep, dict) and "name" in ep:
                endpoints[label(str(ep["name"]))] = {**ep, "run_id": run_id}
        for wname, desc in (r.meta.get("workloads") or {}).items():
            if isinstance(desc, dict):
                workloads.setdefault(wname, desc)
        gpus.append(_relabel(r.tables["gpu"], label))
        engines.append(_relabel(r.tables["engine"], label))
    frame = _concat(frames)
    return ReportData(frame=frame, runs=[r.meta for r in results],
                      paths=[r.path for r in results], gpu=pa.concat_tables(gpus),
                      engine=pa.concat_tables(engines), slo=slo_d, endpoints=endpoints,
                      stages=stages, workloads=workloads)


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


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    if len(frames) == 1:
        return frames[0]
    from pandas.api.types import union_categoricals

    cat_cols = [c for c in frames[0].columns if isinstance(frames[0][c].dtype,
                                                           pd.CategoricalDtype)]
    # stage keys are per run: offset them so two runs' stages never collide
    offset = 0
    parts = []
    for f in frames:
        f = f.copy()
        f["stage_key"] = f["stage_key"] + offset
        offset = int(f["stage_key"].max()) + 1 if len(f) else offset
        parts.append(f)
    for c in cat_cols:
        if c == "prompt_bucket":
            continue
        u = union_categoricals([p[c].array for p in parts])
        for p in parts:
            p[c] = pd.Categorical(p[c].astype(object), categories=u.categories)
    return pd.concat(parts, ignore_index=True)
