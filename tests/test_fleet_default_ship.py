"""Plain Locust master/workers keep every record with no kvbench flag (issue 33): a master and
two workers, each in its own working directory with the results directory named relatively (so
a worker writing "there" writes to its own folder, as on another host), hold one record per
request the built-in endpoint served; on a shared disk (an absolute results directory) the
records are not doubled; and when records cannot arrive (shipping turned off, private
folders) the master exits non-zero with one sentence instead of 0 with 0 records."""

from __future__ import annotations

import sys

import pytest

import distributed_helpers as H
from kvbench.core import store
from kvbench.core.rows import shard_files
from kvbench.runs.locust import free_port


@pytest.fixture(scope="module")
def endpoint():
    proc, url = H.start_builtin()
    yield url
    proc.terminate()
    proc.wait(10)


def _master(config, results: str, port: int, *extra) -> list[str]:
    """The master as a Locust user types it: no ship flag, no run id (``config`` None: no
    --kvbench-config, the master's ./bench.toml)."""
    given = ["--kvbench-config", str(config)] if config is not None else []
    return [sys.executable, "-m", "locust", "-f", str(H.ROOT / "loadgen" / "mix.py"),
            "--headless", "--master", "--master-bind-host", "127.0.0.1",
            "--master-bind-port", str(port), "--expect-workers", "2", "-u", "2", "-r", "2",
            "-t", "40s", "--only-summary", *given,
            "--kvbench-results", results, "--kvbench-endpoint", "emu",
            "--kvbench-workload", "chat", "--kvbench-profile", "open", *extra]


def _run(tmp_path, url, results: str, *extra, worker_results: bool = True,
         here_config: bool = False):
    master_dir, w_dirs = tmp_path / "master", [tmp_path / "w1", tmp_path / "w2"]
    for d in [master_dir] + w_dirs:
        d.mkdir()
    cfg = H.write_config(master_dir / "bench.toml", url, rate=12, duration=3)
    if here_config:  # each worker's folder holds a bench.toml of its own: other prompts
        for d in w_dirs:
            (d / "bench.toml").write_text(cfg.read_text().replace("mean = 30", "mean = 90"))
    port = free_port()
    before = H.served(url)
    m = H.popen(_master(None if here_config else cfg, results, port, *extra), cwd=master_dir,
                log=tmp_path / "master.log")
    ws = []
    for i, d in enumerate(w_dirs):
        # one worker names a private results folder of its own, the other none
        own = ["--kvbench-results", str(d / "own")] if worker_results and i == 0 else []
        ws.append(H.popen(H.worker_cmd("127.0.0.1", port) + own, cwd=d,
                          log=tmp_path / f"{d.name}.log",
                          env={"KVBENCH_SPOOL": str(d / "spool")}))
    try:
        rc = m.wait(150)
        for w in ws:
            w.wait(60)
    finally:
        for p in [m] + ws:
            if p.poll() is None:
                p.kill()
    import time

    time.sleep(0.3)  # the endpoint counts a request once its stream is done
    log = (tmp_path / "master.log").read_text()
    return rc, log, H.served(url) - before, master_dir, w_dirs


def _run_dir(results):
    runs = [p.parent for p in results.glob("*/run.json")]
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.parametrize("disk", ["private", "shared"])
def test_plain_master_and_two_workers_keep_every_served_request(endpoint, tmp_path, disk):
    # private: "results" is each process's own folder; shared: one absolute path for all
    results = "results" if disk == "private" else str(tmp_path / "master" / "results")
    rc, log, served, master_dir, w_dirs = _run(tmp_path, endpoint, results)
    assert rc == 0, log[-3000:]
    run_dir = _run_dir(master_dir / "results")
    ids = store.read_table(run_dir, "requests", columns=["request_id"]).column(
        "request_id").to_pylist()
    assert len(ids) == len(set(ids)) == served > 10, log[-3000:]  # once each, never doubled
    meta = store.load_results(run_dir).meta
    assert len(meta.workers) == 2 and not any(a["lost"] for a in meta.workers.values())
    for d in w_dirs:  # nothing of the run was left on a worker's own disk
        assert not shard_files(d, recursive=True) and not list(d.rglob("*.parquet")), \
            sorted(str(p) for p in d.rglob("*"))


def test_records_that_cannot_arrive_end_non_zero_with_one_sentence(endpoint, tmp_path):
    rc, log, served, master_dir, _ = _run(tmp_path, endpoint, "results",
                                          "--kvbench-no-ship-records", worker_results=False)
    assert served > 10
    assert rc != 0, log[-3000:]
    line = next((ln for ln in log.splitlines() if "holds no record" in ln), None)
    assert line is not None, log[-3000:]
    assert "the workers sent" in line and "--kvbench-no-ship-records" in line
    assert "Traceback" not in log


def test_the_masters_own_bench_toml_is_the_one_its_workers_use(endpoint, tmp_path):
    """A master started beside a bench.toml (no --kvbench-config) sends its text to the
    workers, as it does an explicit config's: workers in folders with a bench.toml of their
    own (30-token prompts at the master, 90 in theirs) send the master's workload."""
    rc, log, served, master_dir, _ = _run(tmp_path, endpoint, "results", here_config=True)
    assert rc == 0, log[-3000:]
    run_dir = _run_dir(master_dir / "results")
    t = store.read_table(run_dir, "requests", columns=["request_class", "prompt_tokens_client"])
    chat = [n for c, n in zip(t.column("request_class").to_pylist(),
                              t.column("prompt_tokens_client").to_pylist()) if c == "chat"]
    assert len(chat) == served > 10, log[-3000:]
    assert max(chat) < 60, sorted(set(chat))  # the master's 30-token prompts, never 90
