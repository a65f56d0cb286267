"""Helpers of the distributed tests: a built-in endpoint and its server-side request count, a
bench.toml aimed at it, and Locust master/worker command lines with their own results dirs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "dist"
seed = 3

[[endpoints]]
name = "emu"
kind = "openai"
url = "{url}"
model = "{model}"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 400
prompt_tokens = {{ dist = "constant", mean = 30 }}
output_tokens = {{ dist = "constant", mean = 4 }}

[workloads.agent]
kind = "agent"
sessions = 6
turns = 3
system_prompt_tokens = 40
tool_schema_tokens = 40
output_tokens = {{ dist = "constant", mean = 4 }}
think_time_s = {{ dist = "constant", mean = 0.05 }}

[profiles.open]
pacing = "poisson"
stages = [ {{ rate_rps = {rate}, duration_s = {duration} }} ]
"""


def start_builtin(host: str = "127.0.0.1", netns: str | None = None):
    """The built-in colocated endpoint (time_scale small: answers fast); (proc, url)."""
    cmd = [sys.executable, "-m", "kvbench", "serve", "--topology", "colocated", "--host", host,
           "--port", "0" if netns is None else "18000"]
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"built-in endpoint did not start: {line}{proc.stderr.read()[-2000:]}")
    url = line.split("listening on", 1)[1].split()[0].rstrip("/")
    return proc, url


def served(url: str) -> int:
    """Requests the endpoint finished (its own counter: vllm:request_success_total)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return int(sum(float(m) for m in re.findall(
        r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


def model_of(url: str) -> str:
    import json

    body = urllib.request.urlopen(url + "/v1/models", timeout=10).read()
    return json.loads(body)["data"][0]["id"]


def write_config(path: Path, url: str, rate: float = 20, duration: float = 3) -> Path:
    path.write_text(CONFIG.format(url=url, model=model_of(url), rate=rate, duration=duration))
    return path


def master_cmd(config: Path, results: Path, port: int, workers: int, *extra,
               bind: str = "127.0.0.1", locustfile: str = "mix", run_id: str = "dist",
               run_time: str = "40s", users: int | None = None) -> list[str]:
    users = users or workers
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / f"{locustfile}.py"),
            "--headless",
            "--master", "--master-bind-host", bind, "--master-bind-port", str(port),
            "--expect-workers", str(workers), "-u", str(users), "-r", str(users),
            "-t", run_time, "--only-summary", "--kvbench-config", str(config),
            "--kvbench-results", str(results), "--kvbench-run-id", run_id,
            "--kvbench-endpoint", "emu", "--kvbench-ship-records", *extra]


def worker_cmd(master_host: str, port: int, locustfile: str = "mix") -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / f"{locustfile}.py"),
            "--worker",
            "--master-host", master_host, "--master-port", str(port)]


def popen(cmd, *, cwd: Path, log: Path, env: dict | None = None, netns: str | None = None):
    if netns:
        cmd = ["ip", "netns", "exec", netns] + list(cmd)
    return subprocess.Popen(cmd, cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
