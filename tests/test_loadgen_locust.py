"""Headless Locust runs of every locustfile against the logging test server: records ==
requests started, Parquet and run.json written; SIGINT and SIGTERM lose nothing."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

from kvbench.core.store import load_results, shard_files
from kvbench.runs.locust import free_port
import stream_server as testing

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "t"
seed = 1

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
output_tokens = {{ dist = "constant", mean = 6 }}

[workloads.rag]
kind = "rag"
requests = 30
documents = 6
chunk_tokens = {{ dist = "constant", mean = 40 }}
output_tokens = {{ dist = "constant", mean = 6 }}

[workloads.agent]
kind = "agent"
sessions = 4
turns = 3
system_prompt_tokens = 40
tool_schema_tokens = 40
output_tokens = {{ dist = "constant", mean = 6 }}
think_time_s = {{ dist = "constant", mean = 0.05 }}

[workloads.longctx]
kind = "longctx"
contracts = 2
questions_per_contract = 3
contract_tokens = {{ dist = "constant", mean = 400 }}
output_tokens = {{ dist = "constant", mean = 6 }}
think_time_s = {{ dist = "constant", mean = 0.01 }}

[workloads.mix]
kind = "mix"
requests = 60
components = [ {{ workload = "chat", weight = 2 }}, {{ workload = "rag", weight = 1 }} ]

[workloads.trace]
kind = "trace"
format = "mooncake"
path = "{trace}"

[profiles.closed]
pacing = "closed"
stages = [ {{ users = 3, duration_s = 3 }} ]
"""


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=15, itl_ms=5)
    yield url
    testing.stop(proc)


@pytest.fixture(scope="module")
def config(server, tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    trace = d / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 600,
                                         "output_length": 5, "hash_ids": [i % 3, 10 + i]}) + "\n"
                             for i in range(20)))
    path = d / "bench.toml"
    path.write_text(CONFIG.format(url=server, trace=trace))
    return path


def locust(name, server, config, results, *extra, run_time="3s", users=3):
    return subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", f"loadgen/{name}.py", "--headless",
         "--host", server, "-u", str(users), "-r", str(users), "-t", run_time, "--only-summary",
         "--kvbench-config", str(config), "--kvbench-results", str(results),
         "--kvbench-run-id", name, "--kvbench-endpoint", "test", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_run(run_dir: Path, *, want_ok: bool = True):
    res = load_results(run_dir)
    meta = res.meta.to_dict()  # run.json as written
    t = read_run_table(run_dir, "requests")
    counts = meta["counts"]
    assert counts["requests_started"] == counts["records_written"] == t.num_rows > 0
    assert not shard_files(run_dir, "requests")  # compacted
    assert meta["endpoints"][0]["topology"] == "colocated"
    assert meta["stages"] and meta["stages"][0]["t_end_ns"] > meta["stages"][0]["t_start_ns"]
    status = t.column("status").to_pylist()
    # every request carried its record's id as X-Request-Id and the server answered with it
    ok_ids = [(r, s) for r, s, st in zip(t.column("request_id").to_pylist(),
                                        t.column("server_request_id").to_pylist(), status)
              if st == "ok"]
    assert all(r == s for r, s in ok_ids), ok_ids[:3]
    if want_ok:
        assert status.count("ok") >= 0.8 * len(status), status
    assert set(status) <= {"ok", "cancelled"}
    return t, meta


def test_every_locustfile_headless(server, config, tmp_path):
    runs = {
        "longctx": locust("longctx", server, config, tmp_path),
        "rag": locust("rag", server, config, tmp_path),
        "agent": locust("agent", server, config, tmp_path),
        "mix": locust("mix", server, config, tmp_path, "--kvbench-pacing", "poisson",
                      "--kvbench-rates", "10,30", "--kvbench-stage-duration", "1", users=1,
                      run_time="20s"),
        "trace": locust("trace", server, config, tmp_path, "--kvbench-pacing", "trace",
                        users=1, run_time="20s"),
    }
    for name, p in runs.items():
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        t, meta = check_run(tmp_path / name)
        assert meta["workloads"][name]["requests"] > 0
        classes = set(t.column("request_class").to_pylist())
        if name == "mix":
            assert {s["index"] for s in meta["stages"]} == {0, 1}
            assert 20 <= t.num_rows <= 70  # 10 + 30 Poisson arrivals
            assert classes <= {"chat", "rag"}
            lag = [a - b for a, b in zip(t.column("t_sent").to_pylist(),
                                         t.column("t_scheduled").to_pylist())]
            assert min(lag) >= 0
        if name == "trace":
            assert t.num_rows == 20  # the whole trace, at its own times, then the run ends
            sent = sorted(t.column("t_scheduled").to_pylist())
            assert abs((sent[-1] - sent[0]) / 1e9 - 1.9) < 0.1
        if name == "agent":
            turns = set(t.column("turn").to_pylist())
            assert turns >= {0, 1}
        assert "LLM" in out and "e2e" in out  # Locust's own stats show the request events


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_loses_nothing(server, config, tmp_path, sig):
    p = locust("longctx", server, config, tmp_path, run_time="60s", users=4)
    time.sleep(3.0)
    p.send_signal(sig)
    out, _ = p.communicate(timeout=30)
    t, meta = check_run(tmp_path / "longctx", want_ok=False)
    assert t.num_rows >= 4


def test_processes_mode_each_worker_writes_its_shard(server, config, tmp_path):
    port = str(free_port())  # not Locust's default 5557, which other Locusts on the host share
    p = locust("mix", server, config, tmp_path, "--processes", "2", "--master-bind-host",
               "127.0.0.1", "--master-bind-port", port, "--master-port", port, "--kvbench-pacing",
               "constant", "--kvbench-rates", "20", "--kvbench-stage-duration", "2", users=2,
               run_time="20s")
    out, _ = p.communicate(timeout=60)
    assert (tmp_path / "mix" / "run.json").exists(), out[-4000:]
    t, meta = check_run(tmp_path / "mix")
    workers = set(t.column("worker").to_pylist())
    assert len(workers) == 2 and len(meta["hosts"]) == 1
    assert 34 <= t.num_rows <= 42  # 20 req/s in total for 2 s, split between the workers
    assert len(set(t.column("request_id").to_pylist())) == t.num_rows
