"""A load process stays lean: the Locust path never imports pandas (+40 MB, and a 0.2-0.3 s
import that stalled the loop mid-run when something first needed it) nor pyarrow (about 38 MB
with its compute and Parquet modules: issue 13) while it sends, its records still reach
requests.parquet whole, and its loop-lag monitor records the largest pause per stage."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import stream_server as testing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

PROBE = '''
import json, os, sys
from kvbench.loadgen.mix import MixUser  # noqa: F401
from locust import events

@events.test_stopping.add_listener
def _probe(environment, **kw):
    ctx = environment.kvbench
    ctx.sink.flush()
    ctx.sink._pending.get()  # a batch written (and tapped) now
    ctx.live.drain()  # the live summary's derivation ran at least once
    ctx.live.summary()  # and a view of it (the web UI's)
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({"pandas": "pandas" in sys.modules, "plotly": "plotly" in sys.modules,
                   "pyarrow": "pyarrow" in sys.modules,
                   "derived": sum(ks.counts["done"] for ks in ctx.live.keys.values()),
                   "frozen": __import__("gc").get_freeze_count()}, f)
'''


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=5, itl_ms=2)
    yield url
    testing.stop(proc)


def test_load_process_never_imports_pandas_or_pyarrow(server, tmp_path):
    probe = tmp_path / "probe_locustfile.py"
    probe.write_text(PROBE)
    out = tmp_path / "probe.json"
    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(probe), "--headless", "--host", server,
         "-u", "4", "-r", "4", "-t", "3s", "--only-summary", "--kvbench-config",
         str(ROOT / "bench.toml"), "--kvbench-profile", "closed", "--kvbench-results",
         str(tmp_path / "res"), "--kvbench-run-id", "r", "--kvbench-tokenizer-check", "off"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PROBE_OUT": str(out)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got == {"pandas": False, "plotly": False, "pyarrow": False,
                   "derived": got["derived"], "frozen": got["frozen"]}
    assert got["derived"] > 0  # the live summary derived records before the probe looked
    assert got["frozen"] > 10_000  # the workload and modules were moved out of the collector's way
    run = tmp_path / "res" / "r"
    meta = json.loads((run / "run.json").read_text())
    assert meta["stages"][0]["loop_pause_max_ms"] is not None
    # every record the load process wrote (as rows, no pyarrow) is in requests.parquet
    t = read_run_table(run, "requests")
    assert t.num_rows == meta["counts"]["records_written"] > 0
    assert meta["counts"]["requests_started"] == t.num_rows
    assert len(set(t.column("request_id").to_pylist())) == t.num_rows
    assert not list(run.glob("*.rows")) and not list(run.glob("*.arrows"))  # compacted
