"""Stopping by count: `--kvbench-requests N` and a stage's `requests` end a run after exactly N
requests were sent (closed and open loop, one process or several), so a run of R requests is
reproducible; Locust has no iteration limit of its own. Also the loop-lag monitor's figures."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbench.loadgen.plan.pacing import share_of

sys.path.insert(0, str(Path(__file__).parent))
import stream_server as testing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "counts"
seed = 3

[[endpoints]]
name = "test"
kind = "openai"
url = "{url}"
model = "test-model"

[workloads.chat]
kind = "chat"
requests = 50
prompt_tokens = {{ dist = "constant", mean = 20 }}
output_tokens = {{ dist = "constant", mean = 4 }}

[profiles.open]
pacing = "poisson"
stages = [ {{ rate_rps = 40, duration_s = 120, requests = 17 }},
           {{ rate_rps = 40, duration_s = 120, requests = 9 }} ]
"""


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shares_add_up_and_differ_by_at_most_one(n, count):
    parts = [share_of(n, i, count) for i in range(count)]
    assert sum(parts) == n
    assert max(parts) - min(parts) <= 1
    assert share_of(None, 0, count) is None


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=10, itl_ms=5)
    yield url
    testing.stop(proc)


@pytest.fixture(scope="module")
def config(server, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "bench.toml"
    path.write_text(CONFIG.format(url=server))
    return path


def run(server, config, results, *extra, users=4, run_time="120s"):
    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadgen/chat.py", "--headless", "--host", server,
         "-u", str(users), "-r", str(users), "-t", run_time, "--only-summary",
         "--kvbench-config", str(config), "--kvbench-results", str(results),
         "--kvbench-run-id", "r", "--kvbench-endpoint", "test", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-3000:]
    meta = json.loads((results / "r" / "run.json").read_text())
    t = read_run_table(results / "r", "requests").to_pylist()
    return t, meta


def test_closed_loop_run_of_exactly_n_requests(server, config, tmp_path):
    t, meta = run(server, config, tmp_path, "--kvbench-requests", "23")
    # exactly 23 sent and recorded, all finished: the run ended by count, not by its 120 s
    assert len(t) == 23 and meta["counts"]["requests_started"] == 23
    assert {r["status"] for r in t} == {"ok"}
    assert not meta["interrupted"]
    assert meta["stages"][0]["duration_s"] < 100
    assert meta["stages"][0]["loop_pause_max_ms"] >= 0
    assert meta["stages"][0]["loop_pauses_over_5ms"] >= 0


def test_open_loop_stages_end_by_their_counts(server, config, tmp_path):
    t, meta = run(server, config, tmp_path, "--kvbench-profile", "open", users=1)
    by_stage = {0: 0, 1: 0}
    for r in t:
        by_stage[r["stage"]] += 1
    assert by_stage == {0: 17, 1: 9}
    stages = sorted(meta["stages"], key=lambda s: s["index"])
    assert [s["requests"] for s in stages] == [17, 9]
    assert not any(s.get("partial") for s in stages)
    assert stages[1]["t_start_ns"] >= stages[0]["t_end_ns"]
    assert not meta["interrupted"]


def test_count_split_over_processes(server, config, tmp_path):
    t, meta = run(server, config, tmp_path, "--kvbench-requests", "21", "--processes", "2")
    assert len(t) == 21 and len({r["request_id"] for r in t}) == 21
    assert {r["status"] for r in t} == {"ok"}
    workers = {}
    for r in t:
        workers[r["worker"]] = workers.get(r["worker"], 0) + 1
    assert sorted(workers.values()) == [10, 11]


def test_bad_count_is_one_sentence(server, config, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadgen/chat.py", "--headless", "--host", server,
         "-u", "1", "-t", "5s", "--kvbench-config", str(config), "--kvbench-results",
         str(tmp_path), "--kvbench-requests", "-3"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "--kvbench-requests -3: give a positive count" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("flag,value,word", [
    ("--kvbench-run-id", "../escaped", "--kvbench-run-id"),
    ("--kvbench-run-id", "history", "--kvbench-run-id"),
    ("--kvbench-results", "s3://bucket/prefix", "--kvbench-results")])
def test_plain_locust_refuses_a_run_id_or_results_folder_it_cannot_own(
        server, config, tmp_path, flag, value, word):
    """``locust -f loadgen/...`` takes its run id and results folder from the user as kvbench
    run does: a path, a store's own folder or an object-store URL is refused in one sentence,
    and nothing is written (no folder outside, or inside, the results folder)."""
    args = {"--kvbench-results": str(tmp_path / "results"), "--kvbench-run-id": "r"}
    args[flag] = value
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / "chat.py"), "--headless",
         "--host", server, "-u", "1", "-r", "1", "-t", "20s", "--only-summary",
         "--kvbench-config", str(config), *[x for kv in args.items() for x in kv],
         "--kvbench-endpoint", "test"],
        cwd=cwd, capture_output=True, text=True, timeout=110)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert word in out and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "escaped").exists()
    assert not any((tmp_path / "results").rglob("*.parquet"))
    assert not any(cwd.iterdir()), list(cwd.iterdir())
