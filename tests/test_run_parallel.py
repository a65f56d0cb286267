"""``suite.parallel_endpoints``: kvbench run drives each endpoint in a lane of its own, the
endpoints at once; an interrupt stops every lane's Locust child and keeps what each recorded."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

import stream_server as testing
from kvbench.core.store import load_results, shard_files

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "lanes"
seed = 3
results_dir = "{results}"
workloads = ["chat"]
profile = "steady"
parallel_endpoints = {parallel}

[[endpoints]]
name = "a"
kind = "openai"
url = "{url}"
model = "test-model"
topology = "colocated"

[[endpoints]]
name = "b"
kind = "openai"
url = "{url}"
model = "test-model"
topology = "disaggregated"

[workloads.chat]
kind = "chat"
requests = 200
prompt_tokens = {{ dist = "constant", mean = 30 }}
output_tokens = {{ dist = "constant", mean = {tokens} }}

[profiles.steady]
pacing = "poisson"
drain_s = 1
stages = [ {{ rate_rps = 4.0, duration_s = {seconds} }} ]
"""


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=10, itl_ms=20)
    yield url
    testing.stop(proc)


def config(tmp_path, url, *, parallel=True, tokens=6, seconds=3):
    path = tmp_path / "bench.toml"
    path.write_text(CONFIG.format(results=tmp_path / "results", url=url, tokens=tokens,
                                  seconds=seconds, parallel=str(parallel).lower()))
    return path


def kvbench(cfg, *extra):
    return [sys.executable, "-m", "kvbench", "run", "--config", str(cfg), "--run-id", "r",
            *extra]


def windows(run_dir):
    """Per endpoint: (first send, last send) in ns, from the records."""
    res = load_results(run_dir)
    t = res.requests
    out = {}
    for ep in ("a", "b"):
        sent = t.filter(pc.equal(t.column("endpoint"), ep)).column("t_sent")
        out[ep] = (pc.min(sent).as_py(), pc.max(sent).as_py())
    return res, out


@pytest.mark.parametrize("parallel", [True, False], ids=["side-by-side", "in-turn"])
def test_endpoints_run_side_by_side_only_when_asked(server, tmp_path, parallel):
    p = subprocess.run(kvbench(config(tmp_path, server, parallel=parallel)), cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res, w = windows(tmp_path / "results" / "r")
    overlap = min(w["a"][1], w["b"][1]) - max(w["a"][0], w["b"][0])
    if parallel:  # each sent for ~3 s: side by side, their sends overlap for most of it
        assert overlap > 1e9, w
    else:
        assert overlap < 0, w
    assert {s.endpoint for s in res.meta.stages} == {"a", "b"}
    statuses = set(res.requests.column("status").to_pylist())
    assert statuses <= {"ok", "cancelled"}, statuses


def test_an_interrupt_stops_every_lane_and_keeps_their_records(server, tmp_path):
    cfg = config(tmp_path, server, tokens=400, seconds=120)  # ~8 s answers, a 2-min stage
    p = subprocess.Popen(kvbench(cfg), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "results" / "r"
    deadline = time.monotonic() + 90
    while len(shard_files(run_dir, "starts")) < 2:  # both lanes' children are sending
        assert time.monotonic() < deadline and p.poll() is None, "the lanes never started"
        time.sleep(0.2)
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    res = load_results(run_dir)
    assert res.meta.interrupted
    eps = set(res.requests.column("endpoint").to_pylist())
    assert eps == {"a", "b"}, out[-2000:]
    # no lane's Locust child outlives kvbench run
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


BUILTIN = """
[suite]
name = "lanes"
seed = 3
results_dir = "{results}"
workloads = ["one", "two"]
profile = "steady"
parallel_endpoints = true

[[endpoints]]
name = "a"
kind = "builtin"
topology = "colocated"
options = {{ time_scale = 0.2 }}

[[endpoints]]
name = "b"
kind = "{kind_b}"
{where_b}
topology = "colocated"

[workloads.one]
kind = "chat"
requests = 200
prompt_tokens = {{ dist = "constant", mean = 30 }}
output_tokens = {{ dist = "constant", mean = 6 }}

[workloads.two]
kind = "chat"
requests = 200
prompt_tokens = {{ dist = "constant", mean = 40 }}
output_tokens = {{ dist = "constant", mean = 6 }}

[profiles.steady]
pacing = "poisson"
drain_s = 1
stages = [ {{ rate_rps = 4.0, duration_s = 6 }} ]
"""


def test_builtin_workloads_run_side_by_side_on_servers_of_their_own(server, tmp_path):
    """Side by side, a built-in endpoint's workloads each get a server of their own and run at
    once (the default bake-off's searches need the time); an endpoint at a URL keeps its
    workloads in turn on its one server."""
    cfg = tmp_path / "bench.toml"
    cfg.write_text(BUILTIN.format(results=tmp_path / "results", kind_b="openai",
                                  where_b=f'url = "{server}"\nmodel = "test-model"'))
    p = subprocess.run(kvbench(cfg), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    t = load_results(tmp_path / "results" / "r").requests
    win = {}
    for ep in ("a", "b"):
        for wl in ("one", "two"):
            m = pc.and_(pc.equal(t.column("endpoint"), ep), pc.equal(t.column("workload"), wl))
            sent = t.filter(m).column("t_sent")
            assert len(sent) > 5, (ep, wl)
            win[ep, wl] = (pc.min(sent).as_py(), pc.max(sent).as_py())

    def overlap(x, y):
        return min(win[x][1], win[y][1]) - max(win[x][0], win[y][0])

    # (in turn, one lane's sends end before the other's begin: a negative overlap)
    assert overlap(("a", "one"), ("a", "two")) > 0, win  # built-in: both at once
    assert overlap(("b", "one"), ("b", "two")) < 0, win  # one server at a URL: in turn
