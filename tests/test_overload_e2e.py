"""Numbers that stay right under overload, on real runs: ``kvbench run`` against the built-in
emulator.

An overloaded run: a small Mooncake-format trace (written here, 80 requests of 6,000-token
prompts 25 ms apart: 40 req/s offered) replayed against one emulated colocated GPU, which
serves about 13 req/s of them. The schedule fits in 2 s; the backlog drains for about 4 s
more. Achieved throughput must match the server's own completed-requests
rate (``vllm:request_success_total`` in the run's engine samples), the offered rate must be
shown beside it, the overload rule must fire and the load-generator rule must not.

A run that keeps up: the default bench.toml's ladder against the colocated endpoint; achieved
and offered agree within noise and no overload rule fires.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvbench.config import load_config
from kvbench.config.parse import classes_without_slo
from kvbench.reports.analysis import diagnose as D
from kvbench.reports.statistics import metrics as M
from kvbench.reports.analysis import overload as O
from kvbench.reports.measures.data import load
from kvbench.reports.rendering.render import build_context, render_md

ROOT = Path(__file__).resolve().parent.parent

TRACE_CONFIG = """
[suite]
name = "overload"
results_dir = "{results}"
workloads = ["trace"]
profile = "replay"

[[endpoints]]
name = "colo"
kind = "builtin"
topology = "colocated"

[workloads.trace]
kind = "trace"
format = "mooncake"
path = "{trace}"

[profiles.replay]
pacing = "trace"
stages = [ {{ duration_s = 60 }} ]
max_in_flight = 1024

[collect]
nvml = false
scrape_interval_s = 0.25
"""

N_TRACE = 80
PROMPT_TOKENS = 6000
GAP_MS = 25


def _kvbench_run(cfg: Path, run_id: str, *extra: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", run_id, *extra], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def overloaded(tmp_path_factory):
    d = tmp_path_factory.mktemp("overload")
    trace = d / "trace.jsonl"
    # Mooncake's format: ms timestamps, token lengths, 512-token block hashes (distinct
    # prompts: no prefix hits to lighten the prefill)
    blocks = -(-PROMPT_TOKENS // 512)
    trace.write_text("".join(json.dumps({
        "timestamp": GAP_MS * i, "input_length": PROMPT_TOKENS, "output_length": 16,
        "hash_ids": list(range(i * blocks, (i + 1) * blocks))}) + "\n" for i in range(N_TRACE)))
    cfg = d / "bench.toml"
    cfg.write_text(TRACE_CONFIG.format(results=d / "results", trace=trace))
    p = _kvbench_run(cfg, "r1")
    return d / "results" / "r1", p.stdout


def _sampled(t, metric: str):
    """(sample times ns, the metric summed over its label sets) from the engine table."""
    x = t[t["metric"] == metric]
    x = x.assign(labels=x["labels"].map(lambda v: str(sorted(v)) if v is not None else ""))
    wide = x.pivot_table(index="t_ns", columns="labels", values="value", aggfunc="last")
    total = wide.sort_index().ffill().fillna(0.0).sum(axis=1)
    return total.index.to_numpy(np.float64), total.to_numpy()


def _server_completion_rate(run_dir: Path) -> tuple[float, float]:
    """(completed requests / s, completions) by the emulator's own /metrics: the increase of
    ``vllm:request_success_total`` over the time the server had requests, from the first
    sample with any running or waiting to the first with the final count (each end at the
    midpoint between two samples)."""
    t = pq.read_table(run_dir / "engine.parquet").to_pandas()
    ts, done = _sampled(t, "vllm:request_success_total")
    ts_r, running = _sampled(t, "vllm:num_requests_running")
    ts_w, waiting = _sampled(t, "vllm:num_requests_waiting")
    assert np.array_equal(ts, ts_r) and np.array_equal(ts, ts_w)
    busy = (running + waiting > 0) | (done > done[0])
    first_busy = int(np.argmax(busy))
    first_final = int(np.argmax(done >= done[-1]))
    assert 0 < first_busy < first_final
    t0 = (ts[first_busy - 1] + ts[first_busy]) / 2
    t1 = (ts[first_final - 1] + ts[first_final]) / 2
    return (done[-1] - done[0]) / ((t1 - t0) / 1e9), done[-1] - done[0]


def test_achieved_matches_the_servers_own_completion_rate(overloaded):
    run_dir, _ = overloaded
    d = load([run_dir])
    f = d.frame
    assert len(f) == N_TRACE and int(f["ok"].sum()) == N_TRACE
    server_rps, server_n = _server_completion_rate(run_dir)
    assert server_n == N_TRACE
    achieved = M.statistic(f, "throughput_rps")
    offered = M.statistic(f, "offered_rps")
    assert achieved == pytest.approx(server_rps, rel=0.10), (achieved, server_rps)
    # offered: 80 requests over the trace's 1.975 s (stage start to last arrival)
    assert offered == pytest.approx(N_TRACE / ((N_TRACE - 1) * GAP_MS / 1000), rel=0.05)
    assert achieved < 0.5 * offered
    # token throughput on the same interval: about one emulated GPU's prefill, not the
    # offered 240k tokens/s
    assert M.statistic(f, "input_tps") == pytest.approx(achieved * PROMPT_TOKENS, rel=0.01)
    assert M.statistic(f, "input_tps") < 0.5 * offered * PROMPT_TOKENS


def test_overload_rule_fires_and_the_lateness_rule_does_not(overloaded):
    run_dir, stdout = overloaded
    # kvbench run's own summary says so at the end of the run
    assert "kvbench run: OVERLOADED: colo x " in stdout, stdout
    d = load([run_dir])
    rates = O.rates(d.frame)
    assert list(rates["overloaded"]) == [True]
    assert rates["drain_s"].iloc[0] > 2 * rates["offered_s"].iloc[0]
    found = D.diagnose(d)
    rules = {x.rule for x in found}
    assert "overloaded" in rules and "loadgen_saturated" not in rules, \
        [(x.rule, x.evidence) for x in found]
    (x,) = [x for x in found if x.rule == "overloaded"]
    text = " ".join(f"{k}: {v}" for k, v in x.evidence)
    assert "achieved / offered" in text and "queue time" in text
    assert x.numbers["queue_ms"] > 0.5 * x.numbers["ttft_ms"]  # the emulator's own queue
    md = render_md(build_context(d, figures=False))
    assert "| offered rate (req/s) |" in md and "| achieved throughput (req/s) |" in md
    assert "overloaded" in md


def test_trace_class_gets_the_default_slo(overloaded):
    run_dir, _ = overloaded
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["config"]["slo"]["trace"] == {"ttft_ms": 5000.0, "tpot_ms": 100.0,
                                              "e2e_ms": None}
    f = load([run_dir]).frame
    assert f["has_slo"].all()
    tpot = f["tpot_ms"].to_numpy()
    met = (f["ttft_ms"].to_numpy() <= 5000) & ((tpot <= 100) | np.isnan(tpot))
    assert M.statistic(f, "slo_attainment") == pytest.approx(met.mean())
    assert M.statistic(f, "goodput_rps") == pytest.approx(met.sum() / M.achieved_s(f))


def test_a_class_without_slo_shows_no_slo_and_is_left_out_of_goodput(overloaded, tmp_path):
    run_dir, _ = overloaded
    d = load([run_dir], slo={})  # the same records judged with no SLO at all
    f = d.frame
    assert np.isnan(M.statistic(f, "goodput_rps"))
    assert np.isnan(M.statistic(f, "slo_attainment"))
    ctx = build_context(d, figures=False)
    row = [r for r in ctx["summary"] if r["label"] == "goodput at SLO"][0]
    assert [c.text for c in row["cells"]] == ["no SLO"]
    assert ctx["no_slo_classes"] == [{"class": "trace", "requests": f"{N_TRACE}"}]
    assert "no SLO" in render_md(ctx)


def test_run_warns_of_classes_without_slo(tmp_path):
    cfg = tmp_path / "bench.toml"
    text = (ROOT / "bench.toml").read_text()
    without = text.replace("[slo.agent]\nttft_ms = 1500\ntpot_ms = 60\n", "")
    assert without != text
    cfg.write_text(without.replace('results_dir = "results"',
                                   f'results_dir = "{tmp_path / "results"}"'))
    c = load_config(cfg)
    assert classes_without_slo(c, ["mix"]) == ["agent"]
    assert classes_without_slo(c, ["chat"]) == []
    (tmp_path / "results" / "taken").mkdir(parents=True)
    (tmp_path / "results" / "taken" / "x").write_text("")
    p = subprocess.run([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                        "--run-id", "taken"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    # a taken run id stops the run before any load, after the warning
    assert p.returncode != 0
    assert "no SLO for request class(es) agent" in p.stdout + p.stderr


def test_default_bench_toml_classes_all_have_slos():
    cfg = load_config(ROOT / "bench.toml")
    assert classes_without_slo(cfg) == []


@pytest.fixture(scope="module")
def kept_up(tmp_path_factory):
    """The default bench.toml's ladder (2 and 6 req/s, 10 s each) of its mix on the colocated
    endpoint (its long documents at 6 req/s are beyond one GPU: the bake-off's other shape)."""
    d = tmp_path_factory.mktemp("kept-up")
    cfg = d / "bench.toml"
    cfg.write_text((ROOT / "bench.toml").read_text().replace(
        'results_dir = "results"', f'results_dir = "{d / "results"}"'))
    _kvbench_run(cfg, "r1", "--endpoint", "colocated", "--workload", "mix", "--profile", "ladder")
    return d / "results" / "r1"


def test_a_run_that_keeps_up_is_not_overloaded(kept_up):
    d = load([kept_up])
    rates = O.rates(d.frame)
    assert len(rates) == 2 and list(rates["overloaded"]) == [False, False], rates.to_dict()
    for _, r in rates.iterrows():
        # first tokens keep to the schedule: started and offered agree within Poisson noise
        # (a 99% band of the count at the offered rate over the interval)
        mu = r["offered_rps"] * r["started_s"]
        assert abs(r["started"] - mu) <= 2.6 * np.sqrt(mu) + 1, r.to_dict()
        # achieved is completions over first send .. last completion: at most offered plus
        # noise (long answers drain after the schedule)
        assert r["throughput_rps"] <= r["offered_rps"] * 1.3
        assert r["completed"] == r["scheduled"]
    found = D.diagnose(d)
    assert "overloaded" not in {x.rule for x in found}, [(x.rule, x.evidence) for x in found]


def test_without_per_request_server_times_the_engine_queue_histogram_is_the_evidence(
        overloaded):
    """A real vLLM sends no per-request queue time; its /metrics queue-time histogram does."""
    run_dir, _ = overloaded
    d = load([run_dir])
    d.frame["server_queue_ms"] = np.nan
    (x,) = [x for x in D.diagnose(d) if x.rule == "overloaded"]
    text = " ".join(f"{k}: {v}" for k, v in x.evidence)
    assert "vllm:request_queue_time_seconds" in text, text
    assert x.numbers["queue_ms"] > 0.5 * x.numbers["ttft_ms"]
