"""describe_sent / sent_descriptions: the theoretical hit ratio of exactly the requests sent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvbench.workloads.base import Request
from kvbench.workloads.describe import base_request_id, describe, describe_sent, sent_descriptions
from kvbench.workloads.tokenizer import get_tokenizer

A = [f"a{i}" for i in range(8)]
B = [f"b{i}" for i in range(4)]


def req(rid: str, *names: str) -> Request:
    prompt = "".join(f" {n}" for n in names)
    return Request(request_id=rid, request_class="rag", max_tokens=4,
                   prompt_tokens=get_tokenizer().count(prompt), shared_prefix_tokens=0,
                   session_id=rid, prompt=prompt)


class Wl:
    """A workload of fixed requests; counts how many requests() hands out."""

    def __init__(self, reqs, then_fail=False):
        self.reqs, self.then_fail, self.handed = reqs, then_fail, 0

    def requests(self):
        for r in self.reqs:
            self.handed += 1
            yield r
        if self.then_fail:
            raise AssertionError("walked past the last sent request")


R0 = req("r0", *A)  # 8 tokens: 2 blocks of 4
R1 = req("r1", *A, *B)  # 12 tokens: 3 blocks, the first 2 are R0's
R2 = req("r2", *B, *A)  # 12 tokens, another start


def test_base_request_id():
    assert base_request_id("rag-000001") == "rag-000001"
    assert base_request_id("agent-s1-t000#3") == "agent-s1-t000"
    assert base_request_id("odd#name") == "odd#name"
    assert base_request_id("#2") == "#2"


def test_order_subset_and_repeats_hand_computed():
    wl = Wl([R0, R1, R2])
    d = describe_sent(wl, ["r1", "r0"], block_tokens=4)
    assert d["requests"] == 2 and d["total_prompt_tokens"] == 20
    assert d["theoretical_hit_ratio_unbounded"] == pytest.approx(8 / 20)  # r0 after r1
    d = describe_sent(wl, ["r0", "r0#1", "r0#2"], block_tokens=4)  # later passes hit fully
    assert d["theoretical_hit_ratio_unbounded"] == pytest.approx(16 / 24)
    assert d["unmatched"] == 0 and d["requests_sent"] == 3
    d = describe_sent(wl, ["r0", "zz", "r2"], block_tokens=4)
    assert d["unmatched"] == 1 and d["unmatched_examples"] == ["zz"] and d["requests"] == 2
    assert d["theoretical_hit_ratio_unbounded"] == 0.0
    d = describe_sent(wl, ["r0", "r1", "r0#1"], block_tokens=4, capacity_tokens=8)
    assert d["theoretical_hit_ratio_lru"] == pytest.approx(16 / 28)  # r1's tail evicted first
    d = describe_sent(wl, ["r0", "r2", "r0#1"], block_tokens=4, capacity_tokens=8)
    assert d["theoretical_hit_ratio_unbounded"] == pytest.approx(8 / 28)
    assert d["theoretical_hit_ratio_lru"] == 0.0  # r2's 3 blocks pushed r0's 2 out


def test_per_replica_hits_hand_computed():
    wl = Wl([R0, R1, R2])
    d = describe_sent(wl, ["r0", "r1", "r1#1"], replicas=["x", "y", "x"], block_tokens=4)
    # pooled: r1 hits r0's 2 blocks, r1#1 hits all 3 -> 20 of 32
    assert d["theoretical_hit_ratio_unbounded"] == pytest.approx(20 / 32)
    # per replica: y never saw r0; x saw r0, so r1#1 hits 2 blocks -> 8 of 32
    assert d["theoretical_hit_ratio_per_replica"] == pytest.approx(8 / 32)
    assert d["replicas"] == 2 and d["requests_hit_elsewhere"] == 2
    one = describe_sent(wl, ["r0", "r1"], replicas=["x", "x"], block_tokens=4)
    assert one["theoretical_hit_ratio_per_replica"] is None and one["replicas"] == 1
    with pytest.raises(ValueError):
        describe_sent(wl, ["r0"], replicas=["x", "y"])


def test_stops_walking_the_workload_once_everything_is_found():
    wl = Wl([R0, R1, R2], then_fail=True)
    describe_sent(wl, ["r1#4", "r0"], block_tokens=4)
    assert wl.handed == 2


words = st.lists(st.sampled_from([f"w{i}" for i in range(6)]), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.lists(words, min_size=1, max_size=12), st.integers(1, 8),
       st.lists(st.integers(0, 2), min_size=12, max_size=12))
def test_all_sent_in_order_equals_describe(prompts, bt, reps):
    reqs = [req(f"q{i}", *p) for i, p in enumerate(prompts)]
    ids = [r.request_id for r in reqs]
    whole = describe(reqs, block_tokens=bt, capacity_tokens=5 * bt)
    got = describe_sent(Wl(reqs), ids, replicas=[f"r{x}" for x in reps[:len(ids)]],
                        block_tokens=bt, capacity_tokens=5 * bt)
    for k in ("requests", "unique_tokens", "total_prompt_tokens",
              "theoretical_hit_ratio_unbounded", "theoretical_hit_ratio_lru"):
        assert got[k] == whole[k]
    if got["replicas"] >= 2:
        assert got["theoretical_hit_ratio_per_replica"] <= got["theoretical_hit_ratio_unbounded"]
        assert (got["requests_hit_elsewhere"] == 0) == (
            got["theoretical_hit_ratio_per_replica"] == got["theoretical_hit_ratio_unbounded"])


def test_sent_descriptions_groups_orders_and_filters():
    wl = Wl([R0, R1, R2])
    rec = {
        "endpoint": ["e1", "e1", "e1", "e2", "e2", "e1"],
        "workload": ["w", "w", "w", "w", "w", "other"],
        "request_id": ["r1", "r0", "r2", "r0", "r1", "r0"],
        "t_sent_ns": [20, 10, 30, 5, 6, 1],
        "status": ["ok", "ok", "http_error", "ok", "timeout", "ok"],
        "ttft_ns": [1, 1, None, 1, 7, 1],
        "server_replica": ["x", "y", None, "x", "x", "x"],
    }
    out = sent_descriptions(rec, {"w": wl}, {"e2": {"block_tokens": 4, "capacity_tokens": 64}})
    assert set(out) == {"e1", "e2"} and set(out["e1"]) == {"w"}  # "other" not given
    e1 = out["e1"]["w"]  # r0 (t=10, y) then r1 (t=20, x); r2 failed before any token
    assert e1["requests"] == 2 and e1["block_tokens"] == 16
    assert e1["theoretical_hit_ratio_unbounded"] == 0.0  # 16-token blocks: nothing is full
    e2 = out["e2"]["w"]  # r0 then r1; the timeout had a first token, so it was prefilled
    assert e2["requests"] == 2 and e2["capacity_tokens"] == 64
    assert e2["theoretical_hit_ratio_unbounded"] == pytest.approx(8 / 20)
    assert e2["theoretical_hit_ratio_per_replica"] is None  # one replica


@settings(max_examples=60, deadline=None)
@given(st.lists(words, min_size=1, max_size=10), st.data())
def test_any_send_order_with_passes_equals_describe_of_that_order(prompts, data):
    """Out of order, repeated (``#pass``) and unknown ids: the same as describing the matched
    requests in that order."""
    reqs = [req(f"q{i}", *p) for i, p in enumerate(prompts)]
    picks = data.draw(st.lists(st.tuples(st.integers(-1, len(reqs) - 1), st.integers(0, 2)),
                               min_size=1, max_size=25))
    ids = [("nope" if i < 0 else reqs[i].request_id) + (f"#{n}" if n else "")
           for i, n in picks]
    order = [reqs[i] for i, _ in picks if i >= 0]
    wl = Wl(reqs)
    got = describe_sent(wl, ids, block_tokens=4, capacity_tokens=12)
    want = describe(order, block_tokens=4, capacity_tokens=12)
    for k in ("requests", "unique_tokens", "total_prompt_tokens",
              "theoretical_hit_ratio_unbounded", "theoretical_hit_ratio_lru", "classes"):
        assert got[k] == want[k]
    assert got["unmatched"] == sum(i < 0 for i, _ in picks)
    assert wl.handed <= len(reqs)  # one forward walk
