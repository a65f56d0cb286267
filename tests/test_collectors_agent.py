"""The remote collector agent and the puller on 127.0.0.1, with the FAKE NVML of
tests/fake_nvml.py; the agent's clock is skewed to check the offset estimate."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pyarrow as pa
import pytest

from kvbench.collectors.agent import AgentPuller, AgentServer, is_loopback
from kvbench.config import GpuRole
from kvbench.core.errors import UserError
from kvbench.core.schema import GPU
from fake_nvml import FakeGpu, FakeNvml

SKEW_NS = 5_000_000_000  # the agent's clock runs 5 s ahead
TOKEN = "test-agent-token-0123456789"  # at least 16 characters, as the agent asks


def test_puller_aligns_clock_and_pulls_incrementally():
    t0 = time.time_ns()
    agent = AgentServer("127.0.0.1", 0, token=TOKEN, interval_s=0.02,
                        nvml=FakeNvml([FakeGpu(), FakeGpu(gpm=False)]), log=lambda m: None,
                        clock_ns=lambda: time.time_ns() + SKEW_NS).start()
    got = []
    try:
        p = AgentPuller(agent.url, emit=got.append, token=TOKEN, interval_s=0.2,
                        roles=[GpuRole(gpus=[1], role="decode")])
        p.since_ns = t0  # the run began before the agent's first sample
        p.start()
        time.sleep(1.0)
        agent.sampler.stop()  # so that the final pull must bring every remaining row
        p.stop()
        t1 = time.time_ns()
    finally:
        agent.stop()
    t = pa.Table.from_batches(got, schema=GPU)
    assert p.failures == 0 and p.pulls >= 3
    assert p.host == agent.hostname
    # estimated offset: -5 s, within the round-trip time
    assert abs(p.offset_add_ns + SKEW_NS) <= max(p.rtt_ns, 2_000_000)
    ts = t.column("t_ns").to_pylist()
    slack = max(p.rtt_ns, 2_000_000)  # the estimate is good to about one round trip
    assert t0 - slack <= min(ts) and max(ts) <= t1 + slack  # aligned into the local window
    # no row pulled twice, none lost: one row per GPU per sampler tick
    assert t.num_rows == 2 * agent.sampler.ticks == agent.buffer.rows
    assert len(set(zip(ts, t.column("gpu").to_pylist()))) == t.num_rows
    roles = dict(zip(t.column("gpu").to_pylist(), t.column("role").to_pylist()))
    assert roles == {0: "unknown", 1: "decode"}
    assert p.telemetry() == {f"agent:{agent.url}": "ok"} and p.incomplete() == []


def test_agent_requires_token_and_reports_failures():
    agent = AgentServer("127.0.0.1", 0, token=TOKEN, interval_s=0.05,
                        nvml=FakeNvml([FakeGpu()]), log=lambda m: None).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(agent.url + "/clock", timeout=2)
        assert err.value.code == 401
        p = AgentPuller(agent.url, emit=lambda b: None, token="wrong-" + TOKEN,
                        log=lambda m: None)
        assert p.pull_once() is False and p.last_error == "HTTP 401 Unauthorized"
        assert "no successful pull" in p.telemetry()[f"agent:{agent.url}"]
        req = urllib.request.Request(agent.url + "/samples?after=0&format=parquet",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        time.sleep(0.6)
        with urllib.request.urlopen(req, timeout=2) as resp:
            import io

            import pyarrow.parquet as pq
            tab = pq.read_table(io.BytesIO(resp.read()))
        assert tab.schema.equals(GPU) and tab.num_rows >= 1
    finally:
        agent.stop()


def test_agent_without_nvml_is_reachable_and_says_why():
    import pynvml

    agent = AgentServer("127.0.0.1", 0, nvml=FakeNvml([], pynvml.NVML_ERROR_DRIVER_NOT_LOADED),
                        log=lambda m: None).start()
    try:
        p = AgentPuller(agent.url, emit=lambda b: None, log=lambda m: None)
        agent.sampler.wait_ready(5)
        assert p.pull_once() and p.rows == 0
        assert "the NVIDIA driver is not loaded" in p.telemetry()[f"agent:{agent.url}"]
    finally:
        agent.stop()


def test_unreachable_agent_is_recorded_not_raised():
    p = AgentPuller("http://127.0.0.1:9", emit=lambda b: None, log=lambda m: None)
    assert p.pull_once() is False and p.failures == 1
    assert p.incomplete()[0].what == "pulls from collector agent http://127.0.0.1:9"


def test_non_loopback_without_token_is_refused():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("gpu-node-1")
    with pytest.raises(UserError, match="without a token"):
        AgentServer("0.0.0.0", 0)
    env = {"PATH": "/usr/bin:/bin", "KVBENCH_AGENT_TOKEN": ""}
    out = subprocess.run([sys.executable, "-m", "kvbench", "collect", "--listen", "0.0.0.0:0"],
                         capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("kvbench: error: kvbench collect: refusing to listen")
    assert "Traceback" not in out.stderr


def test_kvbench_collect_cli_serves_and_stops_on_sigterm():
    import os
    import signal

    env = {**os.environ, "KVBENCH_AGENT_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "collect", "--listen",
                             "127.0.0.1:0", "--interval-s", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("kvbench collect: listening on http://127.0.0.1:"), line
        assert "bearer token required" in line
        url = line.split(" on ")[1].split(" ")[0]
        p = AgentPuller(url, emit=lambda b: None, token=TOKEN, log=lambda m: None)
        assert p.pull_once(), p.last_error
        assert p.agent_status["host"] == p.host
        status = p.agent_status["nvml"]
        assert ("nvml: " + status) in line  # "ok" on a GPU host, the reason elsewhere
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
    assert rc == 0


def test_puller_notices_an_agent_restart():
    nv = FakeNvml([FakeGpu()])
    agent = AgentServer("127.0.0.1", 0, interval_s=0.02, nvml=nv, log=lambda m: None).start()
    got = []
    p = AgentPuller(agent.url, emit=got.append, log=lambda m: None)
    p.since_ns = 0
    try:
        time.sleep(0.6)
        assert p.pull_once() and p.pull_once()
        time.sleep(0.6)
        assert p.pull_once() and p.seq >= 2
    finally:
        agent.stop()
    port = agent.port
    agent = AgentServer("127.0.0.1", port, interval_s=0.02, nvml=FakeNvml([FakeGpu()]),
                        log=lambda m: None).start()
    try:
        time.sleep(0.6)
        before = p.rows
        assert p.pull_once() and p.restarts == 1 and p.seq == 0
        assert p.pull_once() and p.rows > before  # the new agent's rows arrive
    finally:
        agent.stop()
    assert "restarted 1 time" in p.incomplete()[0].why


def test_a_pull_that_never_ends_is_cut_not_held(monkeypatch):
    """Something at the agent's address that answers /samples without end (as fast as the
    socket takes it) costs one failed pull within its deadline and a bounded buffer: the
    puller records the failure and goes on, its memory never the stream's length."""
    import http.server
    import threading

    from kvbench.collectors import agent as A

    class Endless(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()
            chunk = b"x" * 65536
            try:
                while True:
                    self.wfile.write(chunk)
            except OSError:
                pass

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(A, "PULL_MAX_BYTES", 4 << 20)
    try:
        p = AgentPuller(f"http://127.0.0.1:{srv.server_port}", emit=lambda b: None,
                        log=lambda m: None, timeout_s=30.0)
        assert p.pull_once() is False and p.failures == 1
        assert "4,194,304 bytes" in p.last_error, p.last_error
    finally:
        srv.shutdown()
        srv.server_close()
