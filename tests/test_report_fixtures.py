"""The Markdown report of committed results is the same, byte for byte, as the kvbench that wrote
them rendered it: a refactor of the store, the run contract or the report cannot change what a
user reads without this test saying so.

``tests/data/runs/`` holds two real runs of the built-in endpoints (records, telemetry, engine
samples and run.json as ``kvbench run`` wrote them at commit 9132982):

* ``search``: the default bake-off's capacity search on the mix (``[profiles.search]`` from
  7 req/s, 40 s budget per endpoint), with passed, failed and refined probes;
* ``ladder``: the fixed-rate ladder (``[profiles.ladder]``, ``--duration-scale 0.5``).

Each ``<name>.md`` is ``kvbench report tests/data/runs/<name> --format md`` from that commit;
``search+ladder.md`` is both runs side by side. When a change is meant to alter the report,
regenerate them and say why in the commit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "runs"


def _report(tmp_path: Path, *names: str) -> str:
    dirs = []
    for name in names:  # a copy: reading must not depend on (or touch) the committed files
        shutil.copytree(DATA / name, tmp_path / name)
        dirs.append(str(tmp_path / name))
    p = subprocess.run([sys.executable, "-m", "kvbench", "report", *dirs, "--format", "md"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.mark.parametrize("names", [("search",), ("ladder",), ("search", "ladder")],
                         ids=["search", "ladder", "search+ladder"])
def test_markdown_report_of_committed_runs_is_unchanged(tmp_path, names):
    want = (DATA / ("+".join(names) + ".md")).read_text()
    got = _report(tmp_path, *names)
    assert got == want


def test_committed_runs_are_what_the_report_reads(tmp_path):
    """The fixtures are real runs: records of every endpoint, searched probes with verdicts, and a
    run.json of the current schema version (a fixture that stopped reading would make the test
    above compare errors)."""
    meta = json.loads((DATA / "search" / "run.json").read_text())
    verdicts = {s["search"]["verdict"] for s in meta["stages"] if s.get("search")}
    assert {"pass", "fail"} <= verdicts
    assert {e["name"] for e in meta["endpoints"]} == {"colocated", "disaggregated", "offloaded"}
    md = _report(tmp_path, "search")
    for ep in ("colocated", "disaggregated", "offloaded"):
        assert ep in md.splitlines()[0]
