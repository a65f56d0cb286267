"""Test-wide setup: the fakes in this folder (stream_server, synthetic, fake_nvml, ...) are
importable by the subprocesses tests start, as they are by the tests themselves."""

import os
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_TESTS, os.environ.get("PYTHONPATH", "")) if p)
