"""Why one endpoint serves more concurrent agent sessions than another: the KV working set.

An agent session re-sends its whole context each turn (tens of thousands of tokens, almost all
of it cached when the cache still holds it). A closed-loop search of sessions at SLO therefore
finds where the working set, sessions x context, outgrows the KV an endpoint keeps: past HBM
a colocated engine evicts contexts, its hit ratio falls and the misses prefill up to a whole
context again, queueing every other session's first token; an engine with offload tiers (CPU
DRAM, disk) reloads the evicted context instead and breaks later, on the prefill of what is
truly new. The rule reads what each endpoint's search measured at its capacity and at its
first failure (sessions, mean context, prefix hit ratio from the records) beside the KV it
keeps (run.json ``cache_states``: HBM per replica, offload tiers), ranks the endpoints as the
capacity table does (sessions per GPU), and says per endpoint what broke it.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvbench.reports.analysis import capacity as C
from kvbench.reports.analysis.diagnose.base import MIN_ROWS, Finding, _fmt
from kvbench.reports.measures.data import ReportData
from kvbench.reports.statistics import metrics as M

MULTI_TURN = 2.0  # mean requests per session at least this: a workload of sessions
HIT_DROP = 0.10  # the hit ratio at the failure this far (points) below the capacity's: a cache
# that lost the working set; or this far below the best endpoint's at its own failure


def _kv_of(d: ReportData, ep: str, wl: str) -> tuple[int | None, int | None]:
    """(HBM KV tokens per replica, offload-tier tokens per replica) of endpoint label ``ep``
    from run.json ``cache_states`` (the engine's cache config, or a built-in's settings)."""
    name, run_id = d.endpoint(ep).name, d.endpoint_runs.get(ep)
    hbm = tiers = None
    for run in d.runs:
        if run_id is not None and str(run.run_id) != str(run_id):
            continue
        for st in run.cache_states or []:
            if st.endpoint != name or (st.workload not in (None, wl)):
                continue
            theo = st.theoretical
            if theo is None:
                continue
            hbm = hbm or theo.capacity_tokens
            tiers = tiers or theo.tier_tokens
    return (None if hbm is None else int(hbm)), (None if tiers is None else int(tiers))


def _at(sub: pd.DataFrame, stages: dict[int, float], users: float | None) -> dict | None:
    """Requests of the probes run at ``users``: how many, their mean context (prompt tokens)
    and prefix hit ratio (records)."""
    if users is None:
        return None
    idx = [i for i, u in stages.items() if u == users]
    rows = sub[sub["stage"].isin(idx).to_numpy()]
    ok = rows[rows["ok"].to_numpy(bool)]
    if len(ok) < MIN_ROWS:
        return None
    return {"users": float(users), "n": len(ok),
            "context": float(np.nanmean(ok["prompt_tokens"].to_numpy(np.float64))),
            "hit": M.hit_ratio(ok)}


def _sessions(sub: pd.DataFrame) -> bool:
    sid = sub["session_id"].astype(object)
    sid = sid[sid.notna().to_numpy()]
    return len(sid) > 0 and len(sid) / max(1, sid.nunique()) >= MULTI_TURN


def session_cache(d: ReportData) -> list[Finding]:
    """Per workload of agent sessions searched on two or more endpoints (closed loop, users):
    their ranking by sessions at SLO per GPU and, per endpoint, the working set against its
    KV and the hit ratio at its capacity and at its first failure. Fires where at least one
    endpoint's working set at its failure exceeds its HBM and its hit ratio there fell (from
    its capacity's, or below the best endpoint's): the cache, not the compute, decided."""
    caps = [c for c in C.summarise(d.stages, d.frame, d.slo) if c.unit == "users"]
    f = d.frame
    out = []
    for wl in sorted({c.workload for c in caps}):
        rows = []
        for c in (c for c in caps if c.workload == wl):
            ep = c.endpoint
            sub = f[(f["endpoint"].astype(str) == ep).to_numpy()
                    & (f["workload"].astype(str) == wl).to_numpy()]
            if not len(sub) or not _sessions(sub):
                continue
            stages = {s.index: C.level(s) for s in d.stages
                      if s.endpoint == ep and s.workload == wl and s.search is not None
                      and s.search.verdict in ("pass", "fail")}
            hbm, tiers = _kv_of(d, ep, wl)
            gpus = d.endpoint(ep).gpus or 1
            rows.append({"endpoint": ep, "cap": c, "gpus": gpus, "hbm": hbm, "tiers": tiers,
                         "per_gpu": (c.estimate_rps / gpus if c.estimate_rps is not None
                                     else None),
                         "pass": _at(sub, stages, c.capacity_rps),
                         "fail": _at(sub, stages, c.fail_rps)})
        if len(rows) < 2:
            continue
        best_hit = max((r["fail"]["hit"] for r in rows if r["fail"]
                        and not math.isnan(r["fail"]["hit"])), default=math.nan)
        lost = []
        for r in rows:
            p, x = r["pass"], r["fail"]
            r["working_set"] = x["users"] * x["context"] if x else None
            r["lost"] = bool(
                x and r["hbm"] and r["working_set"] > r["hbm"] and not math.isnan(x["hit"])
                and ((p and p["hit"] - x["hit"] >= HIT_DROP) or best_hit - x["hit"] >= HIT_DROP))
            if r["lost"]:
                lost.append(r["endpoint"])
        if not lost:
            continue
        rows.sort(key=lambda r: -(r["per_gpu"] if r["per_gpu"] is not None else -1.0))
        ev = [(f"{r['endpoint']}: sessions at SLO", _capacity_text(r)) for r in rows]
        ev += [(f"{r['endpoint']}: what broke it", _why(r)) for r in rows]
        first = rows[0]
        title = (f"{wl}: {first['endpoint']} serves the most agent sessions per GPU; "
                 f"{', '.join(lost)} lose{'s' if len(lost) == 1 else ''} the sessions' KV "
                 "working set")
        cause = ("each session re-sends its whole context every turn: once sessions x context "
                 "outgrows the KV an endpoint keeps (HBM, plus its offload tiers), contexts are "
                 "evicted between turns, the hit ratio falls and every miss prefills its context "
                 "again, queueing the other sessions' first tokens; " + "; ".join(
                     f"{r['endpoint']} ({'HBM + offload tiers' if r['tiers'] else 'HBM only'})"
                     f" {'lost it' if r['lost'] else 'kept it'}" for r in rows))
        fix = ("for agent sessions whose working set exceeds HBM, keep evicted contexts below "
               "HBM (a KV offload tier in CPU DRAM or on disk: LMCache, vLLM's CPU offload, "
               "Dynamo KVBM) or give each session more HBM (fewer sessions per GPU, more "
               "replicas behind a session-pinning router)")
        numbers = {"workload": wl, "summary": _summary(rows)}
        out.append(Finding("session_cache", title, ev, cause, fix, severity="warning",
                           numbers=numbers | {r["endpoint"]: {
                               "sessions": r["cap"].estimate_rps, "per_gpu": r["per_gpu"],
                               "hbm_tokens": r["hbm"], "tier_tokens": r["tiers"],
                               "working_set": r["working_set"], "lost": r["lost"],
                               "hit_pass": (r["pass"] or {}).get("hit"),
                               "hit_fail": (r["fail"] or {}).get("hit")} for r in rows}))
    return out


def _summary(rows: list[dict]) -> str:
    """One sentence for the verdict: who lost the working set and who kept it, with the
    numbers at each endpoint's first failure."""
    parts = []
    for r in rows:
        x = r["fail"]
        if x is None:
            parts.append(f"{r['endpoint']} failed no count within its search")
            continue
        at = (f"{_n(x['users'])} sessions x {x['context'] / 1e3:,.0f}k tokens = "
              f"{x['users'] * x['context'] / 1e6:,.2f}M tokens of KV")
        if r["lost"]:
            parts.append(f"{r['endpoint']} lost it ({at} against {r['hbm'] / 1e3:,.0f}k of "
                         f"HBM; hit ratio {_fmt(x['hit'], '%')})")
        elif r["tiers"]:
            parts.append(f"{r['endpoint']} kept it in its offload tiers ({at}; hit ratio "
                         f"{_fmt(x['hit'], '%')}) and broke on prefill queueing")
        else:
            parts.append(f"{r['endpoint']} kept its hits ({at}; hit ratio "
                         f"{_fmt(x['hit'], '%')}) and broke on queueing")
    return ("the agent sessions' KV working set (sessions x context, re-sent every turn) "
            "decided, at each endpoint's first failing count: " + "; ".join(parts) + ".")


def _capacity_text(r: dict) -> str:
    c = r["cap"]
    if c.estimate_rps is None:
        return f"none (failed at {_n(c.fail_rps)} sessions)"
    per = f", {r['per_gpu']:.1f} per GPU ({r['gpus']} GPUs)" if r["gpus"] > 1 else " (1 GPU)"
    bracket = (f"passed {_n(c.capacity_rps)}, failed {_n(c.fail_rps)}"
               if c.fail_rps is not None else f"passed {_n(c.capacity_rps)}, nothing failed")
    return f"{c.estimate_rps:.1f}{per}; {bracket}"


def _why(r: dict) -> str:
    p, x = r["pass"], r["fail"]
    kv = (f"HBM {r['hbm']:,} tokens" if r["hbm"] else "HBM size not published") + (
        f" + {r['tiers']:,} in offload tiers" if r["tiers"] else "")
    if x is None:
        return f"nothing failed within the search; {kv}"
    ws = (f"{_n(x['users'])} sessions x {x['context']:,.0f} tokens of context = "
          f"{x['users'] * x['context']:,.0f} tokens of working set")
    hits = (f"hit ratio {_fmt(p['hit'], '%')} at {_n(p['users'])} sessions, "
            f"{_fmt(x['hit'], '%')} at {_n(x['users'])}" if p else
            f"hit ratio {_fmt(x['hit'], '%')} at {_n(x['users'])} sessions")
    if r["lost"]:
        verdict = "the cache lost the working set: re-prefills queued the first tokens"
    elif not r["hbm"]:
        verdict = "it broke with its hit ratio held (its KV size is not published)"
    elif x["users"] * x["context"] > r["hbm"]:
        verdict = ("the working set outgrew HBM but the hits held"
                   + (" (reloaded from the offload tiers)" if r["tiers"] else "")
                   + ": it broke on prefill and decode queueing")
    else:
        verdict = "the working set fits HBM: it broke on prefill and decode queueing"
    return f"{ws} against {kv}; {hits}; {verdict}"


def _n(x: float | None) -> str:
    return "–" if x is None else f"{x:g}"
