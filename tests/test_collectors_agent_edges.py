"""The collector agent under hostile or careless input, on 127.0.0.1 only: weak tokens are
refused at start, an aborted connection is one log line (no traceback), and idle or trickling
connections are closed after a bound (small bounds set here; generous waits, no tight timing)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from kvbench.collectors.agent import AgentServer
from kvbench.core.errors import UserError
from fake_nvml import FakeGpu, FakeNvml

STRONG = "k" * 8 + "V" * 8 + "-0123"  # 21 characters


def _collect(env_extra: dict, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "kvbench", "collect", "--listen", "127.0.0.1:0",
                           *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("token", ["", "   ", "x", "short-token"])
def test_weak_token_is_refused_at_start_in_one_sentence(token):
    out = _collect({"KVBENCH_AGENT_TOKEN": token})
    assert out.returncode == 2, out
    err = out.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("kvbench: error: kvbench collect: refusing to listen"), err
    assert "$KVBENCH_AGENT_TOKEN" in err and "at least 16 characters" in err
    assert "short-token" not in err  # the value is never echoed
    assert out.stdout == ""


def test_weak_token_names_the_variable_given_by_token_env():
    out = _collect({"MY_AGENT_SECRET": "abc"}, "--token-env", "MY_AGENT_SECRET")
    assert out.returncode == 2 and "$MY_AGENT_SECRET" in out.stderr
    assert "'abc'" not in out.stderr and "abc" not in out.stderr  # the value is never echoed


def test_weak_or_spaced_token_is_refused_by_the_server_itself():
    for token in ("", "1", "a" * 15, " " + "a" * 20, "a" * 10 + " " + "b" * 10, "é" * 20):
        with pytest.raises(UserError, match="at least 16 characters"):
            AgentServer("127.0.0.1", 0, token=token, nvml=FakeNvml([]), log=lambda m: None)
    AgentServer("127.0.0.1", 0, token="a" * 16, nvml=FakeNvml([]), log=lambda m: None)


def _reset(sock: socket.socket) -> None:
    """Closes with an RST (SO_LINGER 0): the peer's next read fails with ECONNRESET."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_each_aborted_connection_is_one_log_line_without_traceback():
    env = {**os.environ, "KVBENCH_AGENT_TOKEN": STRONG}
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "collect", "--listen",
                             "127.0.0.1:0", "--interval-s", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    n = 12
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("kvbench collect: listening on http://127.0.0.1:"), line
        port = int(line.split(" on ")[1].split(" ")[0].rsplit(":", 1)[1])
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /clock HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finish
            time.sleep(0.1)  # the agent is reading this request
            _reset(s)
        time.sleep(1.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert "Traceback" not in err, err
    aborted = [ln for ln in err.splitlines() if "aborted" in ln]
    assert len(aborted) == n, err
    assert all(ln.startswith("kvbench collect: connection from 127.0.0.1:") for ln in aborted)
    assert STRONG not in err


def _agent(logs: list[str], **kw) -> AgentServer:
    return AgentServer("127.0.0.1", 0, interval_s=0.5, nvml=FakeNvml([FakeGpu()]),
                       log=logs.append, **kw).start()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the agent closes ``sock`` (FIN or RST) within ``seconds``; reads what comes."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_idle_connection_is_closed_after_the_idle_timeout():
    logs: list[str] = []
    agent = _agent(logs, idle_timeout_s=0.5, request_timeout_s=1.0)
    try:
        quiet = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        kept = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        kept.sendall(b"GET /clock HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # keep-alive
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(quiet, 15)  # never sent a byte
        assert _closed_within(kept, 15)  # idle after a complete request
        quiet.close()
        kept.close()
    finally:
        agent.stop()
    assert not [m for m in logs if "connection from" in m]  # an idle close is routine


def test_trickling_request_is_closed_and_logged_once():
    logs: list[str] = []
    agent = _agent(logs, idle_timeout_s=5.0, request_timeout_s=1.0)
    stop = threading.Event()
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)

    def trickle():  # one byte every 0.1 s: each read is quick, the request never completes
        data = b"GET /clock HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 10_000
        for i in range(len(data)):
            if stop.wait(0.1):
                return
            try:
                sock.send(data[i:i + 1])
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        assert _closed_within(sock, 20)
    finally:
        stop.set()
        t.join(5)
        sock.close()
        time.sleep(0.3)
        agent.stop()
    lines = [m for m in logs if "connection from 127.0.0.1:" in m]
    assert len(lines) == 1 and "1 s" in lines[0], logs


def test_collect_cli_takes_the_timeouts():
    out = _collect({"KVBENCH_AGENT_TOKEN": STRONG}, "--idle-timeout-s", "0")
    assert out.returncode == 2 and "--idle-timeout-s 0.0 must be above 0" in out.stderr
    out = _collect({"KVBENCH_AGENT_TOKEN": STRONG}, "--request-timeout-s", "-1")
    assert out.returncode == 2 and "--request-timeout-s -1.0 must be above 0" in out.stderr


def test_request_announcing_a_body_is_answered_and_its_connection_closed():
    logs: list[str] = []
    agent = _agent(logs, idle_timeout_s=60.0, request_timeout_s=60.0)
    try:
        s = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        s.sendall(b"GET /clock HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\nab")
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" in head
        assert _closed_within(s, 15)  # not left waiting for a body nobody reads
        s.close()
    finally:
        agent.stop()
