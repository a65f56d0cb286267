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
                 "kvbench/collectors/nvml.py", "kvbench/reports/rendering/templates/report.html.j2",
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


def test_the_wheel_alone_reports_and_ships_its_locustfiles(wheel, tmp_path):
    """Run from the unpacked wheel, away from the checkout: templates and locustfiles are found
    inside the package (a loader naming the checkout's folders would fail here)."""
    from synthetic import RunShape, run_meta, synth_table, write_run

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    table, stages = synth_table(RunShape(requests_per_stage=50))
    run = write_run(tmp_path / "run", table, run_meta(RunShape(), stages))
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def kvbench(*args):
        return subprocess.run([sys.executable, "-m", "kvbench", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    p = subprocess.run([sys.executable, "-c", "import kvbench.reports.rendering.render as r; "
                        "print(r.__file__)"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.stdout.strip().startswith(str(site)), p.stdout + p.stderr
    p = kvbench("report", str(run), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    assert "<html" in (tmp_path / "r.html").read_text()[:2000].lower()
    p = kvbench("locustfile", "longctx")
    assert p.returncode == 0, p.stderr
    path = Path(p.stdout.strip())
    assert path.is_file() and path.is_relative_to(site) and "KVBenchUser" in path.read_text()


PRODUCT = ("kvbench", "loadgen", "workloads", "collectors", "reports", "endpoints")


def test_no_product_file_is_several_things_at_once():
    """No product module over 700 lines; one kept whole above 400 lines says why in its first
    lines ("Above 400 lines: ...", "Over 400 lines, kept whole: ...")."""
    import re

    said = re.compile(r"(over|above) 400 lines", re.I)
    long, unexplained = [], []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            lines = path.read_text().splitlines()
            name = str(path.relative_to(ROOT))
            if len(lines) > 700:
                long.append(f"{name} ({len(lines)} lines)")
            elif len(lines) > 400 and not said.search("\n".join(lines[:12])):
                unexplained.append(f"{name} ({len(lines)} lines)")
    assert not long, f"over 700 lines: {long}"
    assert not unexplained, f"over 400 lines without a word on why in the first lines: {unexplained}"


OLD_PATHS = {  # module paths of 9132982 whose modules moved into sub-packages
    "kvbench.loadgen.client": "kvbench.loadgen.timing.client",
    "kvbench.loadgen.sse": "kvbench.loadgen.timing.sse",
    "kvbench.loadgen.sink": "kvbench.loadgen.timing.sink",
    "kvbench.loadgen.context": "kvbench.loadgen.wiring.context",
    "kvbench.loadgen.hooks": "kvbench.loadgen.wiring.hooks",
    "kvbench.loadgen.distributed": "kvbench.loadgen.fleet.distributed",
    "kvbench.loadgen.live": "kvbench.loadgen.liveview.live",
    "kvbench.loadgen.pacing": "kvbench.loadgen.plan.pacing",
    "kvbench.reports.metrics": "kvbench.reports.statistics.metrics",
    "kvbench.reports.frame": "kvbench.reports.measures.frame",
    "kvbench.reports.capacity": "kvbench.reports.analysis.capacity",
    "kvbench.reports.gate": "kvbench.reports.analysis.gate",
    "kvbench.reports.diagnose": "kvbench.reports.analysis.diagnose",
    "kvbench.reports.render": "kvbench.reports.rendering.render",
}


def test_old_module_paths_import_as_the_moved_modules():
    """A user's locustfile or script written against the flat loadgen/ and reports/ keeps
    working, and reaches the very module the package uses (a patch through one path is seen
    through the other), in a fresh interpreter importing the old path first."""
    code = ("import importlib, sys\n"
            f"pairs = {OLD_PATHS!r}\n"
            "for old, new in pairs.items():\n"
            "    m = importlib.import_module(old)\n"
            "    assert m is importlib.import_module(new) is sys.modules[old], old\n"
            "from kvbench.loadgen.client import StreamingClient\n"
            "from kvbench.reports.render import render_md\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
