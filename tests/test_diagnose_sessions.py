"""The diagnosis says why one endpoint serves more agent sessions than another (issue 36): a
closed-loop search of sessions on two endpoints, one whose hit ratio collapses once sessions x
context outgrows its HBM, one with offload tiers whose hits hold. The finding ranks them by
sessions per GPU and names, per endpoint, the working set against the KV it keeps and what
broke it; without a collapse (both keep their hits) it stays silent."""

from __future__ import annotations

import pyarrow as pa

from kvbench.core.contract import (CacheState, CacheTheory, EndpointEntry, RunMeta, SearchNote,
                                   StageEntry)
from kvbench.core.schema import REQUESTS
from kvbench.reports.analysis import diagnose as D
from kvbench.reports.measures.data import ReportData
from kvbench.reports.statistics import metrics as M

T0 = 10**18
SLO = {"trace": {"ttft_ms": 20000}}
HBM = 450_000


def _probe(ep: str, index: int, users: int, t0: int, context: int, hit: float,
           ttft_s: float, turns: int = 4) -> list[dict]:
    """``users`` sessions of ``turns`` requests each, every one re-sending ``context`` tokens
    of which ``hit`` were cached, answered after ``ttft_s``."""
    rows = []
    for u in range(users):
        for k in range(turns):
            t = t0 + int((u * turns + k) * 1e8)
            rows.append(dict(
                run_id="r", endpoint=ep, topology=ep, workload="agentic",
                request_class="trace", stage=index, request_id=f"{ep}-{index}-{u}-{k}",
                session_id=f"agentic-{index}-{u}", turn=k, worker="h:1",
                prompt_tokens=context, cached_tokens=int(hit * context), completion_tokens=20,
                t_scheduled=t, t_sent=t, connect_ns=0, ttft_ns=int(ttft_s * 1e9),
                chunk_offsets_ns=[int(ttft_s * 1e9), int((ttft_s + 0.4) * 1e9)],
                chunk_tokens=[1, 19], e2e_ns=int((ttft_s + 0.4) * 1e9), status="ok",
                http_status=200, error=None))
    return rows


def _data(plans: dict[str, list[tuple[int, str, float, float]]],
          tiers: dict[str, int | None]) -> ReportData:
    """Per endpoint, its probes in order as (users, verdict, hit ratio, TTFT s)."""
    rows, stages, states = [], [], []
    for ep, probes in plans.items():
        t0 = T0
        for i, (users, verdict, hit, ttft) in enumerate(probes):
            rows += _probe(ep, i, users, t0, 70_000, hit, ttft)
            stages.append(StageEntry(endpoint=ep, workload="agentic", index=i, pacing="closed",
                                     users=users, duration_s=300, t_start_ns=t0,
                                     t_end_ns=t0 + int(300e9),
                                     search=SearchNote(role="ramp", verdict=verdict, why="t")))
            t0 += int(400e9)
        states.append(CacheState(endpoint=ep, workload="agentic", theoretical=CacheTheory(
            capacity_tokens=HBM, tier_tokens=tiers.get(ep), block_tokens=16)))
    table = pa.table({n: pa.array([r.get(n) for r in rows], t)
                      for n, t in zip(REQUESTS.names, REQUESTS.types)}, schema=REQUESTS)
    empty = pa.table({"endpoint": pa.array([], pa.string())})
    frame = M.request_frame(table, stages=[s.to_dict() for s in stages], slo=SLO)
    run = RunMeta(run_id="r", cache_states=states)
    eps = {ep: EndpointEntry(name=ep, kind="builtin", topology=ep, gpus=1) for ep in plans}
    return ReportData(frame=frame, runs=[run], paths=[], gpu=empty, engine=empty, slo=SLO,
                      endpoints=eps, endpoint_runs={ep: "r" for ep in plans}, stages=stages)


def test_the_endpoint_that_loses_the_working_set_is_named_and_ranked_below():
    d = _data({"colocated": [(12, "pass", 0.90, 3.0), (16, "fail", 0.30, 40.0)],
               "offloaded": [(12, "pass", 0.93, 3.0), (16, "pass", 0.93, 5.0),
                             (21, "fail", 0.92, 30.0)]},
              tiers={"offloaded": 4_000_000})
    found = [x for x in D.diagnose(d) if x.rule == "session_cache"]
    assert len(found) == 1
    x = found[0]
    assert x.title.startswith("agentic: offloaded serves the most agent sessions per GPU")
    assert "colocated loses" in x.title
    n = x.numbers
    assert n["colocated"]["lost"] and not n["offloaded"]["lost"]
    # the working set at the failure: 16 sessions x 70k tokens, against 450k of HBM
    assert n["colocated"]["working_set"] == 16 * 70_000
    assert n["colocated"]["hit_pass"] == 0.9 and n["colocated"]["hit_fail"] == 0.3
    ev = dict(x.evidence)
    assert "16 sessions x 70,000 tokens of context" in ev["colocated: what broke it"]
    assert "the cache lost the working set" in ev["colocated: what broke it"]
    assert "offload tiers" in ev["offloaded: what broke it"]
    assert "the hits held" in ev["offloaded: what broke it"]
    # ranked by sessions per GPU: offloaded first in the evidence
    assert [k for k, _ in x.evidence][0] == "offloaded: sessions at SLO"
    # the sentence the verdict prints under its ranking
    assert n["workload"] == "agentic"
    assert ("offloaded kept it in its offload tiers (21 sessions x 70k tokens = 1.47M tokens "
            "of KV; hit ratio 92.0%)") in n["summary"]
    assert ("colocated lost it (16 sessions x 70k tokens = 1.12M tokens of KV against 450k of "
            "HBM; hit ratio 30.0%)") in n["summary"]


def test_silent_when_every_endpoint_keeps_its_hits():
    d = _data({"colocated": [(12, "pass", 0.93, 3.0), (16, "fail", 0.92, 40.0)],
               "offloaded": [(12, "pass", 0.93, 3.0), (16, "fail", 0.93, 30.0)]},
              tiers={"offloaded": 4_000_000})
    assert not [x for x in D.diagnose(d) if x.rule == "session_cache"]


def test_silent_with_one_endpoint():
    d = _data({"colocated": [(12, "pass", 0.90, 3.0), (16, "fail", 0.30, 40.0)]}, tiers={})
    assert not [x for x in D.diagnose(d) if x.rule == "session_cache"]
