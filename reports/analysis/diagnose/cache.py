"""Findings on the prefix cache: hits lost against what the requests sent allow (to routing
that spreads shared prefixes, or an engine that does not reuse them), and the KV cache evicted
under load (HBM full: preemptions, prompts prefilled again)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.statistics import metrics as M
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose.base import MIN_ROWS, Finding, _fmt, _median
from kvbench.reports.analysis.diagnose.search import exempt, keep_mask, windows

# Lost prefix hits. Against the theoretical ratio of exactly the requests sent (per endpoint),
# an engine that reuses every prefix it holds realises nearly all of it (the built-in colocated
# and cache-aware routed endpoints: 97-100%); it misses a little more when a request arrives
# while the same prefix is still being prefilled. Round robin over 4 replicas recomputes each
# shared prefix up to 4 times: on short RAG runs it realises 50-60% of the reachable hits.
SENT_HIT_RATIO_FRACTION = 0.8  # measured below 80% of the sent requests' theoretical ratio ...
SENT_HIT_RATIO_GAP = 0.05  # ... and at least 5 points below it
# Runs that did not record what was sent: the whole workload's ratio overstates it.
HIT_RATIO_FRACTION = 0.5
HIT_RATIO_GAP = 0.10
SPREAD_LOSS = 0.10  # per-replica theoretical 10% (relative) below one shared cache: spreading
SPREAD_SESSIONS = 0.25  # or a quarter of multi-turn sessions served by several replicas
REPREFILL_MIN = 3  # re-prefilled requests needed ...
REPREFILL_SHARE = 0.02  # ... and their share of requests that had a hit before


def _sent_descriptions(d: ReportData, ep: str) -> dict | None:
    """run.json ``workloads_sent[<endpoint>]`` of the run that holds endpoint label ``ep``;
    None when that run did not record it (written before kvbench stored it)."""
    name, run_id = d.endpoint(ep).name, d.endpoint_runs.get(ep)
    got = None
    for run in d.runs:
        if run_id is not None and str(run.run_id) != str(run_id):
            continue
        if run.workloads_sent is None:
            continue
        got = run.workloads_sent.get(name) or {}
        if got:
            break
    return got


def _theoretical(desc: dict) -> tuple[float | None, str]:
    """The hit ratio a perfect router over this engine could reach: LRU at the engine's KV
    capacity where it is known, else an unbounded cache."""
    lru = desc.get("theoretical_hit_ratio_lru")
    cap = desc.get("capacity_tokens")
    if lru is not None and cap:
        return float(lru), (f"LRU at {int(cap):,} tokens of KV per replica, "
                            f"{desc.get('block_tokens')}-token blocks")
    theo = desc.get("theoretical_hit_ratio_unbounded")
    return (None if theo is None else float(theo)), (
        f"unbounded cache, {desc.get('block_tokens', 16)}-token blocks")


def _measured(sub: pd.DataFrame, ep: str, engine_hits: dict) -> tuple[float, str]:
    measured = M.hit_ratio(sub)
    if not math.isnan(measured):
        return measured, "server cached_tokens / prompt tokens"
    if ep in engine_hits:
        return engine_hits[ep], "engine prefix-cache counters"
    return math.nan, ""


def prefix_hits_lost(d: ReportData) -> list[Finding]:
    """Measured prefix hit ratio far below the theoretical one of the requests the endpoint
    was actually sent (run.json ``workloads_sent``)."""
    out = []
    f = d.frame
    engine_hits = E.hit_ratio(d.engine)
    lean = M.slim(f, ("endpoint", "workload", "server_replica", "session_id"))
    for (ep, wl), sub in lean.groupby(["endpoint", "workload"], observed=True):
        ep, wl = str(ep), str(wl)
        if len(sub) < MIN_ROWS:
            continue
        sent = _sent_descriptions(d, ep)
        if sent is not None:
            desc = sent.get(wl)
            if not desc or not desc.get("requests"):
                continue
            theo, how = _theoretical(desc)
            fraction, gap = SENT_HIT_RATIO_FRACTION, SENT_HIT_RATIO_GAP
            basis = f"theoretical for the {desc['requests']:,} requests sent ({how})"
        else:  # an older run.json: only the whole workload's summary
            desc = d.workloads.get(wl) or {}
            theo = desc.get("theoretical_hit_ratio_unbounded")
            theo = None if theo is None else float(theo)
            fraction, gap = HIT_RATIO_FRACTION, HIT_RATIO_GAP
            basis = "theoretical for the whole workload (the run did not record what was sent)"
        if theo is None:
            continue
        measured, source = _measured(sub, ep, engine_hits)
        if math.isnan(measured):
            continue
        if not (measured < fraction * theo and theo - measured >= gap):
            continue
        ev = [("measured prefix hit ratio", f"{_fmt(measured, '%')} ({source}, "
               f"{len(sub):,} requests)"),
              (basis, _fmt(theo, "%")),
              ("share of the reachable hits realised",
               f"{measured / theo:.0%} (a finding below {fraction:.0%})" if theo > 0 else "n/a")]
        spread = _spread_evidence(sub, desc)
        ev.extend(spread["evidence"])
        numbers = {"measured": measured, "theoretical": theo,
                   "per_replica": spread.get("per_replica"), "replicas": spread["replicas"]}
        if spread["routing"]:
            title = f"{ep}: prefix hits lost to routing that spreads shared prefixes"
            cause = ("requests that share a prefix are spread over replicas without "
                     "cache-aware routing (round robin), so each replica computes the prefix "
                     "again into its own cold cache")
            fix = ("route on a prefix hash (a cache-aware router such as the vLLM or llm-d "
                   "router), or at least pin sessions to a replica")
        else:
            title = f"{ep}: prefix hit ratio far below what {wl} allows"
            cause = ("the engine does not reuse prefixes it has seen: prefix caching is off, "
                     "prefixes are evicted before reuse (KV capacity), or requests are spread "
                     "over replicas the records do not name")
            fix = ("enable prefix caching (vLLM --enable-prefix-caching); if the KV cache is "
                   "full, add capacity or a KV offload tier; behind a load balancer, route on a "
                   "prefix hash")
        out.append(Finding("prefix_hits_lost", title, ev, cause, fix, endpoint=ep,
                           severity="critical", numbers=numbers))
    return out


def _spread_evidence(sub: pd.DataFrame, desc: dict) -> dict:
    """How the records and the sent-request summary show prefixes spread over replicas."""
    ev: list[tuple[str, str]] = []
    replicas = int(sub["server_replica"].nunique())
    got = {"evidence": ev, "replicas": replicas, "routing": False}
    if replicas < 2:
        return got
    ev.append(("replicas serving", str(replicas)))
    theo = desc.get("theoretical_hit_ratio_unbounded")
    per = desc.get("theoretical_hit_ratio_per_replica")
    if per is not None and theo:
        got["per_replica"] = float(per)
        ev.append(("theoretical if each replica reuses only what it computed itself "
                   "(requests as routed, unbounded)", f"{_fmt(float(per), '%')} vs "
                   f"{_fmt(float(theo), '%')} over one shared cache"))
        if theo - per >= SPREAD_LOSS * theo:
            got["routing"] = True
    elsewhere = desc.get("requests_hit_elsewhere")
    if elsewhere:
        ev.append(("requests whose prefix was cached only on other replicas",
                   f"{int(elsewhere):,} of {int(desc.get('requests') or 0):,}"))
    multi = sub[sub["session_id"].duplicated(keep=False)]
    if len(multi):
        per_sess = multi.groupby("session_id", observed=True)["server_replica"].nunique()
        share = float((per_sess > 1).mean())
        ev.append(("multi-turn sessions served by more than one replica",
                   f"{int((per_sess > 1).sum()):,} of {len(per_sess):,} ({_fmt(share, '%')})"))
        if share >= SPREAD_SESSIONS:
            got["routing"] = True
    return got


def hbm_full(d: ReportData) -> list[Finding]:
    """Preemptions and prompts prefilled again: a capacity search's probes above the capacity
    it claims overload the engine by design, so what they caused is left out (the engine's
    counter counted over the other probes' windows, ``diagnose.search.windows``)."""
    out = []
    skip = exempt(d.stages)
    f = d.frame
    preempt = E.preemptions(d.engine, windows(d.stages, skip) if skip else None)
    reprefill = _reprefills(f[keep_mask(f, skip)] if skip else f)
    for ep in d.endpoint_names:
        counter, n_pre = preempt.get(ep, ("", 0.0))
        rp = reprefill.get(ep)
        ev = []
        if n_pre > 0:
            ev.append((f"engine preemptions ({counter} increase)", f"{n_pre:,.0f}"))
        if rp is not None:
            ev.append(("requests prefilled again on the same replica after a prefix hit "
                       "in their session", f"{rp['count']:,} ({_fmt(rp['share'], '%')})"))
            ev.append(("median TTFT of those / of hits",
                       f"{_fmt(rp['ttft_again'], 'ms')} / {_fmt(rp['ttft_hit'], 'ms')}"))
        if ev:
            out.append(Finding(
                "hbm_full", f"{ep}: the KV cache is evicted under load (HBM full)", ev,
                "HBM is full: the engine preempts running requests and evicts prefixes, so "
                "the same prompt is prefilled again",
                "add a KV offload tier (LMCache or the engine's native CPU offload), or lower "
                "max concurrency", endpoint=ep,
                numbers={"preemptions": n_pre, "reprefills": (rp or {}).get("count", 0)}))
    return out


def _reprefills(f: pd.DataFrame) -> dict[str, dict]:
    """Per endpoint, requests whose (session, replica) had a prefix hit before but now report
    (almost) nothing cached although they carry a shared prefix."""
    cached_all = f["cached_tokens"].to_numpy()
    sess_all = f["session_id"].cat.codes.to_numpy()
    sel = f["ok"].to_numpy() & ~np.isnan(cached_all) & (sess_all >= 0)
    if not sel.any():
        return {}
    sess = sess_all[sel].astype(np.int64)
    rep = f["server_replica"].cat.codes.to_numpy()[sel].astype(np.int64)
    turn = f["turn"].to_numpy()[sel]
    t = f["t_sent_ns"].to_numpy()[sel]
    order = np.lexsort((t, turn, rep, sess))
    cached = cached_all[sel][order]
    shared = f["shared_prefix_tokens"].to_numpy()[sel][order]
    hit = cached > 0
    grp = sess[order] * 1_000_003 + rep[order]
    new_grp = np.r_[True, grp[1:] != grp[:-1]]
    # hits earlier in the same group: running count of hits, reset at each group start
    csum = np.cumsum(hit)
    start = np.maximum.accumulate(np.where(new_grp, np.arange(len(hit)), 0))
    before = csum - hit - np.where(start > 0, csum[start - 1], 0)
    had_hit = before > 0
    again = had_hit & (shared >= 16) & (cached <= 0.1 * shared)
    eps = f["endpoint"].cat.codes.to_numpy()[sel][order]
    names = f["endpoint"].cat.categories
    ttft = f["ttft_ms"].to_numpy()[sel][order]
    out = {}
    for code in np.unique(eps):
        m = eps == code
        n_again, n_base = int((again & m).sum()), int((had_hit & m).sum())
        if n_again >= REPREFILL_MIN and n_again >= REPREFILL_SHARE * max(n_base, 1):
            out[str(names[code])] = {"count": n_again, "share": n_again / max(n_base, 1),
                                     "ttft_again": _median(ttft[again & m]),
                                     "ttft_hit": _median(ttft[m & hit])}
    return out

