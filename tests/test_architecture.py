"""The package as shipped: the wheel adds one top-level name, ``kvbench``, and its modules keep
the layering contracts of pyproject.toml (import-linter, on the wheel's own layout, where the
card's top-level folders sit inside kvbench/)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # build from a copy: setuptools' in-tree build/ could carry files deleted since
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "*.egg-info", "results", "__pycache__",
        ".hypothesis", ".pytest_cache", "test-artifacts"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                        str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    (whl,) = out.glob("kvbench-*.whl")
    return whl


def test_wheel_adds_only_kvbench_at_top_level(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"kvbench"}, sorted(tops)
    # the card's folders are inside the namespace, the locustfiles and templates with them
    for path in ("kvbench/loadgen/longctx.py", "kvbench/workloads/traces/mooncake.py",
                 "kvbench/collectors/nvml.py", "kvbench/reports/templates/report.html.j2",
                 "kvbench/endpoints/server.py", "kvbench/core/store.py"):
        assert path in names, path
    assert not [n for n in names if n.startswith("kvbench/tests/") or "/testing.py" in n]


def test_layering_contracts_hold_on_the_shipped_package(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    lint = Path(sys.executable).with_name("lint-imports")
    # run from the unpacked wheel (import-linter puts the working directory first on sys.path)
    p = subprocess.run([str(lint), str(ROOT / "pyproject.toml")], cwd=site,
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "BROKEN" not in p.stdout
