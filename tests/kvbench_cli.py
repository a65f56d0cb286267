"""Running ``kvbench run`` as a user does, for the end-to-end tests: a config written to a
temporary folder, the CLI in a child process, its records read back by the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_config(folder: Path, config: str, run_id: str, timeout_s: float = 240.0):
    """Write ``config`` (``@RESULTS@`` replaced by ``folder``/results) and run it; (the run's
    directory, its console output). A non-zero exit fails the calling test with the output."""
    cfg = folder / "bench.toml"
    cfg.write_text(config.replace("@RESULTS@", str(folder / "results")))
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", run_id], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout_s)
    assert p.returncode == 0, p.stdout + p.stderr
    return folder / "results" / run_id, p.stdout


def tiny_chat_config(name: str, seqs: int, profiles: str, ttft_ms: float) -> str:
    """A config of one built-in colocated endpoint of ``seqs`` sequences at half the
    emulator's time scale and a chat workload of fixed lengths (64 -> 32 tokens), whose
    capacity follows from the queue model; ``profiles``: the [profiles.*] tables, the first
    the suite's. ``@RESULTS@`` stands for the results folder (``run_config``)."""
    first = profiles.split("[profiles.", 1)[1].split("]", 1)[0]
    return f"""
[suite]
name = "{name}"
results_dir = "@RESULTS@"
workloads = ["chat"]
profile = "{first}"

[[endpoints]]
name = "tiny"
kind = "builtin"
topology = "colocated"
options = {{ max_num_seqs = {seqs}, replicas = 1, time_scale = 0.5 }}

[workloads.chat]
kind = "chat"
requests = 2000
prompt_tokens = {{ dist = "constant", mean = 64 }}
output_tokens = {{ dist = "constant", mean = 32 }}

{profiles}

[slo.chat]
ttft_ms = {ttft_ms:g}
"""
