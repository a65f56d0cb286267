"""What the report knows of the engine and hardware behind an endpoint: engine counters named by
the engine adapter of each endpoint's family, and the cost-model overlay only over endpoints
whose hardware the config declares."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from kvbench import engines
from kvbench.engines import EngineAdapter
from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.measures.data import load
from kvbench.reports.rendering.render import build_context, render_md
from synthetic import T0_NS, EndpointShape, RunShape, engine_table, run_meta, synth_table, write_run

LLAMA_HITS = "llamacpp:prompt_tokens_cached_total"
LLAMA_PROMPT = "llamacpp:prompt_tokens_total"  # tokens computed: the cache misses


def llamacpp() -> EngineAdapter:
    """The llama.cpp adapter (its own module once written; a minimal one until then)."""
    try:
        return engines.get("llamacpp")
    except KeyError:
        return engines.register(EngineAdapter(
            name="llamacpp", title="llama.cpp llama-server", prefixes=("llamacpp:",),
            prefix_hits=LLAMA_HITS, prefix_queries=LLAMA_PROMPT, queries_exclude_hits=True))


def counters(ep: str, per_s: dict[str, float], seconds: int = 30) -> list[tuple]:
    return [(T0_NS + i * 10**9, ep, m, {}, v * i) for i in range(seconds)
            for m, v in per_s.items()]


@pytest.fixture
def mixed(tmp_path):
    """A llama-server (300 of 1,000 prompt tokens a second cached) beside a vLLM (200 of 500)."""
    llamacpp()
    shape = RunShape(endpoints=[EndpointShape("llama", kind="openai"),
                                EndpointShape("vl", kind="openai")], requests_per_stage=60)
    table, stages = synth_table(shape)
    eng = engine_table(counters("llama", {LLAMA_HITS: 300.0, LLAMA_PROMPT: 700.0,
                                          "llamacpp:requests_processing": 1.0})
                       + counters("vl", {"vllm:prefix_cache_hits_total": 200.0,
                                         "vllm:prefix_cache_queries_total": 500.0}))
    return write_run(tmp_path / "run", table, run_meta(shape, stages), engine=eng)


def test_engine_hit_ratio_per_family(mixed):
    d = load([mixed])
    assert E.adapters(d.engine)["llama"].name == "llamacpp"
    assert E.adapters(d.engine)["vl"].name == "vllm"
    # llama.cpp's prompt counter leaves out the cached tokens: hits / (hits + computed)
    assert E.hit_ratio(d.engine) == {"llama": pytest.approx(0.3), "vl": pytest.approx(0.4)}


def test_engine_hit_ratio_in_the_rendered_report(mixed):
    ctx = build_context(load([mixed]))
    md = render_md(ctx)
    assert "| prefix hit ratio (engine counters) | 30.0% | 40.0% ★ |" in md
    (fig,) = [f for f in ctx["figures"] if f["key"] == "hit_ratio_time"]
    engine_lines = {t["name"]: t["y"] for t in fig["data"] if "engine counters" in t["name"]}
    assert set(engine_lines) == {"llama (engine counters)", "vl (engine counters)"}
    ys = _values(engine_lines["llama (engine counters)"])
    ys = ys[~np.isnan(ys)]
    assert len(ys) and ys == pytest.approx(np.full(len(ys), 0.3))


def _values(y) -> np.ndarray:
    """A trace's values: a list, or plotly's base64 typed array ({dtype, bdata})."""
    if isinstance(y, dict):
        return np.frombuffer(base64.b64decode(y["bdata"]), np.dtype(y["dtype"])).astype(float)
    return np.asarray(y, float)


def test_unknown_engine_gives_no_engine_ratio(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("x")], requests_per_stage=20)
    table, stages = synth_table(shape)
    eng = engine_table(counters("x", {"acme:cache_hits_total": 1.0,
                                      "acme:cache_queries_total": 2.0}))
    d = load([write_run(tmp_path / "run", table, run_meta(shape, stages), engine=eng)])
    assert E.adapters(d.engine) == {} and E.hit_ratio(d.engine) == {}
    assert "engine counters" not in render_md(build_context(d))


def test_preemptions_by_the_adapters_counter(tmp_path):
    shape = RunShape(endpoints=[EndpointShape("colo")], requests_per_stage=20)
    table, stages = synth_table(shape)
    eng = engine_table(counters("colo", {"vllm:num_preemptions_total": 2.0}, seconds=5))
    d = load([write_run(tmp_path / "run", table, run_meta(shape, stages), engine=eng)])
    assert E.preemptions(d.engine) == {"colo": ("vllm:num_preemptions_total", 8.0)}


# --------------------------------------------------------------------------------------------
# the cost-model overlay


def overlay(tmp_path, *kinds: str) -> dict:
    shape = RunShape(endpoints=[EndpointShape(f"ep{i}", kind=k) for i, k in enumerate(kinds)],
                     requests_per_stage=80)
    table, stages = synth_table(shape)
    d = load([write_run(tmp_path / "run", table, run_meta(shape, stages))])
    (fig,) = [f for f in build_context(d)["figures"] if f["key"] == "ttft_vs_prompt"]
    return fig


def _model_traces(fig: dict) -> list[str]:
    return [t["name"] for t in fig["data"] if t["name"].startswith("cost model")]


def test_costmodel_overlay_over_builtin_endpoints(tmp_path):
    fig = overlay(tmp_path, "builtin")
    assert _model_traces(fig) == ["cost model: colocated (prefill + 1 token)",
                                  "cost model: disaggregated, RDMA"]
    assert fig["note"].startswith("Cost model")
    assert "not drawn" not in fig["note"]


def test_costmodel_overlay_omitted_over_unknown_hardware(tmp_path):
    fig = overlay(tmp_path, "openai")
    assert _model_traces(fig) == []
    assert not fig["layout"].get("shapes")  # no crossover line
    assert fig["note"].startswith("cost model overlay omitted: not drawn for ep0 (openai)")
    assert "hardware not declared in the config" in fig["note"]


def test_costmodel_overlay_over_the_declared_endpoints_only(tmp_path):
    fig = overlay(tmp_path, "builtin", "openai")
    assert len(_model_traces(fig)) == 2
    assert "not drawn for ep1 (openai)" in fig["note"]
    assert "ep0" not in fig["note"]


def test_records_against_counters_read_around_each_job(tmp_path):
    """A built-in endpoint's workloads side by side run on servers of their own, and the
    run's sampler follows one of them: the engine's side of the records-against-counters table
    is then the counters kvbench read just before and just after each job, summed over the
    endpoint's jobs (priming, which came before, left out); an endpoint with a job missing a
    reading falls back to the samples."""
    from kvbench.core.contract import CacheState

    def state(ep, before, after):
        return CacheState(endpoint=ep, workload="w", counters_before=before,
                          counters_after=after)

    zero = {"hits": 0, "queries": 0, "prompt": 0, "generation": 0, "tier_hits": None}
    states = [state("vl", zero, {**zero, "hits": 100, "prompt": 1000, "generation": 50}),
              state("vl", {**zero, "hits": 5, "prompt": 10, "generation": 1, "tier_hits": 0},
                    {**zero, "hits": 55, "prompt": 510, "generation": 21, "tier_hits": 40}),
              state("llama", zero, None),
              # a run from before kvbench read the offload tiers' hits: the samples decide
              state("old", {k: 0 for k in ("hits", "queries", "prompt", "generation")},
                    {"hits": 1, "queries": 1, "prompt": 1, "generation": 1})]
    got = E.job_increases(states)
    assert got == {"vl": {"prompt_tokens": 1500.0, "cached_tokens": 190.0,
                          "completion_tokens": 70.0}}
    shape = RunShape(endpoints=[EndpointShape("vl", kind="openai")], requests_per_stage=20)
    table, stages = synth_table(shape)
    eng = engine_table(counters("vl", {"vllm:prefix_cache_hits_total": 200.0,
                                       "vllm:prefix_cache_queries_total": 500.0,
                                       "vllm:prompt_tokens_total": 500.0,
                                       "vllm:generation_tokens_total": 50.0}))
    d = load([write_run(tmp_path / "run", table, run_meta(shape, stages), engine=eng)])
    sampled = {r["quantity"]: r["engine"] for r in E.comparison(d.engine, d.frame)}
    around = {r["quantity"]: r["engine"] for r in E.comparison(d.engine, d.frame, None, got)}
    assert sampled["prompt tokens"] == pytest.approx(500.0 * 29)
    assert around == {"prompt tokens": 1500.0, "cached tokens": 190.0,
                      "completion tokens": 70.0}
