"""kvbench run end to end against the logging test server (an openai endpoint)."""

import subprocess
import sys
import urllib.request
from pathlib import Path

import orjson
import pyarrow.compute as pc
import pytest

from kvbench.core.store import load_results, read_proc_meta
import stream_server as testing

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "t"
results_dir = "{results}"
workloads = ["mix"]
profile = "{profile}"

[[endpoints]]
name = "test"
kind = "openai"
url = "{url}"
model = "{model}"
topology = "disaggregated"

[workloads.chat]
kind = "chat"
requests = 40
prompt_tokens = {{ dist = "constant", mean = 30 }}
output_tokens = {{ dist = "constant", mean = 6 }}

[workloads.rag]
kind = "rag"
requests = 30
documents = 6
chunk_tokens = {{ dist = "constant", mean = 40 }}
output_tokens = {{ dist = "constant", mean = 6 }}

[workloads.mix]
kind = "mix"
requests = 60
components = [ {{ workload = "chat", weight = 2 }}, {{ workload = "rag", weight = 1 }} ]

[profiles.ladder]
pacing = "poisson"
stages = [ {{ rate_rps = 5.0, duration_s = 1.5 }}, {{ rate_rps = 15.0, duration_s = 1.5 }} ]

[profiles.closed]
pacing = "closed"
stages = [ {{ users = 2, duration_s = 2 }} ]
"""


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=10, itl_ms=3, max_model_len=4096)
    yield url
    testing.stop(proc)


def kvbench(*args):
    return subprocess.run([sys.executable, "-m", "kvbench", "run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def server_log(url):
    return orjson.loads(urllib.request.urlopen(url + "/log").read())


def write(tmp_path, url, profile="ladder", model="test-model"):
    cfg = tmp_path / "bench.toml"
    cfg.write_text(CONFIG.format(results=tmp_path / "results", url=url, profile=profile,
                                 model=model))
    return cfg


def test_open_loop_ladder_run(server, tmp_path):
    server_log(server)
    cfg = write(tmp_path, server)
    p = kvbench("--config", str(cfg), "--run-id", "r1")
    assert p.returncode == 0, p.stderr + p.stdout
    run_dir = tmp_path / "results" / "r1"
    res = load_results(tmp_path / "results" / "latest")
    assert res.path.resolve() == run_dir.resolve()
    meta = res.meta.to_dict()  # run.json as written
    t = res.requests
    assert meta["counts"]["requests_started"] == meta["counts"]["records_written"] == t.num_rows
    assert [s["index"] for s in meta["stages"]] == [0, 1]
    assert [s["rate_rps"] for s in meta["stages"]] == [5.0, 15.0]
    assert meta["endpoints"][0]["topology"] == "disaggregated"
    assert meta["endpoints"][0]["model"] == "test-model"
    assert meta["workloads"]["mix"]["requests"] == 60
    assert "telemetry" in meta and isinstance(meta["incomplete"], list)
    assert set(t.column("status").to_pylist()) == {"ok"}
    assert t.column("prompt_tokens").to_pylist() == t.column("prompt_tokens_client").to_pylist()
    assert len(server_log(server)) == t.num_rows  # everything sent is recorded
    assert "TTFT p50 ms" in p.stdout and "[1/1]" in p.stdout


def test_failing_preflight_sends_nothing(server, tmp_path):
    server_log(server)
    cfg = write(tmp_path, server, model="no-such-model")
    p = kvbench("--config", str(cfg))
    assert p.returncode == 2
    msg = p.stderr.strip().splitlines()[-1]
    assert "no-such-model" in msg and "Traceback" not in p.stderr
    assert server_log(server) == {}
    cfg = write(tmp_path, "http://127.0.0.1:9")
    p = kvbench("--config", str(cfg))
    assert p.returncode == 2 and "does not answer" in p.stderr


def test_prompt_longer_than_context_fails_preflight(tmp_path):
    proc, url = testing.start(max_model_len=50)
    try:
        p = kvbench("--config", str(write(tmp_path, url)))
        assert p.returncode == 2 and "context" in p.stderr
        assert server_log(url) == {}
    finally:
        testing.stop(proc)


def test_closed_loop_run_with_two_processes(server, tmp_path):
    cfg = write(tmp_path, server, profile="closed")
    p = kvbench("--config", str(cfg), "--run-id", "c1", "--processes", "2")
    assert p.returncode == 0, p.stderr + p.stdout
    run_dir = tmp_path / "results" / "c1"
    res = load_results(run_dir)
    t = res.requests
    # Counts a busy host cannot break: two load processes each closed its shard with every
    # request it started recorded (one that a stalled host kept from sending has none).
    sidecars = read_proc_meta(run_dir)
    assert len(sidecars) == 2 and all(m.closed for m in sidecars)
    for m in sidecars:
        mine = t.filter(pc.equal(t.column("worker"), m.worker)).num_rows
        assert m.counts["requests_started"] == m.counts["records_written"] == mine
    assert t.num_rows > 0 and set(t.column("worker").to_pylist()) <= {
        m.worker for m in sidecars}
    assert set(t.column("status").to_pylist()) == {"ok"}  # the stage's end drained them
    assert res.meta.stages[0].pacing == "closed" and res.meta.stages[0].users == 2
    assert len(set(t.column("request_id").to_pylist())) == t.num_rows
