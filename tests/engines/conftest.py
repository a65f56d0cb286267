"""Real engines for the tests in this folder: a vLLM CPU server and a llama.cpp llama-server on
127.0.0.1, started once per module from the cache ``setup_engines.py`` fills. A test whose
engine is not installed there is skipped with the command that installs it."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import setup_engines as E  # noqa: E402

START_TIMEOUT_S = 240  # vLLM CPU starts in about 55-75 s on a quiet core
SERVED_MODEL = E.SERVED_MODEL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            pytest.fail(f"the engine exited with code {proc.returncode}; its log "
                        f"{log}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    proc.terminate()
    pytest.fail(f"the engine did not answer /v1/models within {START_TIMEOUT_S} s; {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """(url, otlp port): vLLM with its dev-mode API (cache reset), usage cached tokens and
    OTLP/HTTP traces to a port the test's kvbench run listens on."""
    if not (E.vllm_ready() and E.model_ready()):
        pytest.skip(f"vLLM CPU not installed under {E.CACHE}: run `.venv/bin/python "
                    "tests/engines/setup_engines.py vllm model` (about 2 minutes, 3.4 GB)")
    port, otlp = free_port(), free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [E.vllm_bin(), "serve", E.MODEL_DIR, "--served-model-name", SERVED_MODEL,
             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
             "--enable-prefix-caching", "--enable-prompt-tokens-details",
             "--num-gpu-blocks-override", "64",
             "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp}/v1/traces"],
            stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log)
        yield url, otlp
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    """(url, log): llama-server with two slots (each holds one prompt: room for both of the
    test workload's documents), its slot-erase call (--slot-save-path) and no host-RAM prompt
    cache (--cache-ram 0: an erased prompt would come back from it); the log has its timings."""
    gguf = E.gguf_path()
    if not E.llamacpp_ready():
        pytest.skip(f"llama-server not built under {E.CACHE}: run `.venv/bin/python "
                    "tests/engines/setup_engines.py llamacpp` (about 8 minutes on 2 cores)")
    port = free_port()
    tmp = tmp_path_factory.mktemp("llama")
    log = tmp / "llama.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [E.llama_server_bin(), "-m", gguf, "--alias", SERVED_MODEL, "--host", "127.0.0.1",
             "--port", str(port), "-c", "8192", "-np", "2", "--metrics",
             "--slot-save-path", tmp, "--cache-ram", "0"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log)
        yield url, log
    finally:
        stop(proc)
