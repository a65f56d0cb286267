"""Plain ``locust -f`` against a target that cannot serve (issue 33): a run of failures load
cannot cause (HTTP 404, connection refused) stops the run early with one sentence and a
non-zero exit, its records kept; overload's own answers (503) never stop it; a dead port
without --kvbench-model says the connection was refused and leaves no run directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from plain_locust_helpers import StatusServer, free_port, locust  # noqa: E402

LIMIT = 10


def _records(res: Path):
    runs = [p for p in res.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return read_run_table(runs[0], "requests").to_pylist()


def _run(tmp_path, host, *extra, t="60s"):
    return locust(tmp_path, "longctx.py", "--headless", "--host", host, "-u", "4", "-r", "4",
                  "-t", t, "--only-summary", "--kvbench-results", str(tmp_path / "res"),
                  "--kvbench-tokenizer-check", "off", *extra)


def test_every_request_404_stops_the_run_with_the_served_models(tmp_path):
    srv = StatusServer(404, models=("llama-70b",))
    try:
        p = _run(tmp_path, srv.url, "--kvbench-model", "wrong-name",
                 "--kvbench-stop-after-failures", str(LIMIT))
    finally:
        srv.close()
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    errors = [ln for ln in out.splitlines() if "kvbench: error:" in ln]
    assert len(errors) == 1, out[-3000:]
    line = errors[0]
    assert f"stopped after {LIMIT} requests in a row failed" in line
    assert "HTTP 404" in line and "wrong-name" in line and "llama-70b" in line
    rows = _records(tmp_path / "res")
    assert LIMIT <= len(rows) < 3 * LIMIT  # it stopped long before -t 60s
    assert srv.posts < 3 * LIMIT
    assert {r["http_status"] for r in rows if r["status"] != "cancelled"} == {404}


def test_a_dead_port_stops_the_run_saying_the_connection_was_refused(tmp_path):
    port = free_port()
    p = _run(tmp_path, f"http://127.0.0.1:{port}", "--kvbench-model", "m",
             "--kvbench-stop-after-failures", str(LIMIT))
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert f"connection refused at 127.0.0.1:{port}" in out
    assert "is the server running" in out
    rows = _records(tmp_path / "res")
    assert LIMIT <= len(rows) < 3 * LIMIT


def test_a_dead_port_without_a_model_names_the_refusal_and_writes_nothing(tmp_path):
    port = free_port()
    p = _run(tmp_path, f"http://127.0.0.1:{port}")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert f"connection refused at 127.0.0.1:{port}" in out, out[-3000:]
    assert "did not name a model" not in out
    assert "--kvbench-model" not in out.split("kvbench: error:", 1)[1].splitlines()[0]
    assert not (tmp_path / "res").exists() or not any((tmp_path / "res").iterdir())


def test_a_server_answering_503_is_never_stopped_early(tmp_path):
    srv = StatusServer(503)
    try:
        p = _run(tmp_path, srv.url, "--kvbench-model", "m", "--kvbench-stop-after-failures",
                 str(LIMIT), t="5s")
    finally:
        srv.close()
    out = p.stdout + p.stderr
    assert "stopped after" not in out and "kvbench: error:" not in out, out[-3000:]
    rows = _records(tmp_path / "res")
    assert len(rows) > 3 * LIMIT
    sent = sorted(r["t_sent"] for r in rows)
    # records kept coming until the end of the 5 s run, not just its first moments
    assert (sent[-1] - sent[0]) / 1e9 > 3.0
    assert {r["http_status"] for r in rows if r["status"] != "cancelled"} == {503}


@pytest.mark.parametrize("limit", ["0"])
def test_zero_never_stops(tmp_path, limit):
    srv = StatusServer(404)
    try:
        p = _run(tmp_path, srv.url, "--kvbench-model", "m", "--kvbench-stop-after-failures",
                 limit, t="3s")
    finally:
        srv.close()
    assert "stopped after" not in p.stdout + p.stderr
    assert len(_records(tmp_path / "res")) > 3 * LIMIT
