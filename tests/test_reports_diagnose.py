"""Each diagnosis rule fires on results that show its symptom and stays silent otherwise."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvbench.reports.analysis import diagnose as D
from kvbench.reports.measures.data import load
from synthetic import (T0_NS, EndpointShape, RunShape, engine_table, run_meta,
                       synth_table, write_run)


def make(tmp_path, shape: RunShape, *, workloads=None, config=None, engine=None, mutate=None,
         extra_tables=(), name="run", **meta_extra):
    table, stages = synth_table(shape)
    for t, st in extra_tables:
        table = pa.concat_tables([table, t])
        stages = stages + st
    if mutate is not None:
        table = mutate(table)
    meta = run_meta(shape, stages, workloads=workloads, config=config, **meta_extra)
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
# The synthetic endpoints report cached = hit_fraction x shared_prefix_tokens, and
# shared_prefix_tokens is 30-90% of the prompt, so the measured ratio is about 0.6 x hit_fraction.

def sent(theo, *, lru=None, per_replica=None, requests=200, elsewhere=None, replicas=4):
    return {"requests": requests, "requests_sent": requests,
            "theoretical_hit_ratio_unbounded": theo, "theoretical_hit_ratio_lru": lru,
            "capacity_tokens": 100_000 if lru is not None else None, "block_tokens": 16,
            "theoretical_hit_ratio_per_replica": per_replica, "replicas": replicas,
            "requests_hit_elsewhere": elsewhere}


def measured_of(d, ep):
    from kvbench.reports.statistics import metrics as M
    return M.hit_ratio(d.frame[d.frame["endpoint"] == ep])


def test_prefix_hits_lost_fires_against_what_was_sent(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("rr", "routed", hit_fraction=0.5)],
                     sessions_turns=3)
    d0 = make(tmp_path, shape, name="probe")
    m = measured_of(d0, "rr")
    assert 0.25 < m < 0.35
    theo = m / 0.6  # realises 60% of the reachable hits
    d = make(tmp_path, shape, workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.99}},
             workloads_sent={"rr": {"mix": sent(theo, per_replica=m, elsewhere=40)}})
    (f,) = rules(d, "prefix_hits_lost")
    assert f.numbers["theoretical"] == pytest.approx(theo)  # not the whole workload's 0.99
    assert f.numbers["measured"] == pytest.approx(m)
    assert f.numbers["per_replica"] == pytest.approx(m) and f.numbers["replicas"] == 4
    text = " ".join(f"{k} {v}" for k, v in f.evidence)
    assert "requests sent" in text and "40 of 200" in text and "served by more than one" in text
    assert "round robin" in f.cause and "prefix hash" in f.fix
    assert f.severity == "critical" and f.endpoint == "rr"


def test_prefix_hits_lost_silent_when_most_reachable_hits_are_realised(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("colo", hit_fraction=0.5, replicas=1)])
    m = measured_of(make(tmp_path, shape, name="probe"), "colo")
    # the whole workload allows far more, but this run sent requests that allow only m / 0.9
    d = make(tmp_path, shape, workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.9,
                                                 "requests": 900}},
             workloads_sent={"colo": {"mix": sent(m / 0.9, replicas=1)}})
    assert rules(d, "prefix_hits_lost") == []
    # the same run without workloads_sent (an older run.json) falls back to the whole workload
    d = make(tmp_path, shape, name="old",
             workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.9, "requests": 900}})
    (f,) = rules(d, "prefix_hits_lost")
    assert "whole workload" in " ".join(k for k, _ in f.evidence)


def test_prefix_hits_lost_threshold_edges(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("rr", "routed", hit_fraction=0.5)])
    m = measured_of(make(tmp_path, shape, name="probe"), "rr")
    just_below = m / (D.SENT_HIT_RATIO_FRACTION * 1.02)
    just_above = m / (D.SENT_HIT_RATIO_FRACTION * 0.98)
    d = make(tmp_path, shape, name="a", workloads_sent={"rr": {"mix": sent(just_below)}})
    assert rules(d, "prefix_hits_lost") == []
    d = make(tmp_path, shape, name="b", workloads_sent={"rr": {"mix": sent(just_above)}})
    assert len(rules(d, "prefix_hits_lost")) == 1
    # a tiny ratio: far below in relative terms, but under the absolute gap
    low = RunShape(endpoints=[EndpointShape("rr", "routed", hit_fraction=0.01)])
    m = measured_of(make(tmp_path, low, name="probe2"), "rr")
    d = make(tmp_path, low, name="c", workloads_sent={"rr": {"mix": sent(m + 0.04)}})
    assert rules(d, "prefix_hits_lost") == []


def test_prefix_hits_lost_uses_lru_theoretical_when_capacity_known(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("rr", "routed", hit_fraction=0.5)])
    m = measured_of(make(tmp_path, shape, name="probe"), "rr")
    # unbounded would say 2x what was measured, but the KV capacity only allows m / 0.95
    d = make(tmp_path, shape, workloads_sent={"rr": {"mix": sent(2 * m, lru=m / 0.95)}})
    assert rules(d, "prefix_hits_lost") == []
    d = make(tmp_path, shape, name="b", workloads_sent={"rr": {"mix": sent(2 * m, lru=2 * m)}})
    (f,) = rules(d, "prefix_hits_lost")
    assert "LRU at 100,000 tokens" in " ".join(k for k, _ in f.evidence)


def test_prefix_hits_lost_single_replica_blames_the_engine_not_routing(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("solo", hit_fraction=0.2, replicas=1)])
    d = make(tmp_path, shape, workloads_sent={"solo": {"mix": sent(0.6, replicas=1)}})
    (f,) = rules(d, "prefix_hits_lost")
    assert "round robin" not in f.cause and "prefix caching" in f.fix
    assert not any("replica" in k for k, _ in f.evidence)


def test_prefix_hits_lost_silent_without_a_summary_of_what_was_sent(tmp_path):
    low = RunShape(endpoints=[EndpointShape("rr", "routed", hit_fraction=0.1)])
    assert rules(make(tmp_path, low, name="no-theory"), "prefix_hits_lost") == []
    # the run recorded what it sent, but not for this endpoint: no guessing from the workload
    d = make(tmp_path, low, name="other", workloads={"mix": {
        "theoretical_hit_ratio_unbounded": 0.9}}, workloads_sent={"elsewhere": {}})
    assert rules(d, "prefix_hits_lost") == []


def test_prefix_hits_lost_fires_from_cached_tokens_on_old_runs(tmp_path):
    d = make(tmp_path, RunShape(endpoints=[EndpointShape("rr", "routed", hit_fraction=0.1)]),
             workloads={"mix": {"theoretical_hit_ratio_unbounded": 0.7}})
    (f,) = rules(d, "prefix_hits_lost")
    assert f.numbers["theoretical"] == 0.7 and f.numbers["measured"] < 0.1
    assert any("replicas" in k for k, _ in f.evidence)
    assert "prefix hash" in f.fix


def test_prefix_hits_lost_from_engine_counters(tmp_path):
    s = 10**9
    eng = engine_table([(T0_NS + i * s, "rr", m, {}, v * i)
                        for i in range(5) for m, v in (("vllm:prefix_cache_queries_total", 1000),
                                                       ("vllm:prefix_cache_hits_total", 40))])
    d = make(tmp_path, RunShape(endpoints=[EndpointShape("rr", "routed")]), engine=eng,
             workloads_sent={"rr": {"mix": sent(0.6, per_replica=0.1)}},
             mutate=lambda t: set_col(t, "cached_tokens", [None] * t.num_rows))
    (f,) = rules(d, "prefix_hits_lost")
    assert f.numbers["measured"] == pytest.approx(0.04)
    assert "engine" in f.evidence[0][1]
    assert "round robin" in f.cause


def test_prefix_hits_lost_per_run_when_endpoint_names_repeat(tmp_path):
    """Two runs of an endpoint named alike: each label compares with its own run's summary."""
    from kvbench.reports.measures.data import load
    shape = RunShape(endpoints=[EndpointShape("ep", "routed", hit_fraction=0.5)])
    m = measured_of(make(tmp_path, shape, name="probe"), "ep")
    for run_id, theo in (("good", m / 0.95), ("bad", 2 * m)):
        table, stages = synth_table(shape, run_id=run_id)
        meta = run_meta(shape, stages, run_id=run_id,
                        workloads_sent={"ep": {"mix": sent(theo)}})
        write_run(tmp_path / run_id, table, meta)
    d = load([tmp_path / "good", tmp_path / "bad"])
    (f,) = rules(d, "prefix_hits_lost")
    assert f.endpoint == "ep@bad"


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
    e2e = t.column("e2e_ns").to_numpy(zero_copy_only=False).copy()
    e2e = np.where(region == remote, e2e + add_ms * 1_000_000, e2e)  # the wait is in both
    t = set_col(t, "e2e_ns", np.nan_to_num(e2e).astype(np.int64))
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


def test_loadgen_not_blamed_for_lateness_spent_connecting_to_the_endpoint(tmp_path):
    """Lateness that is the endpoint's connection setup (an overloaded server accepting
    slowly) is not the load process's delay: the rule stays silent; the same lateness with
    no connection setup in it fires."""
    def connecting(t):  # every request's lateness was spent in connect()
        late = (t.column("t_sent").to_numpy(zero_copy_only=False)
                - t.column("t_scheduled").to_numpy(zero_copy_only=False))
        return set_col(t, "connect_ns", late.astype(np.int64))

    shape = RunShape(lateness_ms=120)
    assert rules(make(tmp_path, shape, mutate=connecting, name="conn"),
                 "loadgen_saturated") == []
    (f,) = rules(make(tmp_path, shape, name="own"), "loadgen_saturated")
    assert f.numbers["own_lateness_p99_ms"] > 50
    assert "own delay" in " ".join(k for k, _ in f.evidence)


# a stalled load process (loop-lag monitor in run.json) -------------------------------------

def test_loop_pause_is_shown_beside_lateness_and_blamed_on_the_load_process(tmp_path):
    from kvbench.reports.rendering.render import build_context
    from kvbench.reports.rendering.tables import LOOP_PAUSE

    shape = RunShape(endpoints=[EndpointShape("colo")])
    table, stages = synth_table(shape)
    stages = [dict(s, loop_pause_max_ms=3.1 if i else 42.5, loop_pauses_over_5ms=0 if i else 2)
              for i, s in enumerate(stages)]
    write_run(tmp_path / "run", table, run_meta(shape, stages))
    d = load([tmp_path / "run"])
    found = rules(d, "loadgen_saturated")
    assert len(found) == 1
    ev = dict(found[0].evidence)
    key = next(k for k in ev if k.startswith("largest event-loop pause"))
    assert "stage 1" in key and ev[key].startswith("42.5 ms")
    ctx = build_context(d)
    stage = ctx["by_stage"]
    col = stage["keys"].index(LOOP_PAUSE)
    assert stage["rows"][0]["keys"][col] == "42.5 ms (2 over 5 ms)"
    assert "client lateness p99" in stage["metrics"]

    # the part of the pause the host did not run the process is told apart
    host = [dict(s, loop_pause_max_ms=3.1 if i else 30.0,
                 loop_pause_max_offcpu_ms=0.1 if i else 24.0) for i, s in enumerate(stages)]
    write_run(tmp_path / "host", table, run_meta(shape, host))
    d = load([tmp_path / "host"])
    ev = dict(rules(d, "loadgen_saturated")[0].evidence)
    key = next(k for k in ev if k.startswith("largest event-loop pause"))
    assert "not running for 24.0 ms" in ev[key]
    stage = build_context(d)["by_stage"]
    assert stage["rows"][0]["keys"][col] == "30.0 ms (24.0 off-CPU; 2 over 5 ms)"

    # below 10 ms, or not measured (an older run): no finding
    calm = [dict(s, loop_pause_max_ms=4.0) for s in synth_table(shape)[1]]
    write_run(tmp_path / "calm", table, run_meta(shape, calm))
    assert rules(load([tmp_path / "calm"]), "loadgen_saturated") == []
