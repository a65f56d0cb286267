"""Verify a run's prefix-cache numbers: per job, the cache state it started from (run.json
``cache_states``, written by ``kvbench.runs.cache``), the hit ratio from the records, from the
engine's own counters read just before and after the job, and the theoretical ratio of exactly
the requests sent (at the engine's block size), side by side, with a diagnosis where two of
them disagree beyond noise."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvbench import engines
from kvbench.core.contract import CacheState, CacheTheory

# Two hit ratios "agree" within the larger of an absolute floor and three standard errors of a
# per-request proportion (requests, not tokens, are the independent draws).
AGREE_ABS = 0.02
AGREE_SE = 3.0
# Records against the engine's counters, token for token: beyond this relative difference the
# two did not count the same requests.
TOKENS_REL = 0.005
# Tokens a request cut in flight may have had generated but not yet streamed when it was cut
# (the engine drops it at its next step)
CUT_SLACK_TOKENS = 4


def _noise(ratio: float, n: int) -> float:
    if n <= 0 or ratio is None or math.isnan(ratio):
        return math.inf
    return max(AGREE_ABS, AGREE_SE * math.sqrt(max(ratio * (1 - ratio), 0.0) / n))


def _delta(entry: CacheState, key: str) -> float | None:
    before, after = entry.counters_before or {}, entry.counters_after or {}
    if before.get(key) is None or after.get(key) is None:
        return None
    d = after[key] - before[key]
    return d if d >= 0 else after[key]  # a counter reset (engine restart) counts from zero


def _records(frame: pd.DataFrame, entry: CacheState, label: str) -> pd.DataFrame:
    sel = ((frame["endpoint"].astype(str) == label)
           & (frame["workload"].astype(str) == entry.workload))
    t0, t1 = entry.t_start_ns, entry.t_end_ns or np.iinfo(np.int64).max
    if t0 is not None:
        t = frame["t_sent_ns"].to_numpy(np.float64)
        sel &= (t >= t0) & (t <= t1)
    return frame[sel]


def _sum(sub: pd.DataFrame, col: str) -> float:
    if col not in sub or not len(sub):
        return 0.0
    return float(np.nansum(sub[col].to_numpy(np.float64)))


def verify(entry: CacheState, frame: pd.DataFrame, label: str | None = None) -> dict:
    """One job's row: its start state, the three hit ratios, token checks and findings.
    ``label``: the endpoint's name in ``frame`` (``name@run_id`` when runs share a name).

    The engine's hits count every tier: its HBM prefix-cache hits plus the hits its offload
    tiers served (``EngineAdapter.tier_hits``: vLLM's external prefix-cache counter,
    LMCache's). The theoretical ratio models every tier the engine keeps KV in
    (``runs.cache.theoretical``) and, where the run recorded it, counts only the requests
    that finished, as the records do."""
    label = label or str(entry.endpoint)
    sub = _records(frame, entry, label)
    cut = sub["cancelled"].to_numpy(bool) if "cancelled" in sub else np.zeros(len(sub), bool)
    done, gone = sub[~cut], sub[cut]
    prompt = done["prompt_tokens"].to_numpy(np.float64)
    cached = done["cached_tokens"].to_numpy(np.float64)
    reported = ~np.isnan(cached) & ~np.isnan(prompt)
    n = int(reported.sum())
    rec_prompt = float(prompt[reported].sum()) if n else math.nan
    rec_cached = float(cached[reported].sum()) if n else math.nan
    rec_ratio = rec_cached / rec_prompt if n and rec_prompt else math.nan
    completion = done["completion_tokens"].to_numpy(np.float64) \
        if "completion_tokens" in done else np.array([])
    rec_completion = float(np.nansum(completion)) if np.isfinite(completion).any() else math.nan
    try:
        adapter = engines.get(entry.engine or "vllm")
    except KeyError:
        adapter = None
    hbm_hits, queries = _delta(entry, "hits"), _delta(entry, "queries")
    tier_hits = _delta(entry, "tier_hits")
    hits = None if hbm_hits is None else hbm_hits + (tier_hits or 0.0)
    eng_ratio = math.nan
    if adapter is not None and hits is not None and queries is not None:
        r = adapter.hit_ratio(hits, queries)
        eng_ratio = math.nan if r is None else r
    eng_prompt = _delta(entry, "prompt")
    if eng_prompt is None and adapter is not None and adapter.queries_exclude_hits \
            and hbm_hits is not None and queries is not None:
        eng_prompt = hbm_hits + queries
    theo = entry.theoretical or CacheTheory()
    theo_ratio = theo.hit_ratio_lru
    if theo_ratio is None:
        theo_ratio = theo.hit_ratio_unbounded
    theo_ratio = math.nan if theo_ratio is None else float(theo_ratio)
    theo_done = math.nan if theo.hit_ratio_finished is None else float(theo.hit_ratio_finished)
    n_req = len(done)
    row = {"endpoint": label, "workload": entry.workload,
           "profile": entry.profile, "stage": entry.stage,
           "mode": entry.mode, "started_from": entry.started_from or "",
           "requests": n_req, "cancelled": len(gone), "records_ratio": rec_ratio,
           "engine_ratio": eng_ratio, "theoretical_ratio": theo_ratio,
           "theoretical_finished": theo_done, "tiers": _tiers_text(theo),
           "block_tokens": theo.block_tokens, "capacity_tokens": theo.capacity_tokens,
           "records_cached": rec_cached, "engine_hits": hits, "engine_tier_hits": tier_hits,
           "records_prompt": rec_prompt, "engine_prompt": eng_prompt,
           "engine_queries": (None if queries is None else queries + (
               hbm_hits or 0.0 if adapter is not None and adapter.queries_exclude_hits
               else 0.0)),
           "records_completion": rec_completion,
           "engine_generation": _delta(entry, "generation"),
           # what the requests cut in flight may have left in the engine's counters alone:
           # their prompts (the client's count; the server's usage never came) and the tokens
           # streamed to them before the cut
           "cancelled_prompt": _sum(gone, "prompt_tokens"),
           "cancelled_streamed": _sum(gone, "completion_tokens"),
           "notes": list(entry.notes)}
    # prompt tokens the engine looked up again: a preempted request is prefilled anew, its
    # prefix queried (and hit) once more, while its record counts its prompt once
    q, p = row["engine_queries"], row["engine_prompt"]
    row["requeried"] = max(0.0, q - p) if q is not None and p is not None else 0.0
    row["findings"], row["explained"] = _findings(row, entry, n_reported=n)
    return row


def _tiers_text(theo: CacheTheory) -> str:
    if theo.tiers_unbounded:
        return "HBM + offload tiers of unpublished size (unbounded)"
    if theo.tier_tokens:
        return f"HBM + offload tiers ({int(theo.tier_tokens):,} tokens)"
    return "HBM"


def _cut_explains(row: dict, engine: float | None, records: float, room: float) -> bool:
    """The engine counted ``engine``, the records ``records``: the engine's excess is at most
    what the requests cut in flight could have added (``room``), give or take the token
    tolerance. A request cut in flight was counted by the engine (its prompt at admission,
    the tokens it generated) but its record holds no usage: the engine's side is the larger
    one, never the records'."""
    if not row["cancelled"] or engine is None or records is None or math.isnan(records):
        return False
    tol = TOKENS_REL * max(engine, records)
    return -tol <= engine - records <= room + tol


def _findings(row: dict, entry: CacheState, n_reported: int) -> tuple[list[str], list[str]]:
    """(why the ratios disagree, in sentences with the numbers: empty when they agree;
    differences the requests cut in flight account for, which are no finding)."""
    out: list[str] = []
    explained: list[str] = []
    rec, eng, theo = row["records_ratio"], row["engine_ratio"], row["theoretical_ratio"]
    n, n_cut = row["requests"], row["cancelled"]
    cut_text = (f"{n_cut:,} request{'s' * (n_cut != 1)} cut in flight (by the stop or the "
                "search) were counted by the engine; their records hold no usage")
    if n and not n_reported:
        out.append("the server reported no cached_tokens in its usage, so the records hold no "
                   "hit ratio (vLLM adds them with --enable-prompt-tokens-details); the engine "
                   "counters stand alone")
    if entry.counters_after is None or entry.counters_before is None:
        out.append("the engine's /metrics could not be read around the job: no counter check")
    hits, cached = row["engine_hits"], row["records_cached"]
    cut_prompt = row["cancelled_prompt"]
    if row["requeried"]:
        cut_text += (f", and the engine looked up {row['requeried']:,.0f} prompt tokens again "
                     "after preempting requests")
    if hits is not None and not math.isnan(cached) and max(hits, cached) > 0:
        diff = cached - hits
        if abs(diff) > TOKENS_REL * max(hits, cached):
            text = (f"records' cached tokens {cached:,.0f} vs the engine's hit counter"
                    f"{'s (HBM + offload tiers)' if row['engine_tier_hits'] else ''} "
                    f"{hits:,.0f} ({diff:+,.0f})")
            if _cut_explains(row, hits, cached, cut_prompt + row["requeried"]):
                explained.append(f"{text}: {cut_text}")
            else:
                why = ("another client used the endpoint during the job (its counters count "
                       "every request)" if diff < 0 else
                       "the engine counts hits differently from the usage it reports (an "
                       "offload tier's hits it does not publish, or its counters restarted)")
                out.append(f"{text}: {why}")
    for what, rec_key, eng_key, counter, room in (
            ("prompt", "records_prompt", "engine_prompt", "prompt-token counter", cut_prompt),
            ("completion", "records_completion", "engine_generation",
             "generated-token counter",
             row["cancelled_streamed"] + CUT_SLACK_TOKENS * n_cut)):
        r, e = row[rec_key], row[eng_key]
        if e is None or r is None or math.isnan(r) or max(r, e) <= 0:
            continue
        if abs(r - e) > TOKENS_REL * max(r, e):
            text = (f"records' {what} tokens {r:,.0f} vs the engine's {counter} {e:,.0f} "
                    f"({r - e:+,.0f})")
            if _cut_explains(row, e, r, room):
                explained.append(f"{text}: {cut_text}")
                continue
            why = ("another client used the endpoint during the job" if r < e else
                   "the engine counts tokens differently from the usage it reports")
            out.append(f"{text}: {why}")
    # the records' ratio covers the requests that finished: the theoretical ratio of those
    # same requests where the run recorded it
    theo_rec = row["theoretical_finished"] if not math.isnan(rec) and not math.isnan(
        row["theoretical_finished"]) else theo
    measured = rec if not math.isnan(rec) else eng
    if not math.isnan(theo_rec) and not math.isnan(measured):
        gap = measured - theo_rec
        if abs(gap) > _noise(theo_rec, n):
            if gap < 0:
                out.append(
                    f"measured hit ratio {measured:.1%} is {-gap:.1%} below the theoretical "
                    f"{theo_rec:.1%} of the requests sent ({row['tiers']}): the engine evicted "
                    "or never held prefixes it could have reused (KV capacity below the "
                    "working set, requests spread over replicas, a prefix still being "
                    "prefilled when its next request came, prefix caching off, or a larger "
                    f"block than {row['block_tokens']} tokens)")
            else:
                out.append(
                    f"measured hit ratio {measured:.1%} is {gap:.1%} above the theoretical "
                    f"{theo_rec:.1%} of the requests sent ({row['tiers']}): the cache was not "
                    f"empty when the job started ({row['started_from'] or 'state unknown'}), "
                    "an offload tier the engine does not publish served hits, or another "
                    "client sent the same prefixes")
    if not math.isnan(rec) and not math.isnan(eng) and abs(rec - eng) > _noise(eng, n) \
            and not any("cached tokens" in f for f in out):
        text = f"records' hit ratio {rec:.1%} vs the engine's {eng:.1%}"
        if _ratio_cut_explains(row):
            explained.append(f"{text}: {cut_text}, and with their tokens counted the records' "
                             "ratio could be the engine's")
        else:
            out.append(f"{text}: the two did not count the same requests")
    return out, explained


def _ratio_cut_explains(row: dict) -> bool:
    """The records' ratio with the requests cut in flight added back (their prompts, at most
    ``cancelled_prompt`` tokens, anywhere from none to all of them cached) can reach the
    engine's ratio: the engine's extra queries and hits fit in what those requests held."""
    q, h = row["engine_queries"], row["engine_hits"]
    rp, rc = row["records_prompt"], row["records_cached"]
    if not row["cancelled"] or q is None or h is None or math.isnan(rp) or math.isnan(rc):
        return False
    tol = TOKENS_REL * max(q, rp)
    extra_q, extra_h = q - rp, h - rc
    return (-tol <= extra_q <= row["cancelled_prompt"] + row["requeried"] + tol
            and -tol <= extra_h <= max(extra_q, 0.0) + tol)


def cache_rows(runs, frame: pd.DataFrame) -> list[dict]:
    """Every job of every run with a cache-state entry (runs written before the protocol have
    none: no rows)."""
    out = []
    shown = {str(c) for c in frame["endpoint"].cat.categories} if len(frame) else set()
    for meta in runs:
        for entry in meta.cache_states:
            name = str(entry.endpoint)
            label = f"{name}@{meta.run_id}" if f"{name}@{meta.run_id}" in shown else name
            out.append({"run_id": meta.run_id, **verify(entry, frame, label)})
    return out


def as_findings(rows: list[dict]) -> list:
    """The rows that disagree, as the report's diagnosis findings (one per job)."""
    from kvbench.reports.analysis.diagnose import Finding

    out = []
    for r in rows:
        if not r["findings"]:
            continue
        out.append(Finding(
            rule="cache_verify", endpoint=r["endpoint"],
            title=f"{r['endpoint']} x {r['workload']}: prefix-cache hit ratios disagree",
            evidence=[("started from", r["started_from"] or "unknown"),
                      ("records", _pct(r["records_ratio"])),
                      ("engine counters", _pct(r["engine_ratio"])),
                      ("theoretical (requests sent)", _pct(r["theoretical_ratio"]))],
            cause="; ".join(r["findings"]),
            fix="start runs from a known state (cache = \"reset\" or \"warm\" in bench.toml), "
                "keep other clients off the endpoint during the run, and size the KV cache or "
                "the routing so the working set stays resident",
            numbers={k: r[k] for k in ("records_ratio", "engine_ratio", "theoretical_ratio")}))
    return out


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"
