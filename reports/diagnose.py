"""The seeds' symptom table as rules: each compares what was measured with what should have
been, fires only when its evidence is in the data, and says the numbers, the cause and the fix.

(Above 400 lines: one short function per row of the seeds' table, read as one table.)

Symptom -> cause -> fix rows are from seed 000's table ("Prefix hit rate drops to 8% | Round-robin
ALB | Cache-aware router on prefix hash", ...). Thresholds are ours and named below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd

from kvbench.core.contract import StageEntry
from kvbench.reports import engine_counters as E
from kvbench.reports import metrics as M
from kvbench.reports import overload as O
from kvbench.reports.data import ReportData

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
SHORT_PROMPT_TOKENS = 512  # seed 000: "Colocate prompts < 512 tokens"
TTFT_WORSE_FACTOR = 1.05  # disaggregated median TTFT 5% above colocated
MIN_ROWS = 10  # fewest requests per side of a comparison
REPREFILL_MIN = 3  # re-prefilled requests needed ...
REPREFILL_SHARE = 0.02  # ... and their share of requests that had a hit before
CROSS_REGION_MS = 50.0  # remote-region median TTFT this much above local ...
CROSS_REGION_FACTOR = 1.2  # ... and 20% above it
HOGWILD_GAIN = 1.3  # seed 000: "Hogwild! gain under 1.3x -> Revert to single-worker"
LATENESS_P99_MS = 50.0  # client lateness p99 above this: the generator sends late
LOOP_PAUSE_MS = 10.0  # a load-process event-loop pause above this: chunks were read late
CLIENT_OVERHEAD_P50_MS = 50.0  # client TTFT minus the server's own times, median
ERROR_RATE = 0.01  # errors above 1% of the requests that finished ...
ERROR_MIN = 3  # ... and at least this many of them
ERROR_RATE_CRITICAL = 0.05  # a run whose latencies describe mostly the survivors
# Overload: server-reported queue time is at least half of the median TTFT ...
QUEUE_SHARE = 0.5
QUEUE_MIN_MS = 100.0  # ... and at least this long (a few ms of batching wait is no overload)


@dataclass
class Finding:
    rule: str
    title: str
    evidence: list[tuple[str, str]]
    cause: str
    fix: str
    endpoint: str | None = None
    severity: str = "warning"
    numbers: dict = field(default_factory=dict)  # raw values, for tests and the Markdown


def _fmt(x: float, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if unit == "%":
        return f"{100 * x:.1f}%"
    return f"{x:,.1f}{(' ' + unit) if unit else ''}"


def _median(v) -> float:
    v = np.asarray(v, np.float64)
    v = v[~np.isnan(v)]
    return float(np.median(v)) if len(v) else math.nan


# --------------------------------------------------------------------------------------------


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


def transfer_tax(d: ReportData) -> list[Finding]:
    f = d.frame
    short = f[f["ok"] & (f["prompt_tokens"] < SHORT_PROMPT_TOKENS)]
    colo = short[short["topology"] == "colocated"]
    dis = short[short["topology"] == "disaggregated"]
    if len(colo) < MIN_ROWS or len(dis) < MIN_ROWS:
        return []
    c, dd = _median(colo["ttft_ms"]), _median(dis["ttft_ms"])
    if not dd > c * TTFT_WORSE_FACTOR:
        return []
    ev = [(f"median TTFT, prompts < {SHORT_PROMPT_TOKENS} tokens, disaggregated",
           f"{_fmt(dd, 'ms')} ({len(dis):,} requests)"),
          ("same, colocated", f"{_fmt(c, 'ms')} ({len(colo):,} requests)")]
    kv = _median(dis["server_kv_transfer_ms"])
    if not math.isnan(kv):
        ev.append(("median server-reported KV transfer (disaggregated)", _fmt(kv, "ms")))
    long_ = f[f["ok"] & (f["prompt_tokens"] >= 4 * SHORT_PROMPT_TOKENS)]
    lc = long_[long_["topology"] == "colocated"]["ttft_ms"]
    ld = long_[long_["topology"] == "disaggregated"]["ttft_ms"]
    if len(lc) >= MIN_ROWS and len(ld) >= MIN_ROWS:
        ev.append((f"for prompts >= {4 * SHORT_PROMPT_TOKENS} tokens (dis. / colo.)",
                   f"{_fmt(_median(ld), 'ms')} / {_fmt(_median(lc), 'ms')}"))
    return [Finding(
        "transfer_tax", "disaggregated serving is slower than colocated for short prompts", ev,
        "the KV transfer tax: moving a short prompt's KV from the prefill pool costs more than "
        "the prefill it offloads",
        f"colocate prompts under about {SHORT_PROMPT_TOKENS} tokens (route short prompts to a "
        "colocated pool); disaggregate only long prompts with long outputs",
        numbers={"disaggregated_ms": dd, "colocated_ms": c})]


def hbm_full(d: ReportData) -> list[Finding]:
    out = []
    f = d.frame
    preempt = E.preemptions(d.engine)
    reprefill = _reprefills(f)
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


def _endpoint_setting(d: ReportData, ep: str, header: str, keys: tuple[str, ...]) -> str | None:
    """A per-endpoint region setting from run.json's endpoint entry or the resolved config
    (request header, or builtin option)."""
    entry = d.endpoint(ep)
    for k in keys:  # keys of run.json's endpoint entry that this version has no field for
        if entry.extra.get(k):
            return str(entry.extra[k])
    name = entry.name
    for run in d.runs:
        for cfg in run.config.get("endpoints") or []:
            if not isinstance(cfg, dict) or cfg.get("name") != name:
                continue
            hdrs = {str(k).lower(): v for k, v in (cfg.get("headers") or {}).items()}
            if hdrs.get(header):
                return str(hdrs[header])
            opts = cfg.get("options") or {}
            for k in keys:
                if opts.get(k):
                    return str(opts[k])
    return None


def cross_region(d: ReportData) -> list[Finding]:
    out = []
    f = d.frame
    f = f[["endpoint", "server_region", "ttft_ms", "ok"]]
    for ep, sub in f[f["ok"] & (f["server_region"].cat.codes >= 0)].groupby(
            "endpoint", observed=True):
        regions = sub["server_region"].astype(str)
        caller = _endpoint_setting(d, str(ep), "x-kvbench-region",
                                   ("caller_region", "client_region", "region"))
        note = f"caller region {caller} (from the endpoint's settings)"
        if caller is None:
            if regions.nunique() < 2:
                continue
            caller = regions.value_counts().index[0]
            note = (f"caller region not recorded; {caller}, which served the most requests, "
                    "is taken as home")
        local = sub[regions == caller]["ttft_ms"]
        remote = sub[regions != caller]["ttft_ms"]
        if len(local) < MIN_ROWS or len(remote) < MIN_ROWS:
            continue
        lm, rm = _median(local), _median(remote)
        if rm > lm + CROSS_REGION_MS and rm > lm * CROSS_REGION_FACTOR:
            others = sorted(set(regions) - {caller})
            out.append(Finding(
                "cross_region", f"{ep}: requests served in another region have a higher TTFT",
                [("median TTFT served in " + ", ".join(others), f"{_fmt(rm, 'ms')} "
                  f"({len(remote):,} requests)"),
                 (f"median TTFT served in {caller}", f"{_fmt(lm, 'ms')} ({len(local):,})"),
                 ("home region", note)],
                "cross-region routing: the round trip (about 440 ms between regions, seed 000) "
                "costs more than the prefill a remote cache hit saves",
                "keep routing regional; only go cross-region when the saved prefill exceeds "
                "the round trip", endpoint=str(ep),
                numbers={"remote_ms": rm, "local_ms": lm}))
    return out


def residency(d: ReportData) -> list[Finding]:
    out = []
    f = d.frame
    f = f[["endpoint", "server_region", "ttft_ms", "ok"]]
    for ep, sub in f[f["ok"] & (f["server_region"].cat.codes >= 0)].groupby(
            "endpoint", observed=True):
        home = _endpoint_setting(d, str(ep), "x-kvbench-residency",
                                 ("residency", "residency_region"))
        if home is None:
            continue
        regions = sub["server_region"].astype(str)
        outside = regions != home
        if outside.any():
            seen = regions[outside].value_counts()
            out.append(Finding(
                "residency", f"{ep}: requests served outside their residency region {home}",
                [("requests served outside " + home,
                  f"{int(outside.sum()):,} of {len(sub):,} ({_fmt(float(outside.mean()), '%')})"),
                 ("served in", ", ".join(f"{r} ({c:,})" for r, c in seen.items()))],
                "the router ignores data residency and balances across regions",
                "partition routers by residency: a router per residency region that only "
                "knows that region's replicas", endpoint=str(ep), severity="critical",
                numbers={"outside": int(outside.sum())}))
    return out


def hogwild(d: ReportData) -> list[Finding]:
    f = d.frame
    hw = f[f["request_class"] == "hogwild"]
    if len(hw) == 0:
        return []
    specs = {}
    for run in d.runs:
        for name, spec in (run.config.get("workloads") or {}).items():
            if isinstance(spec, dict) and spec.get("kind") == "hogwild":
                specs[name] = spec
    out = []
    for ep, sub in hw.groupby("endpoint", observed=True):
        per_task = {}
        for wl, w in sub.groupby("workload", observed=True):
            spec = specs.get(str(wl))
            if spec is None:
                continue
            end = (w["t_sent_ns"] + w["e2e_ms"].fillna(0) * M.NS_PER_MS).max()
            makespan_s = (end - w["t_sent_ns"].min()) / 1e9
            per_task[str(wl)] = (int(spec.get("workers", 4)), makespan_s
                                 / max(int(spec.get("tasks", 2)), 1))
        base = [t for wl, (n, t) in per_task.items() if n == 1]
        if not base:
            continue
        t1 = min(base)
        for wl, (n, t) in sorted(per_task.items()):
            if n <= 1 or t <= 0:
                continue
            speedup = t1 / t
            if speedup >= HOGWILD_GAIN:
                continue
            below = speedup < 1
            out.append(Finding(
                "hogwild", f"{ep}: Hogwild! with {n} workers is "
                + ("slower than one worker" if below else "barely faster than one worker"),
                [("per-task completion, 1 worker", _fmt(t1, "s")),
                 (f"per-task completion, {n} workers ({wl})", _fmt(t, "s")),
                 ("speedup", f"{speedup:.2f}x (worth it from {HOGWILD_GAIN}x)")],
                "the workers duplicate each other's work" if below else
                "coordination through the shared cache dominates the parallel gain",
                "use a reasoning model that divides the work (seed 000), or revert to a single "
                "worker" if below else "revert to a single worker for this task",
                endpoint=str(ep), numbers={"speedup": speedup}))
    return out


def _queue_evidence(ok: pd.DataFrame) -> tuple[float, float, int]:
    """(median server-reported queue ms, median TTFT ms, requests reporting it)."""
    q = ok["server_queue_ms"].to_numpy()
    has = ~np.isnan(q)
    return _median(q[has]), _median(ok["ttft_ms"].to_numpy()[has]), int(has.sum())


def _in_flight_at_schedule(sub: pd.DataFrame) -> np.ndarray:
    """Per request: how many requests of the same load process were in flight (sent, not yet
    done) at its scheduled send time."""
    out = np.zeros(len(sub), np.int64)
    workers = sub["worker"].cat.codes.to_numpy() if hasattr(sub["worker"], "cat") else \
        pd.factorize(sub["worker"])[0]
    sched = sub["t_scheduled_ns"].to_numpy(np.float64)
    sent = sub["t_sent_ns"].to_numpy(np.float64)
    done = sub["t_done_ns"].to_numpy(np.float64)
    for w in np.unique(workers):
        rows = np.flatnonzero(workers == w)
        s_sorted, d_sorted = np.sort(sent[rows]), np.sort(done[rows])
        out[rows] = (np.searchsorted(s_sorted, sched[rows], side="left")
                     - np.searchsorted(d_sorted, sched[rows], side="right"))
    return np.maximum(out, 0)


def lateness_split(sub: pd.DataFrame) -> dict:
    """Client lateness of one endpoint's requests split by cause: ``connect`` (the endpoint
    accepting the connection) and ``own`` (the load process's delay), and the own delay of
    the requests scheduled with at most the median number in flight (``low_p99``) against the
    rest: lateness that appears only with a deep backlog of open streams is the backlog of an
    endpoint that cannot absorb the schedule, not pauses of the load process."""
    lateness = sub["lateness_ms"].to_numpy()
    connect = np.nan_to_num(sub["connect_ms"].to_numpy())
    own = lateness - np.minimum(connect, np.maximum(lateness, 0))
    inflight = _in_flight_at_schedule(sub)
    cut = float(np.median(inflight)) if len(inflight) else 0.0
    low = inflight <= cut
    return {"late_p99": M.quantile(lateness, 0.99), "own_p99": M.quantile(own, 0.99),
            "connect_p99": M.quantile(connect, 0.99), "mean": M.mean(lateness),
            "in_flight_cut": cut, "low_p99": M.quantile(own[low], 0.99),
            "high_p99": M.quantile(own[~low], 0.99) if (~low).any() else math.nan}


def _stage_name(r) -> str:
    return f"{r['workload']} stage {int(r['stage'])}"


def overloaded(d: ReportData) -> list[Finding]:
    """The endpoint could not keep up with the offered load: achieved throughput clearly below
    the offered rate in a stage (``reports.overload``), or queueing (server-reported queue
    time) dominating TTFT."""
    out = []
    f = d.frame
    rates = O.rates(f)
    engine_queue = E.queue_time(d.engine)
    lean = f[["endpoint", "ok", "ttft_ms", "server_queue_ms"]]
    for ep, sub in lean.groupby("endpoint", observed=True):
        ep = str(ep)
        r = rates[rates["endpoint"].astype(str) == ep]
        over = r[r["overloaded"].fillna(False).astype(bool)]
        short = r[r["goodput_short"].fillna(False).astype(bool)]
        ok = sub[sub["ok"].to_numpy()]
        q_ms, ttft_ms, n_q = _queue_evidence(ok)
        q_source = "server-reported queue time (per request)"
        if n_q < MIN_ROWS and ep in engine_queue and len(ok) >= MIN_ROWS:
            # no per-request server times: the engine's own queue-time histogram, as means
            name, mean_s, n_q = engine_queue[ep]
            q_ms, ttft_ms = mean_s * 1e3, M.mean(ok["ttft_ms"].to_numpy())
            q_source = f"engine queue time ({name}, mean over {n_q:,.0f} requests)"
        queueing = (n_q >= MIN_ROWS and q_ms >= QUEUE_MIN_MS and ttft_ms > 0
                    and q_ms >= QUEUE_SHARE * ttft_ms)
        if not len(over) and not queueing:
            continue
        ev = []
        for _, x in over.iterrows():
            ev.append((f"{_stage_name(x)}: achieved / offered",
                       f"{x['throughput_rps']:,.2f} / {x['offered_rps']:,.2f} req/s "
                       f"({x['completed']:,} of {x['scheduled']:,} requests completed over "
                       f"{x['achieved_s']:,.1f} s, scheduled over {x['offered_s']:,.1f} s; the "
                       f"backlog drained {x['drain_s']:,.1f} s after the schedule; Poisson "
                       f"p = {x['p_value']:.2g})"))
            ev.append((f"{_stage_name(x)}: first tokens/s",
                       f"{x['started_rps']:,.2f} req/s (the last first token "
                       f"{x['started_s']:,.1f} s after the first send; p = "
                       f"{x['started_p']:.2g}): requests waited before their prefill"))
        for _, x in short.iterrows():
            ev.append((f"{_stage_name(x)}: goodput at SLO (classes with an SLO)",
                       f"{x['goodput_rps']:,.2f} req/s: {x['good']:,} requests within SLO "
                       f"over {x['achieved_s']:,.1f} s, clearly below the offered rate "
                       f"(p = {x['goodput_p']:.2g})"))
        if n_q >= MIN_ROWS:
            stat = "median" if q_source.startswith("server") else "mean"
            ev.append((f"{q_source}: {stat} queue time / {stat} TTFT",
                       f"{_fmt(q_ms, 'ms')} / {_fmt(ttft_ms, 'ms')} "
                       f"({q_ms / ttft_ms:.0%} of TTFT)" if ttft_ms > 0 else _fmt(q_ms, "ms")))
        else:
            ev.append(("median TTFT", _fmt(_median(ok["ttft_ms"].to_numpy()), "ms")))
        late = lateness_split(f[f["endpoint"].to_numpy() == ep]) if len(over) else None
        if late is not None and late["own_p99"] > LATENESS_P99_MS \
                and not late["low_p99"] > LATENESS_P99_MS:
            ev.append(("client lateness p99 (the backlog, not the load process)",
                       f"{_fmt(late['own_p99'], 'ms')}, only when more than "
                       f"{late['in_flight_cut']:,.0f} requests were in flight: "
                       f"{_fmt(late['low_p99'], 'ms')} with fewer"))
        within = r[r["overloaded"].notna() & ~r["overloaded"].fillna(False).astype(bool)]
        if len(within):
            ev.append(("stages it kept up with", ", ".join(
                f"{_stage_name(x)} ({x['offered_rps']:,.2f} req/s offered, "
                f"{x['throughput_rps']:,.2f} achieved)" for _, x in within.iterrows())))
        worst = over.sort_values("throughput_rps").iloc[0] if len(over) else None
        title = (f"{ep}: overloaded: achieved {worst['throughput_rps']:,.2f} req/s of "
                 f"{worst['offered_rps']:,.2f} offered ({_stage_name(worst)})"
                 if worst is not None else
                 f"{ep}: overloaded: requests wait in the server's queue for most of their TTFT")
        out.append(Finding(
            "overloaded", title, ev,
            "the endpoint cannot serve the offered load: requests queue in the server before "
            "their prefill, so TTFT is mostly waiting and the backlog drains after the "
            "schedule; latencies and goodput describe a queue, not the serving stack",
            "offer at most about the achieved throughput (the stages it kept up with bound "
            "its capacity), or add capacity (replicas, GPUs, a faster prefill); judge the "
            "serving stack on stages it kept up with", endpoint=ep, severity="critical",
            numbers={"stages": [_stage_name(x) for _, x in over.iterrows()],
                     "achieved_rps": [float(x) for x in over["throughput_rps"]],
                     "offered_rps": [float(x) for x in over["offered_rps"]],
                     "queue_ms": q_ms, "ttft_ms": ttft_ms}))
    return out


def _largest_pause(stages: list[StageEntry], endpoint: str
                   ) -> tuple[float, str, float | None] | None:
    """The largest recorded loop pause of ``endpoint``'s stages, where it was, and how much of
    it the load process was not running (None: not measured)."""
    best = None
    for s in stages:
        ms = s.loop_pause_max_ms
        if str(s.endpoint) == endpoint and ms is not None and (
                best is None or float(ms) > best[0]):
            off = s.loop_pause_max_offcpu_ms
            best = (float(ms), f"{s.workload} stage {s.index}",
                    None if off is None else float(off))
    return best


def loadgen_saturated(d: ReportData) -> list[Finding]:
    """The load generator sent late or read slowly. Lateness is split into the connection
    setup (``connect_ns``: the endpoint accepting the connection, which an overloaded server
    delays) and the load process's own delay (its loop, CPU): only the latter blames the
    client."""
    out = []
    f = d.frame
    rates = O.rates(f)
    overloaded_eps = {str(e) for e, v in zip(rates["endpoint"], rates["overloaded"])
                      if v is True}
    f = f[["endpoint", "ok", "lateness_ms", "connect_ms", "ttft_ms", "server_queue_ms",
           "server_prefill_ms", "server_kv_transfer_ms", "server_first_decode_ms",
           "server_region", "worker", "t_scheduled_ns", "t_sent_ns", "t_done_ns"]]
    for ep, sub in f.groupby("endpoint", observed=True):
        if len(sub) < MIN_ROWS:
            continue
        ev = []
        late = lateness_split(sub)
        late_p99, own_p99 = late["late_p99"], late["own_p99"]
        # an overloaded endpoint whose backlog alone makes the sends late: its finding says so
        backlog = str(ep) in overloaded_eps and not late["low_p99"] > LATENESS_P99_MS
        if own_p99 > LATENESS_P99_MS and not backlog:
            ev.append(("client lateness p99 (t_sent - t_scheduled)", _fmt(late_p99, "ms")))
            ev.append(("of it, the load process's own delay p99 (lateness minus connection "
                       "setup)", _fmt(own_p99, "ms")))
            ev.append((f"own delay p99 with at most {late['in_flight_cut']:,.0f} requests in "
                       "flight (the load process, not a backlog)", _fmt(late["low_p99"], "ms")))
            ev.append(("client lateness mean", _fmt(late["mean"], "ms")))
        pause = _largest_pause(d.stages, str(ep))
        # a pause alone blames the load process only where no overload explains it (a deep
        # backlog of open streams is the load process working, not stalled); with other
        # evidence it is always shown
        if pause is not None and pause[0] > LOOP_PAUSE_MS and (ev or not backlog
                                                               and str(ep) not in overloaded_eps):
            ev.append((f"largest event-loop pause of the load process ({pause[1]})",
                       _fmt(pause[0], "ms") + ": every stream in flight was read that late "
                       "together, so per-chunk times (ITL, TPOT) of that stage carry it"
                       + (f"; the process was not running for {pause[2]:.1f} ms of it (the "
                          "host gave its core to something else)" if pause[2] else "")))
        ok = sub[sub["ok"]]
        server = (ok["server_queue_ms"] + ok["server_prefill_ms"]
                  + ok["server_kv_transfer_ms"].fillna(0) + ok["server_first_decode_ms"])
        if server.notna().sum() >= MIN_ROWS:
            regions = ok["server_region"].astype(str)
            home = regions.value_counts().index[0] if ok["server_region"].notna().any() else None
            mask = server.notna() & ((regions == home) if home else True)
            overhead = _median((ok["ttft_ms"] - server)[mask])
            if overhead > CLIENT_OVERHEAD_P50_MS:
                ev.append(("median client TTFT minus server-reported time (per-chunk lag)",
                           _fmt(overhead, "ms")))
        if ev:
            workers = sub["worker"].nunique()
            ev.append(("load processes", str(workers)))
            out.append(Finding(
                "loadgen_saturated", f"{ep}: the load generator itself is saturated", ev,
                "the load generator cannot send on schedule or read responses as they arrive; "
                "its latency is in the measurements",
                "add load processes (kvbench run spreads users over more processes/hosts) or "
                "lower the rate per process", endpoint=str(ep),
                numbers={"lateness_p99_ms": late_p99, "own_lateness_p99_ms": own_p99}))
    return out


# What each kind of error usually means, and what to do: (cause, fix) by status, with HTTP
# codes told apart where they mean different things.
_ERROR_CAUSES = {
    "overload": ("the server refused work it had no room for (429 / 503: rate limit, full "
                 "queue or a replica out of the pool)",
                 "lower the offered load or add replicas; where the server sends Retry-After "
                 "the records hold it (retry_after_s)"),
    "auth": ("the server rejected the credentials (401 / 403)",
             "check the endpoint's api_key_env / headers in bench.toml"),
    "client": ("the server rejected the requests themselves (4xx: context too long, unknown "
               "model, bad parameters)",
               "check the model name and max_context_tokens against the server, and the error "
               "text"),
    "server": ("the server failed while serving (5xx)",
               "read the server's log at the times in the errors-over-time plot"),
    "timeout": ("requests ran past request_timeout_s (an overloaded or stalled server)",
                "lower the load, or raise [profiles.*] request_timeout_s if long answers are "
                "expected"),
    "disconnected": ("the connection was refused or closed mid-response (a crashed or "
                     "restarted server, or a proxy's idle timeout)",
                     "check that the server stayed up, and any proxy's timeouts"),
    "protocol_error": ("the responses were not the streaming protocol expected (a proxy "
                       "buffering or rewriting the stream, or another API dialect)",
                       "point the endpoint at the server itself, or check its api setting"),
}


def _error_kind(status: str, http: float) -> str:
    if status == "http_error":
        if http in (429.0, 503.0):
            return "overload"
        if http in (401.0, 403.0):
            return "auth"
        if 400 <= http < 500:
            return "client"
        return "server"
    return status if status in _ERROR_CAUSES else "server"


def errors(d: ReportData) -> list[Finding]:
    """Error rate above ``ERROR_RATE``: the dominant error (status, the most common error
    text, their counts and shares), its likely cause and fix. Requests cancelled at the stop
    are not errors and are left out of both counts."""
    out = []
    f = d.frame[["endpoint", "ok", "cancelled", "status", "error", "http_status"]]
    for ep, sub in f.groupby("endpoint", observed=True):
        finished = int((~sub["cancelled"]).sum())
        bad = sub[M.failed(sub)]
        n_err = len(bad)
        if not finished or n_err < ERROR_MIN or n_err / finished <= ERROR_RATE:
            continue
        rate = n_err / finished
        by_status = bad["status"].astype(str).value_counts()
        status, n_status = str(by_status.index[0]), int(by_status.iloc[0])
        of_status = bad[bad["status"].astype(str).to_numpy() == status]
        texts = of_status["error"].astype(object).fillna("(no error text)").astype(str)
        top = texts.value_counts()
        text, n_text = str(top.index[0]), int(top.iloc[0])
        codes = of_status["http_status"].dropna()
        http = float(codes.mode().iloc[0]) if len(codes) else math.nan
        cause, fix = _ERROR_CAUSES[_error_kind(status, http)]
        status_label = status + (f" {int(http)}" if status == "http_error" and http == http
                                 else "")
        ev = [("error rate (errors / requests that finished)",
               f"{_fmt(rate, '%')} ({n_err:,} of {finished:,})"),
              ("dominant status", f"{status_label}: {n_status:,} ({_fmt(n_status / n_err, '%')} "
                                  "of the errors)"),
              ("most common error", f"\"{text[:200]}\": {n_text:,} ({_fmt(n_text / n_err, '%')}"
                                    " of the errors)")]
        if len(by_status) > 1:
            ev.append(("other statuses", ", ".join(f"{s} {int(n):,}" for s, n in
                                                   by_status.iloc[1:].items())))
        cancelled = int(sub["cancelled"].sum())
        if cancelled:
            ev.append(("cancelled at the stop (not counted)", f"{cancelled:,}"))
        out.append(Finding(
            "errors", f"{ep}: {_fmt(rate, '%')} of requests failed, mostly {status_label}", ev,
            cause, fix, endpoint=str(ep),
            severity="critical" if rate > ERROR_RATE_CRITICAL else "warning",
            numbers={"error_rate": rate, "errors": n_err, "status": status,
                     "status_count": n_status, "error": text, "error_count": n_text}))
    return out


RULES: dict[str, Callable[[ReportData], list[Finding]]] = {
    "errors": errors,
    "prefix_hits_lost": prefix_hits_lost,
    "transfer_tax": transfer_tax,
    "hbm_full": hbm_full,
    "cross_region": cross_region,
    "residency": residency,
    "hogwild": hogwild,
    "loadgen_saturated": loadgen_saturated,
    "overloaded": overloaded,
}


def diagnose(d: ReportData) -> list[Finding]:
    """Every rule's findings, critical first."""
    found = []
    for rule in RULES.values():
        found.extend(rule(d))
    return sorted(found, key=lambda x: (x.severity != "critical", x.rule, x.endpoint or ""))
