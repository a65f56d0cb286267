"""``kvbench run``'s input that must be refused before anything is written (issue 32): run ids
that leave the results folder or land on the store's own folders, results folders that are
URLs; and the exit code a nightly job can trust when a job ended incomplete."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stream_server as testing
from kvbench.cli import main
from kvbench.core.paths import run_id_problem
from kvbench.core.errors import INCOMPLETE_EXIT
from kvbench.core.store import load_results, shard_files

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "inputs"
results_dir = "{results}"
workloads = ["chat"]
profile = "steady"

[[endpoints]]
name = "test"
kind = "openai"
url = "{url}"
model = "test-model"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 400
prompt_tokens = {{ dist = "constant", mean = 30 }}
output_tokens = {{ dist = "constant", mean = {tokens} }}

[profiles.steady]
pacing = "poisson"
drain_s = 1
stages = [ {{ rate_rps = 4.0, duration_s = {seconds} }} ]
"""


def write(tmp_path, url="http://127.0.0.1:9", tokens=6, seconds=2):
    cfg = tmp_path / "cfg" / "bench.toml"
    cfg.parent.mkdir(exist_ok=True)
    cfg.write_text(CONFIG.format(results=tmp_path / "results", url=url, tokens=tokens,
                                 seconds=seconds))
    return cfg


def files_under(tmp_path) -> list[str]:
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("run_id", ["../../escaped", "../escaped", "a/b", "/tmp/abs-run",
                                    "..", ".", "history", "latest", "History", "last-pass", ".hidden",
                                    "", "x" * 65, "with space"])
def test_a_bad_run_id_is_one_sentence_and_writes_nothing(tmp_path, capsys, monkeypatch,
                                                         run_id):
    """Before: ../../escaped and absolute ids wrote outside the results folder, and history
    landed in the gate's history store."""
    cfg = write(tmp_path)
    monkeypatch.chdir(tmp_path / "cfg")
    before = files_under(tmp_path)
    rc = main(["run", "--config", str(cfg), "--run-id", run_id])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "--run-id" in err, err
    assert files_under(tmp_path) == before  # no results folder, no run folder
    assert not Path("/tmp/abs-run").exists()


@pytest.mark.parametrize("url", ["s3://bucket/prefix", "gs://bucket", "http://host/x",
                                 "S3://bucket", "file:///tmp/x"])
def test_results_dir_with_a_url_scheme_is_one_sentence_and_writes_nothing(
        tmp_path, capsys, monkeypatch, url):
    """Before: --results-dir s3://bucket/prefix made a local folder named s3:."""
    cfg = write(tmp_path)
    monkeypatch.chdir(tmp_path / "cfg")
    before = files_under(tmp_path)
    rc = main(["run", "--config", str(cfg), "--results-dir", url, "--run-id", "ok"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "--results-dir" in err and url in err, err
    assert files_under(tmp_path) == before


@given(st.text(min_size=0, max_size=80))
@settings(max_examples=300, deadline=None)
def test_an_accepted_run_id_stays_a_plain_folder_of_the_results(text):
    if run_id_problem(text) is not None:
        return
    base = Path("/srv/results")
    resolved = (base / text).resolve()
    assert resolved.parent == base and resolved.name == text
    assert text.lower() not in ("history", "latest", "last-pass")


@pytest.mark.parametrize("run_id", ["nightly-2026-12-03", "r", "20261203T000000Z-x-0001",
                                    "a.b_c-1"])
def test_plain_run_ids_are_accepted(run_id):
    assert run_id_problem(run_id) is None


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=10, itl_ms=20)
    yield url
    testing.stop(proc)


def _locust_children(run_dir: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_a_killed_locust_child_is_a_non_zero_exit_with_the_reason_last(server, tmp_path):
    """Before: kvbench run exited 0 though run.json said "locust exited with code -9"."""
    cfg = write(tmp_path, server, tokens=200, seconds=300)  # ~4 s answers, a 5-min stage
    run = subprocess.Popen([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                            "--run-id", "r"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "results" / "r"
    try:
        deadline = time.monotonic() + 240  # generous: a busy 2-core machine starts slowly
        while not shard_files(run_dir, "starts"):  # the Locust child is sending
            assert time.monotonic() < deadline and run.poll() is None, "the load never started"
            time.sleep(0.2)
        time.sleep(1.0)
        children = _locust_children(run_dir)
        assert children, "no Locust child found"
        for pid in children:  # Locust and its own processes, all started by this test's run
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == INCOMPLETE_EXIT, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "incomplete" in last.lower() and "locust exited with code -9" in last, out[-3000:]
    meta = load_results(run_dir).meta
    assert any("locust exited with code -9" in i.why for i in meta.incomplete)
    assert _locust_children(run_dir) == []


def test_a_complete_run_still_exits_0(server, tmp_path):
    cfg = write(tmp_path, server, tokens=4, seconds=1.5)
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", "ok"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "incomplete" not in p.stdout.lower() + p.stderr.lower()
