"""Plain ``locust -f`` as a staging user runs it (issue 33): a ``./bench.toml`` in the current
directory lends its SLOs (and says it was used); an invalid one fails before any load with the
config's one-sentence error; Locust's own totals count each LLM request once."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import stream_server as testing  # noqa: E402
from plain_locust_helpers import StatusServer, locust  # noqa: E402

BENCH = """
[suite]
name = "staging"

[[endpoints]]
name = "staging"
kind = "openai"
url = "http://127.0.0.1:1"

[workloads.longctx]
kind = "longctx"

[profiles.closed]
pacing = "closed"
stages = [{ users = 1, duration_s = 5 }]

[slo.longctx]
ttft_ms = 1234
tpot_ms = 77
"""


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=5, itl_ms=2)
    yield url
    testing.stop(proc)


def _run_dir(res: Path) -> Path:
    runs = [p for p in res.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_a_bench_toml_in_the_current_directory_lends_its_slos(server, tmp_path):
    (tmp_path / "bench.toml").write_text(BENCH)
    p = locust(tmp_path, "longctx.py", "--headless", "--host", server, "-u", "2", "-r", "2",
               "-t", "3s", "--only-summary", "--kvbench-results", "res",
               "--kvbench-tokenizer-check", "off")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    said = [ln for ln in out.splitlines() if "kvbench: config" in ln]
    assert len(said) == 1 and str(tmp_path / "bench.toml") in said[0], out[-3000:]
    run = _run_dir(tmp_path / "res")
    assert run.name.split("-")[1] == "staging"  # the suite's name
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["slo"]["longctx"]["ttft_ms"] == 1234
    job = json.loads(next(run.glob("job-*.json")).read_text())
    assert job["slo"]["longctx"]["ttft_ms"] == 1234 and job["slo"]["longctx"]["tpot_ms"] == 77
    assert read_run_table(run, "requests").num_rows > 0


def test_an_invalid_bench_toml_fails_before_any_load(tmp_path):
    (tmp_path / "bench.toml").write_text(BENCH.replace("ttft_ms = 1234", "ttft_ms = -5"))
    srv = StatusServer(200)
    try:
        p = locust(tmp_path, "longctx.py", "--headless", "--host", srv.url, "-u", "2", "-r",
                   "2", "-t", "20s", "--only-summary", "--kvbench-results", "res",
                   "--kvbench-model", "m")
    finally:
        srv.close()
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    errors = [ln for ln in out.splitlines() if "kvbench: error:" in ln]
    assert len(errors) == 1, out[-3000:]
    assert "bench.toml" in errors[0] and "ttft_ms" in errors[0]
    assert "Traceback" not in out
    assert srv.posts == 0


def test_kvbench_config_none_ignores_the_folders_bench_toml(server, tmp_path):
    (tmp_path / "bench.toml").write_text("not toml [")
    p = locust(tmp_path, "longctx.py", "--headless", "--host", server, "-u", "1", "-r", "1",
               "-t", "2s", "--only-summary", "--kvbench-results", "res",
               "--kvbench-config", "none", "--kvbench-tokenizer-check", "off")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]


def _aggregated(text: str) -> int:
    for ln in text.splitlines():
        if ln.split()[:1] == ["Aggregated"]:
            return int(ln.split()[1])
    raise AssertionError("no Aggregated row")


def test_locusts_totals_count_each_llm_request_once(server, tmp_path):
    p = locust(tmp_path, "longctx.py", "--headless", "--host", server, "-u", "2", "-r", "2",
               "-t", "4s", "--only-summary", "--kvbench-results", "res", "--csv",
               str(tmp_path / "lc"), "--kvbench-tokenizer-check", "off")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    rows = read_run_table(_run_dir(tmp_path / "res"), "requests").to_pylist()
    told = [r for r in rows if r["status"] != "cancelled"]  # a stop's cut is no request
    assert len(told) > 0
    # Locust's final summary (complete at the end) counts one per LLM request
    assert _aggregated(p.stdout + p.stderr) == len(told)
    # its CSV (written every second, so possibly a tick behind) agrees with its own e2e rows
    with open(tmp_path / "lc_stats.csv") as f:
        stats = list(csv.DictReader(f))
    agg = next(r for r in stats if r["Name"] == "Aggregated")
    e2e = sum(int(r["Request Count"]) for r in stats if r["Name"].startswith("e2e "))
    assert int(agg["Request Count"]) == e2e <= len(told)
    # TTFT and TPOT stay visible as their own rows, outside the total
    names = {r["Name"] for r in stats}
    assert "ttft longctx" in names and "tpot longctx" in names
