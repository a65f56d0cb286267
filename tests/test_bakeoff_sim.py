"""bench/bakeoff_sim.py ``--precise``: the steady-state capacity issue 31's default is judged
against. Each seed's capacity is bisected until its bracket is within 2% (the highest passing
rate reported, its failing neighbour at most 2% above), the start bracketed by x1.25 steps,
and ``--json`` holds what a script compares a run with. A tiny endpoint (one colocated engine
of 4 sequences at a fifth of the model's time, 64 -> 32-token chats, TTFT SLO 100 ms) on short
runs keeps it to seconds."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kvbench_cli import tiny_chat_config  # noqa: E402

PROFILE = """[profiles.p]
pacing = "poisson"
stages = [{ rate_rps = 1.0, duration_s = 1 }]
"""


def test_precise_bisects_each_seed_to_two_percent_and_writes_json(tmp_path):
    cfg = tmp_path / "bench.toml"
    cfg.write_text(tiny_chat_config("tiny", 4, PROFILE, 100.0)
                   .replace("time_scale = 0.5", "time_scale = 0.2")
                   .replace("@RESULTS@", str(tmp_path / "results")))
    out = tmp_path / "truth" / "tiny.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bakeoff_sim.py"), "--config", str(cfg),
         "--workload", "chat", "--topologies", "colocated", "--precise", "--seconds", "30",
         "--warmup-s", "5", "--seeds", "2", "--seed", "7", "--guess", "20", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(out.read_text())
    assert d["workload"] == "chat" and d["seconds"] == 30 and d["warmup_s"] == 5
    assert d["seeds"] == [7, 8] and d["precision"] == 0.02 and "--precise" in d["command"]
    topo = d["topologies"]["colocated"]
    assert topo["gpus"] == 1 and topo["guess"] == 20 and len(topo["seeds"]) == 2
    for s in topo["seeds"]:
        lo, hi = s["bracket"]
        assert 0 < lo < hi <= lo * 1.02 + 1e-9
        assert s["capacity"] == lo and lo <= s["crossing"] <= hi
        by_rate = {round(t["rate"], 9): t for t in s["tried"]}
        assert by_rate[round(lo, 9)]["pass"] and not by_rate[round(hi, 9)]["pass"]
        # the start was bracketed by x1.25 steps from the guess, then halved geometrically
        rates = [t["rate"] for t in s["tried"]]
        assert rates[0] == 20
        first = s["tried"][0]["pass"]
        k = next(i for i, t in enumerate(s["tried"]) if t["pass"] != first)
        assert np.allclose(rates[:k + 1], [20 * 1.25 ** (i if first else -i)
                                           for i in range(k + 1)])
        # a pass is every judged class at or above the target, a fail one below it
        for t in s["tried"]:
            assert t["pass"] == all(c["att"] >= 0.95 for c in t["classes"].values())
        assert s["breaks"]["class"] == "chat" and s["breaks"]["slo"] == "ttft_ms"
    assert topo["median"] == float(np.median(topo["capacities"]))
    assert topo["median_per_gpu"] == topo["median"]
    assert topo["min"] <= topo["median"] <= topo["max"]
    fit = topo["pooled_fit"]  # the cross-check from every run near the median
    assert fit is None or fit["points"] >= 3
    assert "colocated (1 GPU): median" in p.stdout and "seeds 7: " in p.stdout
