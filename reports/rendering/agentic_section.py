"""The report's agentic section: sessions of many turns and the sub-agents they spawn.

Shown when the run has a session of more than one request. Over those sessions, sub-agents
and the sessions that spawned them, per endpoint: the prefix hit ratio per session from the
records (sum of cached_tokens / sum of prompt_tokens over a session's
successful requests reporting both, as the run's ``hit_ratio``) as p10/p50/p90 over sessions
and its worst sessions; beside it the theoretical ratio of the same requests where the workload
gives one (an agentic trace's hash ids: a block hits when its id appeared earlier in its own
session or, for a sub-agent, in its parents' before the spawn; read from the trace files the
run's config names, skipped when they are gone) and the engine counters' ratio over the run;
TTFT against context length (the prompt-length buckets); the fan-out's effect (TTFT of
sub-agent requests against their parents'). ``intended_note`` says, per endpoint, whether the
latency from the intended send time differs from the measured one (coordinated omission).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.measures.frame import defined
from kvbench.reports.rendering import tables
from kvbench.reports.rendering.cells import fmt
from kvbench.reports.statistics import metrics as M

ON_TIME_MS = 1.0  # lateness p99 at most this: the intended and actual send coincide
WORST = 5  # the worst sessions listed
BUCKET_METRICS = ("ttft_p50", "ttft_p99", "ttft_intended_p99", "hit_ratio")


def _q(v: np.ndarray, q: float) -> float:
    v = v[~np.isnan(v)]
    return float(np.quantile(v, q)) if len(v) else math.nan


def session_ratios(f: pd.DataFrame) -> pd.DataFrame:
    """Per (endpoint, session): requests, hit-counted prompt and cached tokens, the ratio."""
    rows = defined(f, "hit_counted") if len(f) else np.zeros(0, bool)
    t = pd.DataFrame({"endpoint": f["endpoint"].astype(object).to_numpy(),
                      "session_id": f["session_id"].astype(object).to_numpy(),
                      "prompt": np.where(rows, f["prompt_tokens"].to_numpy(), 0.0),
                      "cached": np.where(rows, f["cached_tokens"].to_numpy(), 0.0)})
    g = t.groupby(["endpoint", "session_id"], sort=True).agg(
        requests=("prompt", "size"), prompt=("prompt", "sum"), cached=("cached", "sum"))
    g = g.reset_index()
    g["ratio"] = np.where(g["prompt"] > 0, g["cached"] / g["prompt"].where(g["prompt"] > 0),
                          np.nan)
    return g


def _trace_path(d, workload: str) -> Path | None:
    for r in d.runs:
        spec = ((r.config or {}).get("workloads") or {}).get(workload) or {}
        if spec.get("format") == "agentic" and spec.get("path"):
            p = Path(str(spec["path"]))
            if p.exists():
                return p
    return None


def theoretical_blocks(path: Path, workload: str) -> dict[tuple[str, int], tuple[int, int]]:
    """{(session id, turn): (hit blocks, full blocks)} of an agentic trace, session ids as the
    reader names them (``<workload>-<conversation>``, a sub-agent's with ``-s<index>``)."""
    import orjson

    from kvbench.workloads.traces.agentic import SpawnGroup, _Parser, files_of

    out: dict[tuple[str, int], tuple[int, int]] = {}
    seen_ids: set = set()
    for file in files_of(path):
        conv = _Parser(file).conversation(orjson.loads(file.read_bytes()))
        if conv.cid in seen_ids:  # as the reader renames a repeated id
            conv.cid = f"{conv.cid}~{file.stem}"
        seen_ids.add(conv.cid)
        base = f"{workload}-{conv.cid}"

        def walk(sess, inherited: set) -> None:
            sid = base if sess.index < 0 else f"{base}-s{sess.index}"
            own: set = set()
            turn = 0
            for item in sess.items:
                if isinstance(item, SpawnGroup):
                    for sub in item.subs:
                        walk(sub, inherited | own)
                    continue
                hits = sum(1 for x in item.ids if x in own or x in inherited)
                out[(sid, turn)] = (hits, len(item.ids))
                own.update(item.ids)
                turn += 1

        walk(conv.main, set())
    return out


def theoretical_ratios(d, f: pd.DataFrame) -> pd.DataFrame | None:
    """Per (endpoint, session): the theoretical hit ratio of the requests the run sent (full
    blocks), or None when no workload of the run can give one."""
    parts = []
    for wl in sorted(set(f["workload"].astype(object))):
        path = _trace_path(d, str(wl))
        if path is None:
            continue
        try:
            blocks = theoretical_blocks(path, str(wl))
        except Exception:  # noqa: BLE001 - optional: a trace changed since the run
            continue
        sub = f[f["workload"].astype(object).to_numpy() == wl]
        got = [blocks.get((str(s), int(t)), (0, 0)) for s, t in
               zip(sub["session_id"].astype(object), sub["turn"])]
        parts.append(pd.DataFrame({
            "endpoint": sub["endpoint"].astype(object).to_numpy(),
            "session_id": sub["session_id"].astype(object).to_numpy(),
            "hits": [h for h, _ in got], "blocks": [b for _, b in got]}))
    if not parts:
        return None
    g = pd.concat(parts).groupby(["endpoint", "session_id"], sort=True)[["hits", "blocks"]].sum()
    g = g.reset_index()
    g["theoretical"] = np.where(g["blocks"] > 0, g["hits"] / g["blocks"].where(g["blocks"] > 0),
                                np.nan)
    return g


def fan_out(f: pd.DataFrame) -> list[dict]:
    """Per endpoint: TTFT of sub-agent requests (``subagent_index`` >= 0) against their
    parent sessions' requests."""
    sub_idx = f["subagent_index"].to_numpy(np.float64)
    is_sub = sub_idx >= 0
    if not is_sub.any():
        return []
    parents = set(f["parent_session_id"].astype(object)[is_sub].dropna())
    is_parent = f["session_id"].astype(object).isin(parents).to_numpy()
    ttft = f["ttft_ms"].to_numpy()
    ep = f["endpoint"].astype(object).to_numpy()
    rows = []
    for e in sorted(set(ep[is_sub])):
        mine = ep == e
        a, b = ttft[mine & is_sub], ttft[mine & is_parent]
        rows.append({"endpoint": e, "sub_requests": int((mine & is_sub).sum()),
                     "parent_requests": int((mine & is_parent).sum()),
                     "sub_sessions": int(f["session_id"].astype(object)[mine & is_sub].nunique()),
                     "sub_p50": _q(a, 0.5), "sub_p99": _q(a, 0.99),
                     "parent_p50": _q(b, 0.5), "parent_p99": _q(b, 0.99)})
    for r in rows:
        r["ratio_p50"] = (r["sub_p50"] / r["parent_p50"] if r["parent_p50"] > 0
                          else math.nan)
        for k in ("sub_p50", "sub_p99", "parent_p50", "parent_p99"):
            r[k + "_text"] = fmt(r[k], "ms")
        r["ratio_text"] = "–" if math.isnan(r["ratio_p50"]) else f"{r['ratio_p50']:.2f}x"
    return rows


def intended_note(f: pd.DataFrame) -> dict:
    """Whether the intended and actual send times coincide: the endpoints whose every request
    was sent within ``ON_TIME_MS`` (client lateness p99; think-time replays, closed loops),
    where TTFT and E2E from the intended send time equal the measured ones, and a sentence
    saying so (empty when none)."""
    ep = f["endpoint"].astype(object).to_numpy()
    late = f["lateness_ms"].to_numpy()
    rows = []
    for e in dict.fromkeys(ep):
        p99 = _q(late[ep == e], 0.99)
        rows.append({"endpoint": e, "lateness_p99": p99,
                     "on_time": not math.isnan(p99) and p99 <= ON_TIME_MS})
    on_time = [r["endpoint"] for r in rows if r["on_time"]]
    text = ("Sent on time (client lateness p99 at most "
            f"{ON_TIME_MS:g} ms): {', '.join(map(str, on_time))}. There the intended and the "
            "actual send coincide: TTFT and E2E from the intended send time equal the "
            "measured ones." if on_time else "")
    return {"endpoints": rows, "text": text}


def section(d) -> dict | None:
    """The section's context, or None when no session has more than one request."""
    f = d.frame
    if not len(f) or "session_id" not in f.columns:
        return None
    sid = f["session_id"].astype(object)
    f = f[sid.notna().to_numpy()]
    # a session per endpoint: one workload sent to several endpoints repeats its ids
    sizes = pd.Series(1, index=pd.MultiIndex.from_arrays(
        [f["endpoint"].astype(object), f["session_id"].astype(object)])).groupby(
        level=[0, 1]).size()
    if not (sizes > 1).any():
        return None
    # the section's sessions: of more than one request, sub-agents and those that spawned them
    # (a mix's single-request chats would only dilute the distribution)
    ep, sid = f["endpoint"].astype(object), f["session_id"].astype(object)
    many = set(sizes.index[(sizes > 1).to_numpy()])
    is_sub = f["subagent_index"].to_numpy(np.float64) >= 0
    parents = set(f["parent_session_id"].astype(object)[is_sub].dropna())
    keep = is_sub | sid.isin(parents).to_numpy() | np.fromiter(
        ((e, s) in many for e, s in zip(ep, sid)), bool, len(f))
    n_all = int(len(sizes))
    f = f[keep]
    per = session_ratios(f)
    theo = theoretical_ratios(d, f)
    if theo is not None:
        per = per.merge(theo[["endpoint", "session_id", "hits", "blocks", "theoretical"]],
                        on=["endpoint", "session_id"], how="left")
    engine = E.hit_ratio(d.engine) if d.engine is not None else {}
    rows = []
    for ep, g in per.groupby("endpoint", sort=True):
        r = g["ratio"].to_numpy(np.float64)
        row = {"endpoint": ep, "sessions": len(g), "multi_turn": int((g["requests"] > 1).sum()),
               "p10": _q(r, 0.10), "p50": _q(r, 0.50), "p90": _q(r, 0.90),
               "records": M.hit_ratio(f[f["endpoint"].astype(object).to_numpy() == ep]),
               "engine": engine.get(ep, math.nan)}
        if theo is not None:
            blocks = float(np.nansum(g["blocks"]))
            row["theoretical_p50"] = _q(g["theoretical"].to_numpy(np.float64), 0.5)
            row["theoretical"] = (float(np.nansum(g["hits"])) / blocks if blocks
                                  else math.nan)
        rows.append(row)
    for row in rows:
        for k in ("p10", "p50", "p90", "records", "engine", "theoretical_p50", "theoretical"):
            row[k + "_text"] = fmt(row.get(k, math.nan), "fraction")
    worst_t = per[per["ratio"].notna()].sort_values(["ratio", "endpoint", "session_id"]).head(
        WORST)
    worst = [{"endpoint": r["endpoint"], "session_id": r["session_id"],
              "requests": int(r["requests"]), "prompt_tokens": int(r["prompt"]),
              "ratio": float(r["ratio"]), "ratio_text": fmt(float(r["ratio"]), "fraction"),
              "theoretical_text": fmt(float(r.get("theoretical", math.nan)), "fraction")}
             for _, r in worst_t.iterrows()]
    return {"endpoints": rows, "worst": worst, "has_theory": theo is not None,
            "sessions": n_all, "shown": int(len(per)), "multi_turn": int((sizes > 1).sum()),
            "by_bucket": tables.group_tables(f, "prompt_bucket", metrics=BUCKET_METRICS),
            "fan_out": fan_out(f)}
