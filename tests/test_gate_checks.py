"""Records that cannot be true are a data error in report and gate (exit 3, one sentence naming
the file, the column and how many records), never a verdict or a figure; records that only look
odd (a zero-token answer without TTFT, one request id on two workers) are no error."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.config import GateConfig, GateRule
from kvbench.core import checks
from kvbench.core.errors import DataError
from kvbench.core.store import load_results, read_meta
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

RULES = GateConfig(rules=[GateRule(metric="ttft_p50", max_increase_pct=10),
                          GateRule(metric="error_rate", max_value=0.005)],
                   bootstrap_resamples=200)


def _table(seed=1, n=150):
    shape = RunShape(endpoints=[EndpointShape("colocated")], requests_per_stage=n, seed=seed)
    table, stages = synth_table(shape, run_id=f"r{seed}")
    return shape, table, stages


def _write(root, name, table, shape, stages, seed=1):
    cfg = {"suite": {"name": "synthetic", "seed": seed}, "slo": {},
           "gate": RULES.model_dump(by_alias=True)}
    return write_run(root / name, table, run_meta(shape, stages, run_id=name, config=cfg))


def _set(table: pa.Table, name: str, values) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.field(i), pa.array(values, table.field(i).type))


def _col(table, name):
    return table.column(name).to_pylist()


def _negated_ttft(t):
    return _set(t, "ttft_ns", [None if v is None else -v for v in _col(t, "ttft_ns")])


def _negative_e2e(t):
    e2e = _col(t, "e2e_ns")
    return _set(t, "e2e_ns", [-1 if i < 3 else v for i, v in enumerate(e2e)])


def _null_ttft(t):
    return _set(t, "ttft_ns", [None] * t.num_rows)


def _chunks_backwards(t):
    offs = _col(t, "chunk_offsets_ns")
    return _set(t, "chunk_offsets_ns", [o[::-1] if i < 5 and o and len(o) > 1 else o
                                        for i, o in enumerate(offs)])


def _negative_chunk(t):
    offs = _col(t, "chunk_offsets_ns")
    return _set(t, "chunk_offsets_ns", [[-5] + o if i < 2 else o for i, o in enumerate(offs)])


def _e2e_before_ttft(t):
    ttft, e2e = _col(t, "ttft_ns"), _col(t, "e2e_ns")
    return _set(t, "e2e_ns", [(tt - 1 if (tt is not None and i < 4) else e)
                              for i, (tt, e) in enumerate(zip(ttft, e2e))])


def _every_row_twice(t):
    return pa.concat_tables([t, t])


def _n_ok_streamed(t):
    ok = [s == "ok" and bool(o) for s, o in zip(_col(t, "status"), _col(t, "chunk_offsets_ns"))]
    return sum(ok)


DAMAGE = {
    "negated ttft": (_negated_ttft, "ttft_ns", "negative",
                     lambda t: sum(v is not None and v > 0 for v in _col(t, "ttft_ns"))),
    "negative e2e": (_negative_e2e, "e2e_ns", "negative", lambda t: 3),
    "null ttft": (_null_ttft, "ttft_ns", "null on an ok streamed request", _n_ok_streamed),
    "chunks out of order": (_chunks_backwards, "chunk_offsets_ns", "out of order",
                            lambda t: sum(bool(o) and len(o) > 1 and o[0] != o[-1] for o in
                                          _col(t, "chunk_offsets_ns")[:5])),
    "negative chunk offset": (_negative_chunk, "chunk_offsets_ns", "negative", lambda t: 2),
    "e2e before ttft": (_e2e_before_ttft, "e2e_ns", "shorter than its ttft_ns",
                        lambda t: sum(v is not None for v in _col(t, "ttft_ns")[:4])),
    "every row twice": (_every_row_twice, "request_id", "repeated on the same worker",
                        lambda t: t.num_rows),
}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvbench", *args], capture_output=True,
                          text=True, timeout=180)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_impossible_records_are_a_data_error_in_gate_and_report(tmp_path, kind):
    damage, column, what, expected = DAMAGE[kind]
    shape, table, stages = _table()
    base = _write(tmp_path, "base", table, shape, stages)
    bad = damage(table)
    n = expected(table)
    assert n > 0
    cur = _write(tmp_path, "cur", bad, shape, stages)
    p = _cli("gate", "--baseline", str(base), "--current", str(cur), "--no-history",
             "--junit", str(tmp_path / "j.xml"))
    assert p.returncode == 3, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert str(cur / "requests") in lines[0]
    assert f"{n} record{'s' * (n != 1)} whose {column} is {what}" in lines[0], lines[0]
    assert "PASS" not in p.stdout
    assert 'errors="1"' in (tmp_path / "j.xml").read_text()
    # a damaged baseline is refused the same way
    p = _cli("gate", "--baseline", str(cur), "--current", str(base), "--no-history")
    assert p.returncode == 3 and str(cur / "requests") in p.stderr, p.stderr
    # and so is a report of it
    p = _cli("report", str(cur), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 3, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{n} record{'s' * (n != 1)} whose {column} is {what}" in lines[0], lines[0]
    assert str(cur / "requests") in lines[0]
    assert not (tmp_path / "r.html").exists()


def test_odd_but_possible_records_are_no_error(tmp_path):
    shape, table, stages = _table()
    # a zero-token ok answer: no chunk, so no TTFT, by design
    offs, ttft = _col(table, "chunk_offsets_ns"), _col(table, "ttft_ns")
    zero = [i for i, s in enumerate(_col(table, "status")) if s == "ok"][:3]
    table = _set(table, "chunk_offsets_ns", [[] if i in zero else o for i, o in enumerate(offs)])
    table = _set(table, "chunk_tokens", [[] if i in zero else o for i, o in
                                         enumerate(_col(table, "chunk_tokens"))])
    table = _set(table, "ttft_ns", [None if i in zero else v for i, v in enumerate(ttft)])
    # the same request ids sent by a second worker
    other = _set(table, "worker", ["otherhost:2"] * table.num_rows)
    other = _set(other, "session_id", [f"w2-{s}" for s in _col(table, "session_id")])
    both = pa.concat_tables([table, other])
    run = _write(tmp_path, "run", both, shape, stages)
    assert load_results(run).requests.num_rows == both.num_rows
    p = _cli("report", str(run), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr


def _offsets_table(lists):
    return pa.table({"chunk_offsets_ns": pa.array(lists, pa.list_(pa.int64()))})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.lists(st.integers(-10, 10**6), max_size=6)),
                max_size=30))
def test_chunk_checks_agree_with_a_plain_loop(lists):
    found = checks.chunk_problems(_offsets_table(lists).column(0))
    neg = sum(1 for o in lists if o and min(o) < 0)
    back = sum(1 for o in lists if o and any(b < a for a, b in zip(o, o[1:])))
    assert found.get(("chunk_offsets_ns", "negative"), 0) == neg
    assert found.get(("chunk_offsets_ns", "out of order"), 0) == back


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a:1", "b:2", None]),
                          st.sampled_from(["1#0", "2#0", "1#1", None])), max_size=30))
def test_duplicate_count_agrees_with_a_plain_loop(pairs):
    t = pa.table({"worker": pa.array([w for w, _ in pairs], pa.string()),
                  "request_id": pa.array([r for _, r in pairs], pa.string())})
    seen, dup = set(), 0
    for w, r in pairs:
        if r is None:
            continue
        key = (w or "", r)
        dup += key in seen
        seen.add(key)
    assert checks.scalar_problems(t).get(("request_id", "repeated on the same worker"), 0) == dup


def test_a_deeply_nested_run_json_is_one_sentence(tmp_path):
    shape, table, stages = _table()
    run = _write(tmp_path, "run", table, shape, stages)
    (run / "run.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(DataError, match="run.json is not valid JSON"):
        read_meta(run)
    for args in (("report", str(run), "-o", str(tmp_path / "r.html")),
                 ("gate", "--baseline", str(run), "--current", str(run), "--no-history")):
        p = _cli(*args)
        assert p.returncode == 3, p.stderr[-2000:]
        assert "RecursionError" not in p.stderr and "Traceback" not in p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and str(run / "run.json") in lines[0], lines


def test_checks_on_a_million_rows_are_vectorised():
    n = 1_000_000
    rng = np.random.default_rng(0)
    ttft = rng.integers(1, 10**9, n)
    t = pa.table({"ttft_ns": ttft, "e2e_ns": ttft + 5, "status": pa.array(["ok"] * n),
                  "worker": pa.array(["h:1"] * n),
                  "request_id": pa.array([f"{i}#0" for i in range(n)])})
    import time

    t0 = time.perf_counter()
    assert checks.scalar_problems(t) == {}
    assert time.perf_counter() - t0 < 5  # a loop over rows in Python would take far longer
