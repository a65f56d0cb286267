"""Damaged result folders: `kvbench report` and `kvbench gate` answer each with one sentence
naming the damaged file, never a traceback.

The seed is a real run's folder (`kvbench run` of the built-in endpoint for one second), as
`kvbench run` leaves it (parquet) and as a killed run leaves it (Arrow shards). ``damage``
makes seeded mutations of it: each file truncated, emptied, replaced by garbage, bit-flipped or
removed; every run.json field (and a stage's, an endpoint's, the config's) of each JSON type;
tables of another schema, extra shards of another schema, columns missing or of another type.
"""

from __future__ import annotations

import contextlib
import io
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import damage
from kvbench.cli import main
from kvbench.core.layout import table_files

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "damaged"
seed = 3
results_dir = "{results}"
workloads = ["chat"]
profile = "open"

[[endpoints]]
name = "emu"
kind = "builtin"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 100
prompt_tokens = {{ dist = "constant", mean = 40 }}
output_tokens = {{ dist = "constant", mean = 8 }}

[profiles.open]
pacing = "poisson"
stages = [ {{ rate_rps = 20.0, duration_s = 1 }} ]

[slo.chat]
ttft_ms = 500
tpot_ms = 50

[gate]
rules = [
  {{ metric = "ttft_p50", class = "*", max_increase_pct = 50 }},
  {{ metric = "error_rate", class = "*", max_value = 0.5 }},
]

[collect]
nvml = false
"""

FUZZ_FOLDERS = 240  # parquet and shard seeds, half each; plus the 17 named categories


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """(parquet seed, shard seed, a good baseline) from one real one-second run."""
    root = tmp_path_factory.mktemp("damaged")
    results = root / "results"
    cfg = root / "bench.toml"
    cfg.write_text(CONFIG.format(results=results))
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", "seed"], cwd=ROOT, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    seed = results / "seed"
    assert table_files(seed, "requests") and (seed / "engine.parquet").exists()
    shards = root / "shards"
    shutil.copytree(seed, shards)
    damage.to_shards(shards)
    good = root / "good"
    shutil.copytree(seed, good)
    return seed, shards, good


def _call(argv: list[str]) -> tuple[int, str]:
    """kvbench in this process: (exit code, stderr); a traceback fails the test."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code
        except BaseException as exc:  # noqa: BLE001 - the very thing this test looks for
            import traceback

            pytest.fail(f"kvbench {' '.join(argv)}: traceback\n{traceback.format_exc()}"
                        f"{type(exc).__name__}")
    return int(rc or 0), err.getvalue()


def _judge(rc: int, stderr: str, folder: Path, files: str, what: str) -> None:
    """Success, or one sentence on stderr naming a damaged file (or the folder, when the
    damage removed the file the sentence is about)."""
    if rc == 0:
        return
    assert rc in (1, 2, 3), f"{what}: exit {rc}\n{stderr}"
    if rc == 1:  # a gate verdict (fail) on data that still reads: not an error
        return
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("kvbench: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, f"{what}: {stderr}"
    sentence = errors[0]
    names = files.split()
    assert any(n in sentence for n in names) or str(folder) in sentence, (
        f"{what}: the sentence names none of {names}: {sentence}")
    assert sentence.count("\n") == 0 and len(sentence) < 600, sentence


def _check(folder: Path, good: Path, files: str, what: str, gate_as: str,
           fmt: str = "md") -> int:
    """Report and gate on a damaged folder; returns the report's exit code."""
    rc, err = _call(["report", str(folder), "--format", fmt, "-o", str(folder / f"r.{fmt}")])
    _judge(rc, err, folder, files, f"{what}: report")
    report_rc = rc
    if gate_as == "current":
        argv = ["gate", "--baseline", str(good), "--current", str(folder), "--no-history"]
    else:
        argv = ["gate", "--baseline", str(folder), "--current", str(good), "--no-history"]
    rc, err = _call(argv)
    _judge(rc, err, folder, files, f"{what}: gate ({gate_as})")
    return report_rc


@pytest.mark.parametrize("name", list(damage.CATEGORIES))
def test_named_damages_get_one_sentence_naming_the_file(seeds, tmp_path, name):
    seed, _, good = seeds
    d = tmp_path / "run"
    shutil.copytree(seed, d)
    files = damage.CATEGORIES[name](d, random.Random(0))
    for gate_as in ("current", "baseline"):
        _check(d, good, files, name, gate_as)
    rc, err = _call(["report", str(d), "--format", "md", "-o", str(d / "r.md")])
    assert rc == 3, f"{name}: damage that should not read: exit {rc}"


def test_fuzzed_folders_never_give_a_traceback(seeds, tmp_path):
    seed, shards, good = seeds
    t0 = time.monotonic()
    half = FUZZ_FOLDERS // 2
    made = (damage.fuzz(seed, tmp_path / "parquet", half, seed=11)
            + damage.fuzz(shards, tmp_path / "shards", FUZZ_FOLDERS - half, seed=12))
    assert len(made) >= 200
    refused = 0
    for i, (d, what, files) in enumerate(made):
        # one in six as HTML: its plots read the data the Markdown does not show
        refused += _check(d, good, files, what, "current" if i % 2 else "baseline",
                          "html" if i % 6 == 0 else "md") != 0
    # Most damages are refused (the rest are damage a reader may survive: a truncated shard,
    # an extra run.json key of the right type).
    assert refused >= len(made) // 2, refused
    print(f"{len(made)} damaged folders in {time.monotonic() - t0:.1f} s, {refused} refused")


def test_as_a_subprocess_the_sentence_is_all_that_is_printed(seeds, tmp_path):
    seed, _, good = seeds
    for name in ("requests.parquet garbage", "run.json stages a string"):
        d = tmp_path / name.replace(" ", "_")
        shutil.copytree(seed, d)
        files = damage.CATEGORIES[name](d, random.Random(0))
        for argv in (["report", str(d)],
                     ["gate", "--baseline", str(good), "--current", str(d), "--no-history"]):
            p = subprocess.run([sys.executable, "-m", "kvbench", *argv], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 3, p.stdout + p.stderr
            assert "Traceback" not in p.stderr
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and files in lines[0], p.stderr


def test_a_damaged_history_file_is_named(seeds, tmp_path):
    """`--baseline last-pass` and `kvbench history` read the results store's history."""
    seed, _, good = seeds
    store = tmp_path / "store"
    for name in ("a", "b"):
        shutil.copytree(seed, store / name)
    rc, err = _call(["gate", "--baseline", str(store / "a"), "--current", str(store / "b"),
                     "--results-dir", str(store)])
    assert rc == 0, err
    [hist] = list((store / "history").rglob("*.parquet"))
    for damage_it in (damage.zero, damage.garbage, damage.truncate):
        shutil.copy(hist, tmp_path / "h")
        damage_it(hist, random.Random(1))
        for argv in (["gate", "--baseline", "last-pass", "--current", str(store / "b"),
                      "--results-dir", str(store), "--no-history"],
                     ["history", "--results-dir", str(store)]):
            rc, err = _call(argv)
            assert rc == 3 and err.count("\n") == 1 and hist.name in err, (argv, err)
        shutil.copy(tmp_path / "h", hist)
