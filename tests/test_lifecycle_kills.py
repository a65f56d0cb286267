"""Kills: ``kvbench run`` leaves no process behind whatever the signal (its built-in server,
its Locust child and that child's --processes workers), writes run.json marked interrupted on
SIGINT/SIGTERM/SIGHUP; after a SIGKILL of a load process its requests in flight come back as
``cancelled`` records (the starts written as they are sent), and ``kvbench report`` recovers
the run by itself."""

import collections
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pyarrow.compute as pc
import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

import stream_server as testing
from kvbench.core.store import KILLED_IN_FLIGHT, load_results, shard_files

ROOT = Path(__file__).resolve().parent.parent
RATE_RPS = 8

CONFIG = """
[suite]
name = "kills"
results_dir = "{results}"
workloads = ["chat"]
profile = "closed"

[[endpoints]]
name = "builtin"
kind = "builtin"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 50
prompt_tokens = {{ dist = "constant", mean = 64 }}
output_tokens = {{ dist = "constant", mean = 64 }}

[profiles.closed]
pacing = "closed"
stages = [ {{ users = 4, duration_s = 300 }} ]
"""


def _wait_for(cond, what, timeout_s=120.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def _alive(procs):
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_kvbench_run_leaves_no_process_behind(tmp_path, sig):
    """Before: SIGTERM, SIGHUP and SIGKILL left kvbench serve and the Locust master and workers
    running (4 processes, the load going on); no run.json."""
    cfg = tmp_path / "bench.toml"
    cfg.write_text(CONFIG.format(results=tmp_path / "results"))
    run = subprocess.Popen([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                            "--run-id", "r", "--processes", "2"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "results" / "r"
    me = psutil.Process(run.pid)
    try:
        # serve + Locust master + 2 workers, and both workers have sent requests
        _wait_for(lambda: len(shard_files(run_dir, "starts")) == 2, "the load")
        children = me.children(recursive=True)
        assert len(children) >= 4, [c.cmdline() for c in children]
        run.send_signal(sig)
        out, _ = run.communicate(timeout=120)
        t_exit = time.monotonic()
        # SIGKILL: the children are told by the kernel (parent death signal) and stop
        _wait_for(lambda: not _alive(children), "the children to end", timeout_s=60)
        print(f"{signal.Signals(sig).name}: children gone {time.monotonic() - t_exit:.1f} s "
              "after kvbench run ended")
    finally:
        for p in _alive(me.children(recursive=True) if run.poll() is None else []):
            p.kill()
        if run.poll() is None:
            run.kill()
    if sig == signal.SIGKILL:
        assert run.returncode == -signal.SIGKILL and not (run_dir / "run.json").exists()
        p = subprocess.run([sys.executable, "-m", "kvbench", "recover", str(run_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
    else:
        assert run.returncode == 128 + sig, out[-3000:]
        assert "INTERRUPTED" in out and "cancelled at the stop" in out
    res = load_results(run_dir)
    assert res.meta.interrupted and res.meta.incomplete[0].what == "the run"
    if sig != signal.SIGKILL:
        assert signal.Signals(sig).name in res.meta.interruption
    assert res.requests.num_rows >= 2
    assert not shard_files(run_dir)  # compacted


def _seen(url, log):
    """Accumulate the test server's log of requests (each request once it ended)."""
    log.update(json.loads(urllib.request.urlopen(url + "/log").read()))
    return len(log)


def test_sigkill_of_the_load_process_loses_at_most_a_second(tmp_path):
    """Before: 6 records of the 33 requests the server saw (those in flight left no trace)."""
    proc, url = testing.start(ttft_ms=200, itl_ms=50)
    log: dict = {}
    try:
        cfg = tmp_path / "bench.toml"
        cfg.write_text(CONFIG.replace('kind = "builtin"', f'kind = "openai"\nurl = "{url}"\n'
                                      'model = "test-model"').format(results=tmp_path))
        load = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", "loadgen/mix.py", "--headless", "--host",
             url, "-u", "1", "-r", "1", "-t", "300s", "--only-summary", "--kvbench-config",
             str(cfg), "--kvbench-endpoint", "builtin", "--kvbench-workload", "chat",
             "--kvbench-results", str(tmp_path), "--kvbench-run-id", "k", "--kvbench-pacing",
             "constant", "--kvbench-rates", str(RATE_RPS)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run_dir = tmp_path / "k"
        # 64 tokens at 50 ms: ~3.4 s a request, so ~27 are in flight at any moment
        _wait_for(lambda: _starts(run_dir) >= 5 * RATE_RPS, "40 requests sent")
        load.send_signal(signal.SIGKILL)
        load.wait()
        before = -1
        while before != _seen(url, log):  # the server ends the streams of the dead client
            before = len(log)
            time.sleep(1.0)
    finally:
        testing.stop(proc)
    p = subprocess.run([sys.executable, "-m", "kvbench", "report", str(run_dir), "--format",
                        "md"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "recovered" in p.stderr
    res = load_results(run_dir)
    t = read_run_table(run_dir, "requests")
    status = collections.Counter(zip(t.column("status").to_pylist(), t.column("error").to_pylist()))
    print(f"server saw {len(log)}, records {t.num_rows}: {dict(status)}")
    assert t.num_rows >= len(log) - RATE_RPS  # at most one second's worth lost
    assert status[("ok", None)] <= len(log)
    assert status[("cancelled", KILLED_IN_FLIGHT)] >= RATE_RPS  # those in flight came back
    assert res.meta.interrupted and "killed" in res.meta.interruption
    assert res.meta.counts["in_flight_at_kill"] == status[("cancelled", KILLED_IN_FLIGHT)]
    lost = t.filter(pc.equal(t.column("error"), KILLED_IN_FLIGHT))
    assert lost.column("t_sent").null_count == 0  # with their send times
    assert pc.min(lost.column("t_sent")).as_py() >= pc.min(t.column("t_scheduled")).as_py()
    (stage,) = res.meta.stages
    assert stage.partial and stage.rate_rps == RATE_RPS


def _starts(run_dir: Path) -> int:
    from kvbench.core.store import read_starts

    return read_starts(run_dir).num_rows if run_dir.exists() else 0
