"""Stops: a stage's end drains what is in flight (bounded by the profile's drain_s, Locust's
--stop-timeout) and records the rest as ``cancelled at the stop``, never as errors; a signal
marks a plain Locust run interrupted (run.json, exit code, the partial stage); with
--processes the master finalizes once."""

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

import stream_server as testing
from kvbench.core.store import load_results, shard_files
from kvbench.runs.locust import free_port

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "stops"
seed = 1
results_dir = "{results}"
workloads = ["chat"]
profile = "closed"

[[endpoints]]
name = "test"
kind = "openai"
url = "{url}"
model = "test-model"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 40
prompt_tokens = {{ dist = "constant", mean = 30 }}
output_tokens = {{ dist = "constant", mean = {tokens} }}

[profiles.closed]
pacing = "closed"
drain_s = {drain}
stages = [ {{ users = 3, duration_s = 2 }} ]
"""


@pytest.fixture(scope="module")
def fast():
    """Requests of ~30 ms: they all end within any drain."""
    proc, url = testing.start(ttft_ms=10, itl_ms=3)
    yield url
    testing.stop(proc)


@pytest.fixture(scope="module")
def slow():
    """Requests of ~10 s (200 tokens at 50 ms): a 0.5 s drain cuts every one in flight."""
    proc, url = testing.start(ttft_ms=20, itl_ms=50)
    yield url
    testing.stop(proc)


def config(tmp_path, url, tokens=6, drain=30):
    path = tmp_path / "bench.toml"
    path.write_text(CONFIG.format(results=tmp_path / "results", url=url, tokens=tokens,
                                  drain=drain))
    return path


def locust(cfg, url, results, run_id, *extra, run_time="2s", users=3):
    return subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", "loadgen/mix.py", "--headless", "--host", url,
         "-u", str(users),
         "-r", str(users), "-t", run_time, "--only-summary", "--kvbench-config", str(cfg),
         "--kvbench-results", str(results), "--kvbench-run-id", run_id, "--kvbench-endpoint",
         "test", "--kvbench-workload", "chat", "--kvbench-profile", "closed", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def statuses(run_dir):
    t = read_run_table(run_dir, "requests")
    return collections.Counter(zip(t.column("status").to_pylist(),
                                   t.column("error").to_pylist()))


def test_closed_loop_stage_end_drains_in_flight_requests(fast, tmp_path):
    """Before: each user's request in flight at -t was cancelled and counted as an error."""
    p = locust(config(tmp_path, fast), fast, tmp_path, "drained")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    run_dir = tmp_path / "drained"
    meta = load_results(run_dir).meta
    counts = statuses(run_dir)
    assert set(counts) == {("ok", None)}, counts  # every request in flight at the end finished
    assert not meta.interrupted and meta.incomplete == []
    assert meta.counts["requests_started"] == meta.counts["records_written"] == counts[("ok", None)]
    assert not meta.stages[0].partial


def test_drain_bound_comes_from_the_profile_and_cancels_the_rest(slow, tmp_path):
    cfg = config(tmp_path, slow, tokens=200, drain=0.5)
    p = locust(cfg, slow, tmp_path, "bounded")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]  # cancelled at the stop is not a failure
    run_dir = tmp_path / "bounded"
    counts = statuses(run_dir)
    # 3 users, each with one ~10 s request in flight when the 2 s stage ended, cut 0.5 s later
    # (a host stalled through the whole stage may have started fewer)
    assert set(counts) == {("cancelled", "cancelled at the stop")}, counts
    assert 1 <= counts[("cancelled", "cancelled at the stop")] <= 3
    assert not load_results(run_dir).meta.interrupted


def test_kvbench_run_shows_cancelled_apart_from_errors(slow, tmp_path):
    cfg = config(tmp_path, slow, tokens=200, drain=0.5)
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", "k1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    row = next((ln for ln in p.stdout.splitlines() if ln.startswith("test ")), p.stdout)
    requests, ok, errors, cancelled = (int(x) for x in row.split()[1:5])
    assert (ok, errors) == (0, 0) and 1 <= cancelled == requests <= 3, p.stdout
    assert f"{cancelled} cancelled at the stop" in p.stdout
    job = json.loads(next((tmp_path / "results" / "k1").glob("job-*.json")).read_text())
    assert job["drain_s"] == 0.5


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM],
                         ids=lambda s: signal.Signals(s).name)
def test_interrupted_plain_run_says_so(slow, tmp_path, sig):
    """Before: rc 0, ``incomplete: []``, ``stages: []``."""
    cfg = config(tmp_path, slow, tokens=200)
    p = locust(cfg, slow, tmp_path, "intr", run_time="120s")
    run_dir = tmp_path / "intr"
    _wait_for(lambda: shard_files(run_dir, "starts"))  # requests are in flight
    p.send_signal(sig)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, out[-3000:]
    meta = load_results(run_dir).meta
    assert meta.interrupted and signal.Signals(sig).name in meta.interruption
    assert meta.incomplete[0].what == "the run" and "interrupted" in meta.incomplete[0].why
    (stage,) = meta.stages
    assert stage.partial and stage.planned_duration_s is not None
    assert 0 < stage.duration_s and stage.t_end_ns > stage.t_start_ns
    counts = statuses(run_dir)
    assert set(counts) == {("cancelled", "cancelled at the stop")}, counts  # no drain


@pytest.mark.parametrize("group", [False, True], ids=["master", "process-group"])
def test_processes_mode_sigterm_finalizes_once_on_the_master(slow, tmp_path, group):
    """Before: finalized twice ("0 rows compacted, 39 written"), or not at all."""
    cfg = config(tmp_path, slow, tokens=200)
    port = str(free_port())
    p = locust(cfg, slow, tmp_path, "procs", "--processes", "2", "--master-bind-host",
               "127.0.0.1", "--master-bind-port", port, "--master-port", port,
               "--loglevel", "INFO", run_time="120s", users=4)
    run_dir = tmp_path / "procs"
    _wait_for(lambda: len(shard_files(run_dir, "starts")) == 2)  # both workers send
    if group:
        _signal_tree(p.pid)
    else:
        p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert out.count("records in") == 1, out[-4000:]  # one finalize
    meta = load_results(run_dir).meta
    t = read_run_table(run_dir, "requests")
    assert meta.interrupted and "SIGTERM" in meta.interruption
    assert meta.counts["records_written"] == meta.counts["requests_started"] == t.num_rows >= 2
    assert not [n for n in meta.incomplete if n.what in ("records", "load process(es)")
                or "load process" in n.what], meta.incomplete
    assert len(set(t.column("worker").to_pylist())) == 2
    assert p.returncode == 143


def _signal_tree(pid):
    """SIGTERM to Locust's master and its forked workers at once (as a terminal or a process
    manager does to a process group)."""
    import psutil

    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    for pr in procs:
        pr.send_signal(signal.SIGTERM)


def _wait_for(cond, timeout_s=90.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out waiting for the run to start sending"
        time.sleep(0.1)
