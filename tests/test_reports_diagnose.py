"""Each diagnosis rule fires on results that show its symptom and stays silent otherwise."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from reports import diagnose as D
from reports.data import load
from reports.synthetic import (T0_NS, EndpointShape, RunShape, engine_table, run_meta,
                               synth_table, write_run)


def make(tmp_path, shape: RunShape, *, workloads=None, config=None, engine=None, mutate=None,
         extra_tables=(), name="run"):
    table, stages = synth_table(shape)
    for t, st in extra_tables:
        table = pa.concat_tables([table, t])
        stages = stages + st
    if mutate is not None:
        table = mutate(table)
    meta = run_meta(shape, stages, workloads=workloads, config=config)
    write_run(tmp_path / name, table, meta, engine=engine)
    return load([tmp_path / name])


def rules(d, rule):
    return [f for f in D.RULES[rule](d)]


def set_col(table: pa.Table, name: str, values) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def test_healthy_run_has_no_finding(tmp_path):
    d = make(tmp_path, RunShape(endpoints=[EndpointShape("colo", hit_fraction=0.9)]),
             workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.6}})
    assert D.diagnose(d) == []


# prefix hits lost (round robin) ---------------------------------------------------------------

def test_prefix_hits_lost_fires_from_cached_tokens(tmp_path):
    d = make(tmp_path, RunShape(endpoints=[EndpointShape("rr", "routed", hit_fraction=0.1)]),
             workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.7}})
    (f,) = rules(d, "prefix_hits_lost")
    assert f.numbers["theoretical"] == 0.7 and f.numbers["measured"] < 0.1
    assert any("replicas" in k for k, _ in f.evidence)
    assert "prefix hash" in f.fix


def test_prefix_hits_lost_silent_when_close_or_unknown(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("ca", "routed", hit_fraction=0.9)])
    assert rules(make(tmp_path, shape, workloads={"mix": {"theoretical_hit_ratio_unbounded":
                                                          0.7}}), "prefix_hits_lost") == []
    low = RunShape(endpoints=[EndpointShape("rr", "routed", hit_fraction=0.1)])
    assert rules(make(tmp_path, low, name="no-theory"), "prefix_hits_lost") == []


def test_prefix_hits_lost_from_engine_counters(tmp_path):
    s = 10**9
    eng = engine_table([(T0_NS + i * s, "rr", m, {}, v * i)
                        for i in range(5) for m, v in (("vllm:prefix_cache_queries_total", 1000),
                                                       ("vllm:prefix_cache_hits_total", 40))])
    d = make(tmp_path, RunShape(endpoints=[EndpointShape("rr", "routed")]), engine=eng,
             workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.6}},
             mutate=lambda t: set_col(t, "cached_tokens", [None] * t.num_rows))
    (f,) = rules(d, "prefix_hits_lost")
    assert f.numbers["measured"] == pytest.approx(0.04)
    assert "engine" in f.evidence[0][1]


# transfer tax ----------------------------------------------------------------------------------

def test_transfer_tax_fires_when_disaggregated_is_slower_on_short_prompts(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("colo"),
                                EndpointShape("dis", "disaggregated", ttft_base_ms=160)])
    (f,) = rules(make(tmp_path, shape), "transfer_tax")
    assert f.numbers["disaggregated_ms"] > 1.5 * f.numbers["colocated_ms"]
    assert "512" in f.fix


def test_transfer_tax_silent_when_disaggregated_wins_or_is_alone(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("colo"),
                                EndpointShape("dis", "disaggregated", ttft_base_ms=40)])
    assert rules(make(tmp_path, shape), "transfer_tax") == []
    alone = RunShape(endpoints=[EndpointShape("dis", "disaggregated", ttft_base_ms=400)])
    assert rules(make(tmp_path, alone, name="alone"), "transfer_tax") == []


# HBM full: preemptions, re-prefill ---------------------------------------------------------------

def test_hbm_full_fires_on_preemptions(tmp_path):
    eng = engine_table([(T0_NS + i * 10**9, "colo", "vllm:num_preemptions_total", {}, v)
                        for i, v in enumerate([0, 0, 3, 9])])
    (f,) = rules(make(tmp_path, RunShape(endpoints=[EndpointShape("colo")]), engine=eng),
                 "hbm_full")
    assert f.numbers["preemptions"] == 9
    assert "offload" in f.fix.lower()


def test_hbm_full_fires_on_same_session_reprefill(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("colo", replicas=1)], sessions_turns=4)

    def evict(t):
        turn = t.column("turn").to_numpy()
        cached = t.column("cached_tokens").to_numpy().copy()
        cached[(turn == 3) & (np.arange(len(turn)) % 8 == 3)] = 0  # half the 4th turns
        return set_col(t, "cached_tokens", cached)

    (f,) = rules(make(tmp_path, shape, mutate=evict), "hbm_full")
    assert f.numbers["reprefills"] == 25  # 200 requests, 50 sessions, every other one's turn 3
    assert f.numbers["preemptions"] == 0


def test_hbm_full_silent_without_preemption_or_reprefill(tmp_path):
    eng = engine_table([(T0_NS + i * 10**9, "colo", "vllm:num_preemptions_total", {}, 5.0)
                        for i in range(4)])
    d = make(tmp_path, RunShape(endpoints=[EndpointShape("colo", replicas=1)],
                                sessions_turns=4), engine=eng)
    assert rules(d, "hbm_full") == []


# regions -----------------------------------------------------------------------------------------

def _remote_slow(t, remote="eu-west-1", add_ms=440):
    region = np.asarray(t.column("server_region").to_pylist(), dtype=object)
    ttft = t.column("ttft_ns").to_numpy(zero_copy_only=False).copy()
    ttft = np.where(region == remote, ttft + add_ms * 1_000_000, ttft)
    return set_col(t, "ttft_ns", np.nan_to_num(ttft).astype(np.int64))


def _ep_config(name, headers):
    return {"suite": {"name": "x"}, "slo": {},
            "endpoints": [{"name": name, "kind": "openai", "url": "http://127.0.0.1:1",
                           "headers": headers}]}


def test_cross_region_fires_with_configured_caller_region(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("glob", "routed",
                                              regions=("us-east-1", "eu-west-1"))])
    d = make(tmp_path, shape, mutate=_remote_slow,
             config=_ep_config("glob", {"X-Kvbench-Region": "us-east-1"}))
    (f,) = rules(d, "cross_region")
    assert f.numbers["remote_ms"] - f.numbers["local_ms"] > 300
    assert "regional" in f.fix


def test_cross_region_silent_when_regions_are_alike(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("glob", "routed",
                                              regions=("us-east-1", "eu-west-1"))])
    assert rules(make(tmp_path, shape), "cross_region") == []
    one = RunShape(endpoints=[EndpointShape("reg", "routed", regions=("us-east-1",))])
    assert rules(make(tmp_path, one, mutate=_remote_slow, name="one"), "cross_region") == []


def test_residency_fires_when_served_outside(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("eu", "routed",
                                              regions=("eu-west-1", "us-east-1"))])
    d = make(tmp_path, shape, config=_ep_config("eu", {"x-kvbench-residency": "eu-west-1"}))
    (f,) = rules(d, "residency")
    assert 50 < f.numbers["outside"] < 150
    assert "us-east-1" in dict(f.evidence)["served in"]


def test_residency_silent_inside_or_unknown(tmp_path):
    inside = RunShape(endpoints=[EndpointShape("eu", "routed", regions=("eu-west-1",))])
    cfg = _ep_config("eu", {"x-kvbench-residency": "eu-west-1"})
    assert rules(make(tmp_path, inside, config=cfg), "residency") == []
    spread = RunShape(endpoints=[EndpointShape("eu", "routed",
                                               regions=("eu-west-1", "us-east-1"))])
    assert rules(make(tmp_path, spread, name="unknown"), "residency") == []


# Hogwild! ----------------------------------------------------------------------------------------

def _hogwild(tmp_path, rate_parallel, name="hw"):
    base = RunShape(endpoints=[EndpointShape("colo")], classes=("hogwild",), workload="hw1",
                    requests_per_stage=200, stage_rates_rps=(1.0,))
    par = RunShape(endpoints=[EndpointShape("colo")], classes=("hogwild",), workload="hw4",
                   requests_per_stage=200, stage_rates_rps=(rate_parallel,), seed=1)
    cfg = {"suite": {"name": "x"}, "slo": {}, "workloads": {
        "hw1": {"kind": "hogwild", "tasks": 2, "workers": 1},
        "hw4": {"kind": "hogwild", "tasks": 2, "workers": 4}}}
    return make(tmp_path, base, config=cfg, extra_tables=[synth_table(par)], name=name)


@pytest.mark.parametrize("rate,word", [(0.5, "duplicate"), (1.15, "coordination")])
def test_hogwild_fires_below_gain(tmp_path, rate, word):
    (f,) = rules(_hogwild(tmp_path, rate), "hogwild")
    assert f.numbers["speedup"] < 1.3
    assert word in f.cause


def test_hogwild_silent_when_it_pays_or_without_baseline(tmp_path):
    assert rules(_hogwild(tmp_path, 2.5), "hogwild") == []
    d = make(tmp_path, RunShape(classes=("hogwild",), workload="hw4"), name="nobase",
             config={"suite": {}, "workloads": {"hw4": {"kind": "hogwild", "workers": 4}}})
    assert rules(d, "hogwild") == []


# load generator ----------------------------------------------------------------------------------

def test_loadgen_saturated_fires_on_lateness(tmp_path):
    (f,) = rules(make(tmp_path, RunShape(lateness_ms=120)), "loadgen_saturated")
    assert f.numbers["lateness_p99_ms"] > 50
    assert "processes" in f.fix


def test_loadgen_saturated_fires_on_client_lag(tmp_path):
    def lag(t):  # the client sees TTFT 80 ms later than the server accounts for
        return set_col(t, "ttft_ns", t.column("ttft_ns").to_numpy(zero_copy_only=False)
                       .astype(np.float64) + 80e6)

    (f,) = rules(make(tmp_path, RunShape(), mutate=lag), "loadgen_saturated")
    assert "per-chunk lag" in " ".join(k for k, _ in f.evidence)


def test_loadgen_silent_when_on_time(tmp_path):
    assert rules(make(tmp_path, RunShape(lateness_ms=1)), "loadgen_saturated") == []
