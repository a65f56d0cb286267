"""The retention probe against the built-in endpoint: with a background working set larger than
the KV capacity the resent prefix is evicted where LRU predicts (within 15%, at the background
rate the probe achieved); with one that fits beside the probe it never is."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.core.errors import UserError
from kvbench.reports.analysis import retention as report
from kvbench.runs import retention as R

ROOT = Path(__file__).resolve().parent.parent
CAPACITY = 4096

CONFIG = f"""
[[endpoints]]
name = "emu"
kind = "builtin"
topology = "colocated"
options = {{ time_scale = 0.05, replicas = 1, kv_capacity_tokens = {CAPACITY} }}

[workloads.chat]
kind = "chat"

[profiles.p]
stages = [ {{ users = 1, duration_s = 1 }} ]
"""


def test_knee_matches_the_lru_capacity(tmp_path):
    cfg = tmp_path / "bench.toml"
    cfg.write_text(CONFIG)
    # knee after capacity - probe/2 = 3,968 new tokens: at 7,200 tokens/s about 0.55 s, inside
    # a ladder fine enough (x1.2) that interpolating between two points stays within 10%
    p = subprocess.run([sys.executable, "-m", "kvbench", "probe", "retention", "--config",
                        str(cfg), "--endpoint", "emu", "--gaps", "0.3:1:1.2",
                        "--working-set", "2", "--probe-tokens", "256",
                        "--background-tokens", "256", "--rate-tokens-s", "7200",
                        "-o", str(tmp_path / "out")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr + p.stdout
    result = json.loads((tmp_path / "out" / "retention.json").read_text())
    assert result["spec"]["capacity_tokens"] == CAPACITY  # read from the engine's /metrics
    (row,) = report.summary(result)
    assert row["evicts"] and row["knee_gap_s"] is not None
    assert abs(row["knee_gap_s"] / row["predicted_gap_s"] - 1) <= 0.15, row
    assert abs(row["knee_new_tokens"] / row["predicted_new_tokens"] - 1) <= 0.15, row
    points = result["points"]
    assert points[0]["hit_fraction"] > 0.9 and points[-1]["hit_fraction"] == 0
    assert all(x["first_cached_tokens"] == 0 for x in points)  # each probe cold after a reset
    html = (tmp_path / "out" / "retention.html").read_text()
    assert "Hit probability of a resent prefix" in html and "LRU knee" in html


def test_working_set_that_fits_never_evicts(tmp_path):
    from kvbench.config import BuiltinEndpoint
    from kvbench import engines
    from kvbench.runs import builtin

    proc, url = builtin.start(BuiltinEndpoint(name="emu", topology="colocated", options={
        "time_scale": 0.05, "replicas": 1, "kv_capacity_tokens": CAPACITY}))
    try:
        spec = R.ProbeSpec([0.2, 0.8], [0.5], CAPACITY, probe_tokens=256,
                           background_tokens=256, rate_tokens_s=7200)
        res = R.probe(url, "kvbench-llama-3-70b", spec, adapter=engines.get("builtin"))
    finally:
        builtin.stop(proc)
    d = res.to_dict()
    (row,) = report.summary(d)
    assert not row["evicts"] and row["knee_gap_s"] is None and row["predicted_gap_s"] is None
    # 0.8 s at 7,200 tokens/s sends 5,760 tokens: the 2,048-token working set passed more
    # than twice, and the probe stayed
    assert all(p["hit_fraction"] > 0.9 for p in d["points"])
    assert d["points"][-1]["background_tokens"] > 2 * 0.5 * CAPACITY


def test_ladder_and_knee_interpolation():
    assert R.ladder(0.25, 4) == [0.25, 0.5, 1.0, 2.0, 4.0]
    with pytest.raises(UserError):
        R.ladder(0, 1)
    import numpy as np

    x = np.array([1.0, 2.0, 4.0])
    assert report._crossing(x, np.array([1.0, 1.0, 0.0]), log=True) == pytest.approx(2 ** 1.5)
    assert report._crossing(x, np.array([1.0, 0.75, 0.25]), log=False) == pytest.approx(3.0)
    assert report._crossing(x, np.array([1.0, 0.9, 0.6]), log=False) is None
