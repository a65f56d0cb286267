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
