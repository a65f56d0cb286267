"""A load process stays lean: the Locust path never imports pandas (+40 MB, and a 0.2-0.3 s
import that stalled the loop mid-run when something first needed it) while it sends, and its
loop-lag monitor records the largest pause per stage."""

import json
import subprocess
import sys
from pathlib import Path

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
    ctx.live.drain()  # the live summary's derivation ran at least once
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({"pandas": "pandas" in sys.modules, "plotly": "plotly" in sys.modules,
                   "frozen": __import__("gc").get_freeze_count()}, f)
'''


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=5, itl_ms=2)
    yield url
    testing.stop(proc)


def test_load_process_never_imports_pandas(server, tmp_path):
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
    assert got == {"pandas": False, "plotly": False, "frozen": got["frozen"]}
    assert got["frozen"] > 10_000  # the workload and modules were moved out of the collector's way
    meta = json.loads((tmp_path / "res" / "r" / "run.json").read_text())
    assert meta["stages"][0]["loop_pause_max_ms"] is not None
