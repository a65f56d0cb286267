"""The lost-prefix-hit diagnosis on real runs: ``kvbench run`` against the built-in emulator.

One run, three endpoints on a RAG workload: a routed endpoint with a round-robin balancer over
4 replicas (the seeds' "prefix hit rate drops" symptom), the same with cache-aware routing
(REGIONAL, on prefix hashes), and a colocated engine. Only the round robin is diagnosed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

from kvbench.cli import main
from kvbench.reports.analysis import diagnose as D
from kvbench.reports.statistics import metrics as M
from kvbench.reports.measures.data import load

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[suite]
name = "diag"
results_dir = "{results}"
workloads = ["rag"]
profile = "short"

[[endpoints]]
name = "rr"
kind = "builtin"
topology = "routed"
options = {{ router = "ROUND_ROBIN", regions = 1, replicas_per_region = 4, time_scale = 0.2 }}

[[endpoints]]
name = "cache-aware"
kind = "builtin"
topology = "routed"
options = {{ router = "REGIONAL", regions = 1, replicas_per_region = 4, time_scale = 0.2 }}

[[endpoints]]
name = "colo"
kind = "builtin"
topology = "colocated"
options = {{ time_scale = 0.2 }}

[workloads.rag]
kind = "rag"
requests = 200
documents = 20
top_k = 4
chunk_tokens = {{ dist = "constant", mean = 128 }}
output_tokens = {{ dist = "constant", mean = 8 }}

[profiles.short]
pacing = "poisson"
stages = [ {{ rate_rps = 12.0, duration_s = 3 }} ]
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("diag")
    cfg = d / "bench.toml"
    cfg.write_text(CONFIG.format(results=d / "results"))
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", "r1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return d / "results" / "r1"


def test_run_json_holds_what_each_endpoint_was_sent(run_dir):
    meta = json.loads((run_dir / "run.json").read_text())
    t = read_run_table(run_dir, "requests").to_pandas()
    whole = meta["workloads"]["rag"]
    assert whole["requests"] == 200
    sent = meta["workloads_sent"]
    assert set(sent) == {"rr", "cache-aware", "colo"}
    for ep, by_wl in sent.items():
        desc = by_wl["rag"]
        rows = t[t["endpoint"] == ep]
        assert desc["requests"] == desc["requests_sent"] == len(rows) < 200
        assert desc["unmatched"] == 0
        assert desc["block_tokens"] == 16 and desc["capacity_tokens"] > 0
        # a short run sends the first requests only: fewer repeats than the whole workload
        assert desc["theoretical_hit_ratio_unbounded"] < whole["theoretical_hit_ratio_unbounded"]
    assert sent["rr"]["rag"]["replicas"] == 4
    # the emulator's engines reuse exactly what they computed: measured = per-replica theory
    rr = t[t["endpoint"] == "rr"]
    measured = rr["cached_tokens"].sum() / rr["prompt_tokens"].sum()
    assert measured == pytest.approx(sent["rr"]["rag"]["theoretical_hit_ratio_per_replica"],
                                     abs=0.02)


def test_round_robin_is_diagnosed_cache_aware_and_colocated_are_not(run_dir):
    d = load([run_dir])
    found = D.RULES["prefix_hits_lost"](d)
    assert [f.endpoint for f in found] == ["rr"], [(f.endpoint, f.numbers) for f in found]
    (f,) = found
    n = f.numbers
    assert n["measured"] < D.SENT_HIT_RATIO_FRACTION * n["theoretical"]
    assert n["replicas"] == 4 and n["per_replica"] < 0.9 * n["theoretical"]
    text = " ".join(f"{k}: {v}" for k, v in f.evidence)
    assert "requests sent" in text and "replicas serving: 4" in text
    assert "cached only on other replicas" in text
    assert "round robin" in f.cause and "prefix hash" in f.fix
    for ep in ("cache-aware", "colo"):  # nearly every reachable hit realised
        sub = d.frame[d.frame["endpoint"] == ep]
        desc = d.runs[0].workloads_sent[ep]["rag"]
        assert M.hit_ratio(sub) >= 0.9 * desc["theoretical_hit_ratio_lru"]


def test_markdown_report_says_it(run_dir, tmp_path, capsys):
    out = tmp_path / "report.md"
    assert main(["report", str(run_dir), "--format", "md", "-o", str(out)]) == 0
    md = out.read_text()
    lines = [ln for ln in md.splitlines() if "prefix_hits_lost" in ln]
    assert len(lines) == 1 and lines[0].startswith("- **rr:")
    assert "route on a prefix hash" in lines[0]
