"""The per-request definitions (kvbench.reports.measures.definitions): their in-memory (numpy) and
columnar (Arrow) evaluations agree on every definition, on generated records with nulls,
one-token answers, cancelled requests, errors and empty chunk lists."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from kvbench.core.schema import REQUESTS
from kvbench.reports.measures import definitions as D

EPOCH = 1_780_000_000 * 10**9
NAMES = list(D.DEFINITIONS)


def maybe(s):
    return st.one_of(st.none(), s)


record = st.fixed_dictionaries({
    "status": maybe(st.sampled_from(["ok", "ok", "ok", "cancelled", "http_error", "timeout"])),
    "request_class": maybe(st.sampled_from(["chat", "rag", "agent"])),
    "t_scheduled": maybe(st.integers(EPOCH, EPOCH + 10**12)),
    "t_sent": maybe(st.integers(EPOCH, EPOCH + 10**12)),
    "ttft_ns": maybe(st.integers(0, 10**10)),
    "e2e_ns": maybe(st.integers(0, 10**11)),
    "prompt_tokens": maybe(st.integers(0, 10**5)),
    "prompt_tokens_client": maybe(st.integers(0, 10**5)),
    "completion_tokens": maybe(st.integers(0, 3)),  # 0, 1 (no TPOT) and more
    "completion_tokens_client": maybe(st.integers(0, 3)),
    "cached_tokens": maybe(st.integers(0, 10**5)),
    "chunk_offsets_ns": maybe(st.lists(st.integers(0, 10**10), max_size=6).map(sorted)),
    "streamed": maybe(st.booleans()),  # false: sent without streaming, no TTFT by design
})
slos = st.dictionaries(st.sampled_from(["chat", "rag", "trace"]), st.fixed_dictionaries({
    "ttft_ms": maybe(st.floats(0.001, 1e4)), "tpot_ms": maybe(st.floats(0.001, 1e3)),
    "e2e_ms": maybe(st.floats(0.001, 1e5))}), max_size=3)


def as_table(records: list[dict]) -> pa.Table:
    return pa.table({c: pa.array([r[c] for r in records], REQUESTS.field(c).type)
                     for c in D.INPUTS})


def in_memory(value) -> list:
    """A numpy evaluation as Python values (None for a null), lists of gaps per row."""
    if isinstance(value, D.Lists):
        return [value.values[a:b].tolist() for a, b in zip(value.offsets[:-1], value.offsets[1:])]
    return [v if ok else None for v, ok in zip(np.asarray(value.data).tolist(),
                                               np.asarray(value.valid).tolist())]


@settings(max_examples=150, deadline=None)
@given(st.lists(record, max_size=25), slos, st.integers(1, 7))
def test_numpy_and_arrow_evaluations_agree(records, slo, chunk):
    table = as_table(records)
    # the load process's batches ({column: list}) and a report's table (Arrow, in chunks)
    columns = {c: [r[c] for r in records] for c in D.INPUTS}
    mem = D.evaluate(NAMES, columns, slo, n=len(records)) if records else None
    chunked = pa.Table.from_batches(table.to_batches(max_chunksize=chunk), table.schema) \
        if records else table
    col = D.evaluate_arrow(chunked, NAMES, slo)
    read = D.evaluate(NAMES, D.from_arrow(chunked, D.inputs(NAMES)), slo, n=len(records)) \
        if records else None
    for name in NAMES:
        want = col[name].to_pylist()
        if mem is None:
            assert want == []
            continue
        assert in_memory(mem[name]) == want, name  # exact, floats included
        assert in_memory(read[name]) == want, name


def test_definitions_say_what_design_says():
    records = [
        dict.fromkeys(D.INPUTS) | {"status": "ok", "request_class": "chat", "t_scheduled": EPOCH,
                                   "t_sent": EPOCH + 1_500, "ttft_ns": 100_000_000,
                                   "e2e_ns": 100_000_000, "completion_tokens": 1,
                                   "prompt_tokens_client": 10, "cached_tokens": 4,
                                   "chunk_offsets_ns": [100_000_000]},
        dict.fromkeys(D.INPUTS) | {"status": "http_error", "request_class": "chat",
                                   "t_scheduled": EPOCH, "t_sent": EPOCH,
                                   "chunk_offsets_ns": [1, 5, 9]},
        dict.fromkeys(D.INPUTS) | {"status": "cancelled", "request_class": "chat",
                                   "t_scheduled": EPOCH, "t_sent": EPOCH,
                                   "chunk_offsets_ns": []},
    ]
    got = D.evaluate_arrow(as_table(records), NAMES, {"chat": {"ttft_ms": 200.0,
                                                               "tpot_ms": 1.0}})
    v = {k: a.to_pylist() for k, a in got.items()}
    assert v["tpot_ms"][0] is None and v["slo_met"] == [True, False, False]  # one token
    assert v["lateness_ms"][0] == 0.0015  # epoch ns subtracted exactly
    assert v["failed"] == [False, True, False] and v["judged"] == [True, True, False]
    assert v["prompt_tokens"][0] == 10 and v["hit_counted"] == [True, False, False]
    assert v["itl_gaps_ns"] == [[], [], []]  # gaps of successful requests only


def test_sql_renders_every_definition():
    duckdb = pytest.importorskip("duckdb")
    records = [dict.fromkeys(D.INPUTS) | {"status": "ok", "request_class": "chat",
                                          "t_scheduled": EPOCH, "t_sent": EPOCH + 7,
                                          "ttft_ns": 10**6, "e2e_ns": 5 * 10**6,
                                          "completion_tokens": 3,
                                          "chunk_offsets_ns": [10**6, 3 * 10**6, 5 * 10**6]}]
    requests = as_table(records)  # noqa: F841 - DuckDB reads the local by name
    slo = {"chat": {"ttft_ms": 2.0, "tpot_ms": 1.0}}
    want = D.evaluate_arrow(requests, NAMES, slo)
    for name in NAMES:
        got = duckdb.sql(f"SELECT {D.sql(name, slo)} AS v FROM requests").fetchall()[0][0]
        assert got == want[name].to_pylist()[0], name


def test_a_request_sent_without_streaming_is_judged_on_e2e_not_on_ttft():
    """A trace's "type": "n" request has no first token by design: its class's TTFT limit does
    not apply; the same answer streamed without a first token misses it; an old record (no
    column) counts as streamed."""
    base = {"status": "ok", "request_class": "chat", "t_scheduled": EPOCH, "t_sent": EPOCH,
            "ttft_ns": None, "e2e_ns": 2 * 10**9, "prompt_tokens": 10,
            "prompt_tokens_client": 10, "completion_tokens": 5, "completion_tokens_client": 5,
            "cached_tokens": None, "chunk_offsets_ns": None}
    records = [{**base, "streamed": False}, {**base, "streamed": True}, {**base, "streamed": None},
               {**base, "streamed": False, "e2e_ns": 9 * 10**9}]
    slo = {"chat": {"ttft_ms": 500.0, "tpot_ms": None, "e2e_ms": 5000.0}}
    columns = {c: [r[c] for r in records] for c in D.INPUTS}
    got = D.evaluate(["slo_met"], columns, slo, n=len(records))["slo_met"]
    assert np.asarray(got.data).tolist() == [True, False, False, False]
    arrow = D.evaluate_arrow(as_table(records), ["slo_met"], slo)["slo_met"].to_pylist()
    assert arrow == [True, False, False, False]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(-10**12, 10**12), max_size=7), st.booleans()),
                max_size=30), st.integers(0, 3))
def test_gaps_of_kept_rows_are_their_own_diffs(rows, lead):
    """``expr.gaps`` on the flat buffer (offsets not starting at 0 too) equals each kept
    row's own consecutive differences, a dropped row giving none."""
    from kvbench.reports.measures import expr as X

    flat = [0] * lead + [v for vals, _ in rows for v in vals]
    offsets = np.cumsum([lead] + [len(vals) for vals, _ in rows]).astype(np.int64)
    keep = np.asarray([k for _, k in rows], bool)
    got = X.gaps(np.asarray(flat, np.int64), offsets, keep, block=5)
    for i, (vals, k) in enumerate(rows):
        want = np.diff(np.asarray(vals, np.int64)) if k and len(vals) > 1 else []
        assert got.values[got.offsets[i]:got.offsets[i + 1]].tolist() == list(want)
