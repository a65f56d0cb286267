"""The out-of-core aggregates (reports.statistics.columnar, on DuckDB) equal the in-memory
request frame's: counts to the last digit, exact percentiles to float rounding, numpy's linear
percentile as the reference. Fixture runs from tests/synthetic.py, and hypothesis-made record
sets with nulls, errors, cancelled requests, empty and single-chunk lists."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbench.core.schema import REQUESTS
from kvbench.core.shards import ShardWriter
from kvbench.reports.measures import data
from kvbench.reports.statistics import columnar as C
from kvbench.reports.statistics import columnar_select as S
from kvbench.reports.statistics import metrics as M
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

pytest.importorskip("duckdb")

NAMES = [f"{m}_{p}" for m in C.LATENCIES for p in C.QUANTILES]


def _frame_counts(frame, keys):
    """The report's counts per group: ``outcomes`` and the flags the goodput metrics read."""
    rows = {}
    for key, sub in frame.groupby(list(keys), observed=True, sort=True):
        o = M.outcomes(sub)
        failed = M.failed(sub)
        row = {"requests": o["requests"], "ok": o["ok"], "errors": o["errors"],
               "cancelled": o["cancelled"], "judged": int(M.judged(sub).sum()),
               "met": int(M.met_slo(sub).sum())}
        status = sub["status"].astype(object).to_numpy()
        for s in C.ERROR_STATUSES:
            row[f"errors_{s}"] = int((failed & (status == s)).sum())
        rows[key if isinstance(key, tuple) else (key,)] = row
    return rows


def assert_same(run_dir: Path, **kw) -> C.Aggregates:
    agg = C.aggregate(run_dir, **kw)
    frame = data.load([run_dir]).frame
    for keys, got in ((C.STAGE_KEYS, agg.by_stage), (C.WORKLOAD_KEYS, agg.by_workload)):
        want = M.summarise(frame, by=keys, metrics=NAMES)
        counts = _frame_counts(frame, keys)
        assert len(got) == len(want) == len(counts)
        at = {tuple(r): i for i, r in enumerate(got[list(keys)].itertuples(index=False,
                                                                            name=None))}
        for _, row in want.iterrows():
            key = tuple(row[k] for k in keys)
            i = at[key]
            for c, v in counts[key].items():
                assert int(got.loc[i, c]) == v, (key, c)
            for n in NAMES:
                a, b = float(got.loc[i, n]), float(row[n])
                if math.isnan(b):
                    assert math.isnan(a), (key, n)
                else:
                    assert a == pytest.approx(b, rel=1e-12, abs=0), (key, n)
    return agg


def test_synthetic_run_matches_the_request_frame(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("a", error_rate=0.1, cancel_rate=0.05),
                                EndpointShape("b", "disaggregated")],
                     requests_per_stage=400, stage_rates_rps=(5.0, 10.0), max_chunks=30)
    table, stages = synth_table(shape)
    write_run(tmp_path, table, run_meta(shape, stages))
    agg = assert_same(tmp_path, settings=C.Settings(memory_limit="200MB", threads=1))
    assert agg.by_workload["requests"].sum() == table.num_rows
    assert (agg.by_workload["itl_n"] > 1000).all()


def test_numpy_linear_is_the_reference(tmp_path):
    """Against numpy over the exact values, not only against the frame."""
    shape = RunShape(requests_per_stage=300, max_chunks=20)
    table, stages = synth_table(shape)
    write_run(tmp_path, table, run_meta(shape, stages))
    agg = C.aggregate(tmp_path)
    ok = np.array(table.column("status").to_pylist()) == "ok"
    ttft = np.array(table.column("ttft_ns").to_pylist(), dtype=float)[ok] / 1e6
    gaps = np.concatenate([np.diff(np.asarray(x, np.int64)) for x, k in
                           zip(table.column("chunk_offsets_ns").to_pylist(), ok) if k])
    row = agg.by_workload.iloc[0]
    for p, q in C.QUANTILES.items():
        assert row[f"ttft_{p}"] == float(np.quantile(ttft, [q])[0])
        want = float(np.quantile((gaps / 1e6).astype(np.float32), [q])[0])
        assert row[f"itl_{p}"] == want
        # and the float32 ms the report stores is within its rounding of the exact gaps
        assert row[f"itl_{p}"] == pytest.approx(np.quantile(gaps / 1e6, q), rel=1e-6)


def test_linear_reproduces_numpy():
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 7, 1000):
        for dtype in (np.float64, np.float32):
            v = np.sort(rng.gamma(2.0, 10.0, n).astype(dtype))
            qs = [0.5, 0.9, 0.95, 0.99, 0.0, 1.0]
            want = np.quantile(v, qs)
            for q, w in zip(qs, want):
                index = (n - 1) * np.asarray([q], np.float64)
                k = min(int(np.floor(index[0])), n - 1)
                got = C.linear(v[k:k + 1], v[min(k + 1, n - 1):min(k + 1, n - 1) + 1], index)
                assert float(got[0]) == float(w)


# --------------------------------------------------------------------------- hypothesis

EPOCH = 1_780_000_000 * 10**9
SLO = {"chat": {"ttft_ms": 5.0, "tpot_ms": 1.0}, "rag": {"e2e_ms": 20.0}}


@st.composite
def record(draw, i: int):
    status = draw(st.sampled_from(["ok", "ok", "ok", "http_error", "timeout", "cancelled"]))
    offsets = sorted(draw(st.lists(st.integers(0, 30_000_000), max_size=6)))
    ttft = offsets[0] if offsets else draw(st.none() | st.integers(0, 30_000_000))
    if status != "ok" and draw(st.booleans()):
        ttft = None
    last = offsets[-1] if offsets else (ttft or 0)
    e2e = draw(st.none() | st.integers(last, last + 5_000_000)) if status != "ok" else (
        last + draw(st.integers(0, 1000)))
    if ttft is not None and e2e is not None and e2e < ttft:
        e2e = ttft
    sched = EPOCH + draw(st.integers(0, 10**10))
    return {"run_id": "h", "endpoint": draw(st.sampled_from(["a", "b"])),
            "workload": draw(st.sampled_from(["w1", "w2"])),
            "request_class": draw(st.sampled_from(["chat", "rag", "agent"])),
            "stage": draw(st.integers(0, 1)), "request_id": f"r{i}", "worker": "h:1",
            "status": status, "t_scheduled": sched, "t_sent": sched + draw(st.integers(0, 9)),
            "ttft_ns": ttft, "e2e_ns": e2e, "chunk_offsets_ns": offsets,
            "completion_tokens": draw(st.none() | st.integers(0, 8)),
            "completion_tokens_client": draw(st.none() | st.integers(0, 8)),
            "prompt_tokens": draw(st.none() | st.integers(1, 100))}


@st.composite
def records(draw):
    n = draw(st.integers(1, 40))
    return [draw(record(i)) for i in range(n)]


def _write(run_dir: Path, rows: list[dict], shard_rows: int = 0, layout: int = 2) -> None:
    """A run from ``rows``: the first compacted (``layout`` 2: the Hive-partitioned dataset;
    1: an older run's requests.parquet), the last ``shard_rows`` in a live Arrow shard (a run
    still being written, or never compacted)."""
    table = pa.Table.from_pylist([{**dict.fromkeys(REQUESTS.names), **r} for r in rows],
                                 schema=REQUESTS)
    cut = table.num_rows - shard_rows
    shape = RunShape(endpoints=[EndpointShape("a"), EndpointShape("b")])
    write_run(run_dir, table.slice(0, cut), run_meta(shape, [], config={"slo": SLO}),
              layout=layout)
    if shard_rows:
        w = ShardWriter(run_dir, "requests", tag="t")
        for b in table.slice(cut).to_batches():
            w.write(b)
        w.close()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(rows=records(), shard=st.integers(0, 5), layout=st.sampled_from([1, 2]))
def test_generated_records_match_the_request_frame(tmp_path_factory, rows, shard, layout):
    run_dir = tmp_path_factory.mktemp("run")
    _write(run_dir, rows, min(shard, len(rows) - 1), layout=layout)
    assert_same(run_dir)


def test_only_shards_and_an_old_parquet(tmp_path):
    """A run with no compacted parquet, and one whose parquet lacks a column, read through the
    store's reader."""
    rows = [{"run_id": "h", "endpoint": "a", "workload": "w", "request_class": "chat",
             "stage": 0, "request_id": f"r{i}", "worker": "h:1", "status": "ok",
             "t_scheduled": EPOCH + i, "t_sent": EPOCH + i, "ttft_ns": 10**6 * (i + 1),
             "e2e_ns": 10**7 * (i + 1), "chunk_offsets_ns": [10**6 * (i + 1), 10**7 * (i + 1)],
             "completion_tokens": 3} for i in range(5)]
    _write(tmp_path / "shards", rows, shard_rows=5, layout=1)
    (tmp_path / "shards" / "requests.parquet").unlink()
    agg = assert_same(tmp_path / "shards")
    assert agg.by_workload["requests"].tolist() == [5]
    old = tmp_path / "old"
    _write(old, rows, layout=1)
    pq.write_table(pq.read_table(old / "requests.parquet").drop_columns(["cached_tokens",
                                                                         "prompt_tokens"]),
                   old / "requests.parquet")
    assert_same(old)


def test_the_engine_downloads_nothing():
    import duckdb

    con = C.connect(C.Settings(), "/tmp")
    try:
        got = dict(con.execute("SELECT name, value FROM duckdb_settings() WHERE name IN "
                               "('autoinstall_known_extensions', 'autoload_known_extensions', "
                               "'threads', 'memory_limit')").fetchall())
    finally:
        con.close()
    assert got["autoinstall_known_extensions"] == "false"
    assert got["autoload_known_extensions"] == "false"
    assert got["threads"] == "2"
    assert duckdb.__version__


def test_a_hive_partitioned_requests_dataset_reads_the_same(tmp_path):
    """The layout runs are moving to: ``requests/endpoint=<e>/workload=<w>/part-<n>.parquet``
    (the partition keys only in the path) gives the figures of the single file."""
    shape = RunShape(endpoints=[EndpointShape("a", error_rate=0.1), EndpointShape("b")],
                     requests_per_stage=200, stage_rates_rps=(5.0, 10.0), max_chunks=20)
    table, stages = synth_table(shape)
    single = write_run(tmp_path / "single", table, run_meta(shape, stages), layout=1)
    want = C.aggregate(single)
    hive = write_run(tmp_path / "hive", table, run_meta(shape, stages), layout=1)
    (hive / "requests.parquet").unlink()
    import pyarrow.compute as pc

    for e in pc.unique(table.column("endpoint")).to_pylist():
        for w in pc.unique(table.column("workload")).to_pylist():
            part = table.filter(pc.and_(pc.equal(table.column("endpoint"), e),
                                        pc.equal(table.column("workload"), w)))
            if part.num_rows:
                d = hive / "requests" / f"endpoint={e}" / f"workload={w}"
                d.mkdir(parents=True)
                half = part.num_rows // 2
                pq.write_table(part.slice(0, half).drop_columns(["endpoint", "workload"]),
                               d / "part-0.parquet")
                pq.write_table(part.slice(half).drop_columns(["endpoint", "workload"]),
                               d / "part-1.parquet")
    files = C.parquet_files(hive)
    assert len(files) == 2 * len(got_keys := {tuple(k.values()) for _, k in files})
    assert all(f.is_relative_to(hive / "requests") and set(k) == {"endpoint", "workload"}
               for f, k in files)
    got = C.aggregate(hive)
    for lvl in ("by_stage", "by_workload"):
        a, b = getattr(want, lvl), getattr(got, lvl)
        keys = list(C.STAGE_KEYS if lvl == "by_stage" else C.WORKLOAD_KEYS)
        a, b = a.sort_values(keys).reset_index(drop=True), b.sort_values(keys).reset_index(
            drop=True)
        assert a.drop(columns=keys).equals(b.drop(columns=keys)), lvl
        assert a[keys].astype(str).equals(b[keys].astype(str))


def test_itl_buckets_are_monotone_in_the_gap():
    rng = np.random.default_rng(3)
    v = np.sort(np.r_[rng.integers(-10**12, 10**12, 20000), rng.integers(-5, 5, 100),
                      [0, -1, 1, 2**62, -2**62, 2**53 + 1, 2**53]]).astype(np.int64)
    b = S._gap_bucket(v)
    assert (np.diff(b) >= 0).all()
    assert (b[v < 0] < b[v >= 0].min()).all()


def test_the_itl_spill_gives_back_every_gap_and_its_group(tmp_path):
    """Pass 2 reads pass 1's spill, not the chunk lists: every gap back as it was (those
    outside uint32's range too: negative, over 4.29 s), each with its row's group."""
    rng = np.random.default_rng(5)
    spill = S._Spill(str(tmp_path))
    want_g, want_v = [], []
    try:
        for _ in range(3):
            rows = rng.integers(0, 7, 50)
            per_row = rng.integers(0, 6, 50)
            v = rng.integers(0, 10**8, int(per_row.sum())).astype(np.int64)
            v[::11] = rng.choice([-3, 2**32 - 1, 2**32, 2**40, -2**40], len(v[::11]))
            spill.write(rows, per_row, v)
            want_g.append(np.repeat(rows, per_row)), want_v.append(v)
        got = list(spill.read())
    finally:
        spill.close()
    assert len(got) == 3
    for (g, v), wg, wv in zip(got, want_g, want_v):
        assert g.dtype == v.dtype == np.int64
        assert np.array_equal(g, wg) and np.array_equal(v, wv)


def test_the_spill_read_by_grains_keeps_every_gap_of_the_buckets_asked(tmp_path):
    """Pass 2 reads only the gaps in grains that may hold a wanted bucket: every gap of
    those buckets among them (and the far ones), each with its own group."""
    rng = np.random.default_rng(8)
    spill = S._Spill(str(tmp_path))
    rows = rng.integers(0, 5, 400)
    per_row = rng.integers(0, 40, 400)
    v = rng.lognormal(17, 1.5, int(per_row.sum())).astype(np.int64)
    v[::97] = -7
    v[::89] = 2**33
    spill.write(rows, per_row, v)
    g_all = np.repeat(rows, per_row)
    b_all = S._gap_bucket(v)
    want = rng.choice(np.unique(b_all), 6, replace=False)
    try:
        (g, got), = list(spill.read(S._Spill.grains(want)))
    finally:
        spill.close()
    inside = np.isin(S._gap_bucket(got), want)
    expect = np.isin(b_all, want)
    assert sorted(zip(g[inside], got[inside])) == sorted(zip(g_all[expect], v[expect]))
    assert set(v[(v < 0) | (v >= 2**32)]) <= set(got)
    bounds = S._bucket_floor(np.asarray(want))
    assert (S._gap_bucket(bounds) >= want).all()
    assert (S._gap_bucket(np.maximum(bounds - 1, 0)) < want).all() or (bounds == 0).any()


def test_value_buckets_are_monotone_in_the_value():
    rng = np.random.default_rng(4)
    v = np.sort(np.r_[rng.normal(0, 1e3, 20000), rng.lognormal(0, 8, 20000),
                      -rng.lognormal(0, 8, 2000), [0.0, -0.0, 1e-300, -1e-300, 1e300,
                                                    -1e300, 2.0 ** -20, 2.0 ** 60]])
    b = S._value_bucket(v)
    assert (np.diff(b) >= 0).all()
    assert (b[v < 0] < b[v >= 0].min()).all()
    assert b.max() - b.min() < 2 * (S._VALUE_CEIL + 1)  # a dense histogram stays narrow
