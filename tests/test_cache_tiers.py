"""The prefix-cache check counts every tier: the engine's hits are its HBM hits plus those its
offload tiers served (vLLM's external prefix-cache counters, LMCache's), the theoretical ratio
models the tiers below HBM, and a difference that the requests cut in flight account for is
no finding."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pytest

from kvbench import engines
from kvbench.config import BuiltinEndpoint
from kvbench.core.contract import CacheState, CacheTheory
from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.analysis.cache_verify import verify
from kvbench.runs import builtin, cache

from synthetic import engine_table


def _frame(done: int, cut: int = 0, prompt: float = 100.0, cached: float = 80.0,
           completion: float = 8.0) -> pd.DataFrame:
    n = done + cut
    return pd.DataFrame({
        "endpoint": pd.Categorical(["e"] * n), "workload": ["w"] * n, "t_sent_ns": [10] * n,
        "cancelled": [False] * done + [True] * cut,
        # a request cut in flight: its prompt as the client counted it, no usage
        "prompt_tokens": [prompt] * n, "cached_tokens": [cached] * done + [float("nan")] * cut,
        "completion_tokens": [completion] * done + [2.0] * cut})


def _entry(after: dict, engine: str = "builtin", theo: float = 0.8) -> CacheState:
    before = {k: 0.0 for k in after}
    return CacheState(endpoint="e", workload="w", engine=engine, t_start_ns=0, t_end_ns=20,
                      started_from="warm", counters_before=before, counters_after=after,
                      theoretical=CacheTheory(hit_ratio_unbounded=theo, block_tokens=16,
                                              hit_ratio_finished=theo))


def test_hits_served_from_offload_tiers_count_with_hbms():
    # 50 requests of 100 prompt tokens, 80 cached each: 1,000 from HBM, 3,000 from DRAM
    after = {"hits": 1000.0, "queries": 5000.0, "prompt": 5000.0, "generation": 400.0,
             "tier_hits": 3000.0}
    r = verify(_entry(after), _frame(50))
    assert r["engine_ratio"] == pytest.approx(0.8)
    assert r["records_ratio"] == pytest.approx(0.8)
    assert r["engine_hits"] == r["records_cached"] == 4000 and r["findings"] == []
    # an engine whose tier hits are not read: HBM alone disagrees with the records
    r = verify(_entry({k: v for k, v in after.items() if k != "tier_hits"}), _frame(50))
    assert r["engine_ratio"] == pytest.approx(0.2)
    assert any("counts hits differently" in x for x in r["findings"])


def test_what_requests_cut_in_flight_account_for_is_no_finding():
    # 50 answered (as above) and 10 cut in flight: the engine counted their 1,000 prompt
    # tokens (600 of them cached) and the 20 tokens streamed to them
    after = {"hits": 1600.0, "queries": 6000.0, "prompt": 6000.0, "generation": 420.0,
             "tier_hits": 3000.0}
    r = verify(_entry(after), _frame(50, cut=10))
    assert r["cancelled"] == 10 and r["findings"] == [], r["findings"]
    assert len(r["explained"]) == 3 and all("cut in flight" in x for x in r["explained"])
    # more than the cut requests could hold: another client, a finding
    after.update(prompt=7000.0, queries=7000.0)
    r = verify(_entry(after), _frame(50, cut=10))
    assert any("another client" in x for x in r["findings"])


def test_all_zero_ratios_with_cut_requests_raise_nothing():
    # long documents, nothing shared: records, engine and theory all 0%, many requests cut
    after = {"hits": 0.0, "queries": 9000.0, "prompt": 9000.0, "generation": 450.0,
             "tier_hits": 0.0}
    r = verify(_entry(after, theo=0.0), _frame(50, cut=40, cached=0.0))
    assert (r["records_ratio"], r["engine_ratio"]) == (0.0, 0.0)
    assert r["findings"] == []


def test_engine_counters_over_a_run_add_the_external_tier():
    samples = []
    for t, (h, q, x) in enumerate([(0, 0, 0), (100, 1000, 700)]):
        samples += [(t * 10**9, "off", "vllm:prefix_cache_hits_total", {}, h),
                    (t * 10**9, "off", "vllm:prefix_cache_queries_total", {}, q),
                    (t * 10**9, "off", "vllm:external_prefix_cache_hits_total", {}, x),
                    (t * 10**9, "lm", "vllm:prefix_cache_hits_total", {}, h),
                    (t * 10**9, "lm", "vllm:prefix_cache_queries_total", {}, q),
                    (t * 10**9, "lm", "lmcache:num_hit_tokens_total", {}, x / 2),
                    (t * 10**9, "hbm", "vllm:prefix_cache_hits_total", {}, h),
                    (t * 10**9, "hbm", "vllm:prefix_cache_queries_total", {}, q)]
    table = engine_table(samples)
    ratios = E.hit_ratio(table)
    assert ratios == pytest.approx({"off": 0.8, "lm": 0.45, "hbm": 0.1}), ratios
    assert E.tier_hits(table)["off"] == ("vllm:external_prefix_cache_hits_total", 700.0)
    # LMCache's counter only where vLLM's is not published (they count the same hits)
    assert engines.get("vllm").tier_hits[0] == "vllm:external_prefix_cache_hits_total"


@dataclass
class _Req:
    request_id: str
    prompt: str
    messages: None = None


class _Workload:
    def __init__(self, prompts: dict[str, str]):
        self.prompts = prompts

    def requests(self):
        return [_Req(i, p) for i, p in self.prompts.items()]


def test_the_theoretical_ratio_models_the_tiers_below_hbm():
    a = " ".join(f"alpha{i}" for i in range(400))
    b = " ".join(f"beta{i}" for i in range(400))
    wl = _Workload({"a1": a, "b1": b, "a2": a + " again", "b2": b + " again"})
    ids = ["a1", "b1", "a2", "b2"]
    from kvbench.workloads.tokenizer import get_tokenizer

    one = len(get_tokenizer().tokens(a))  # HBM holds one prompt, not two
    hbm = cache.theoretical(wl, ids, [], 16, one + 32)
    tiers = cache.theoretical(wl, ids, [], 16, one + 32, tiers=10 * one)
    unbounded = cache.theoretical(wl, ids, [], 16, one + 32, tiers=True)
    assert hbm.hit_ratio_lru < 0.1  # each prompt evicted from HBM before its reuse
    assert tiers.hit_ratio_lru == pytest.approx(hbm.hit_ratio_unbounded)  # held below HBM
    assert tiers.hit_ratio_lru > 0.4
    assert tiers.tier_tokens == 10 * one and hbm.tier_tokens is None
    assert unbounded.hit_ratio_lru is None and unbounded.tiers_unbounded
    # the ratio over the requests that finished (the records' side), the cache over all
    every = cache.theoretical(wl, ids, [], 16, one + 32, finished=[True] * 4, tiers=10 * one)
    assert every.hit_ratio_finished == pytest.approx(tiers.hit_ratio_lru)
    cut = cache.theoretical(wl, ids, [], 16, one + 32, finished=[True, True, False, True],
                            tiers=10 * one)  # the second "a" was cut in flight: its hit too
    assert cut.requests_finished == 3
    assert 0.2 < cut.hit_ratio_finished < tiers.hit_ratio_lru  # b's reuse is still counted


def test_the_offloaded_builtin_publishes_its_tiers():
    proc, url = builtin.start(BuiltinEndpoint(name="off", topology="offloaded",
                                              options={"time_scale": 0.05}))
    try:
        got = cache.read_counters(url + "/metrics", engines.get("builtin"), {})
    finally:
        builtin.stop(proc)
    assert got["tier_hits"] == 0.0 and got["tier_capacity_tokens"] > got["capacity_tokens"]
    from kvbench.endpoints.metrics import TIER_CAPACITY

    assert TIER_CAPACITY == cache.TIER_CAPACITY
