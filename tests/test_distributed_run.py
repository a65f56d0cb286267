"""``kvbench run`` distributed (issue 15): a master with 2 local worker processes (``--workers
2``), and a master waiting for 2 workers started elsewhere (``--expect-workers 2``), give the same
run: the same requests, each once, every one the endpoint served, all through the master."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import distributed_helpers as H
from kvbench.core import store
from kvbench.core.rows import shard_files
from kvbench.runs.locust import free_port

CONFIG = """
[suite]
name = "d"
seed = 5
results_dir = "{results}"
workloads = ["chat"]
profile = "steady"

[[endpoints]]
name = "emu"
kind = "openai"
url = "{url}"
model = "{model}"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 200
prompt_tokens = {{ dist = "constant", mean = 30 }}
output_tokens = {{ dist = "constant", mean = 4 }}

[profiles.steady]
pacing = "constant"
stages = [ {{ rate_rps = 10.0, duration_s = 2 }} ]
"""


@pytest.fixture(scope="module")
def endpoint():
    proc, url = H.start_builtin()
    yield url
    proc.terminate()
    proc.wait(10)


def kvbench(*args, timeout=180):
    return subprocess.Popen([sys.executable, "-m", "kvbench", "run", *args], cwd=H.ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_local_workers_and_expected_workers_give_the_same_run(endpoint, tmp_path):
    cfg = tmp_path / "bench.toml"
    cfg.write_text(CONFIG.format(results=tmp_path / "results", url=endpoint,
                                 model=H.model_of(endpoint)))
    before = H.served(endpoint)
    p = kvbench("--config", str(cfg), "--run-id", "local", "--workers", "2")
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 0, out[-3000:]
    served_local = H.served(endpoint) - before

    port = free_port()
    p = kvbench("--config", str(cfg), "--run-id", "remote", "--expect-workers", "2",
                "--master-bind-host", "127.0.0.1", "--master-port", str(port))
    workers = []
    for i in range(2):
        d = tmp_path / f"w{i}"
        d.mkdir()
        workers.append(H.popen(
            [sys.executable, "-m", "locust", "-f", subprocess.run(
                [sys.executable, "-m", "kvbench", "locustfile", "job"], capture_output=True,
                text=True, cwd=H.ROOT).stdout.strip(), "--worker", "--master-host",
             "127.0.0.1", "--master-port", str(port)], cwd=d, log=tmp_path / f"w{i}.log",
            env={"KVBENCH_SPOOL": str(d / "spool")}))
    try:
        out2, _ = p.communicate(timeout=180)
        for w in workers:
            w.wait(60)
    finally:
        for w in workers + [p]:
            if w.poll() is None:
                w.kill()
    assert p.returncode == 0, out2[-3000:]
    time.sleep(0.3)
    served_remote = H.served(endpoint) - before - served_local

    runs = {}
    for name, served in (("local", served_local), ("remote", served_remote)):
        res = store.load_results(tmp_path / "results" / name)
        ids = res.requests.column("request_id").to_pylist()
        assert len(ids) == len(set(ids)) == served > 0, (name, len(ids), served)
        assert set(res.requests.column("status").to_pylist()) == {"ok"}
        assert len(res.meta.workers) == 2 and not any(a["lost"]
                                                      for a in res.meta.workers.values())
        assert res.meta.stages and res.meta.stages[0].rate_rps == 10.0
        runs[name] = sorted(ids)
    assert runs["local"] == runs["remote"]  # the same requests, whichever way it ran
    # the remote workers kept nothing once the master had it all
    assert not [q for i in range(2) for q in shard_files(tmp_path / f"w{i}" / "spool",
                                                         recursive=True)]


@pytest.mark.parametrize("args, says", [
    (["--workers", "2", "--processes", "2"], "give one of them"),
    (["--master-port", "6000"], "go with --workers or --expect-workers"),
    (["--workers", "-1"], "positive count"),
    (["--expect-workers", "2"], "built-in, served on this host's loopback"),
])
def test_bad_distributed_flags_fail_before_any_load(tmp_path, capsys, args, says):
    from kvbench.cli import main

    cfg = tmp_path / "bench.toml"
    cfg.write_text((H.ROOT / "bench.toml").read_text().replace(
        'results_dir = "results"', f'results_dir = "{tmp_path / "results"}"'))
    assert main(["run", "--config", str(cfg), *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "results").exists()  # nothing ran
