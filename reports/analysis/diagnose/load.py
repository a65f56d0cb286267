"""Findings on the load itself: an endpoint that cannot keep up with what was offered
(throughput below the offered rate, TTFT mostly queueing), and a load generator too busy to
send on schedule or to read the answers as they come."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvbench.core.contract import StageEntry
from kvbench.reports.analysis import engine_counters as E
from kvbench.reports.statistics import metrics as M
from kvbench.reports.analysis import overload as O
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose.base import MIN_ROWS, Finding, _fmt, _median
from kvbench.reports.analysis.diagnose.search import exempt, keep_mask
from kvbench.reports.analysis.numbering import label_of, labels, stage_label

LATENESS_P99_MS = 50.0  # client lateness p99 above this: the generator sends late
LOOP_PAUSE_MS = 10.0  # a load-process event-loop pause above this: chunks were read late
CLIENT_OVERHEAD_P50_MS = 50.0  # client TTFT minus the server's own times, median
# Overload: server-reported queue time is at least half of the median TTFT ...
QUEUE_SHARE = 0.5
QUEUE_MIN_MS = 100.0  # ... and at least this long (a few ms of batching wait is no overload)


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


def _stage_name(r, names: dict | None = None) -> str:
    """"mix probe 3" / "mix stage 3": one numbering with the console and run.json
    (``reports.analysis.numbering``)."""
    return f"{r['workload']} " + label_of(names or {}, r["endpoint"], r["workload"], r["stage"])


def _drain_text(x) -> str:
    """What happened after the schedule: a backlog drained, or the stage was cut with
    requests in flight (a cut stage ends before its backlog could drain)."""
    cancelled = int(x.get("cancelled", 0) or 0)
    if cancelled and not x["drain_s"] > 0:
        return (f"the stage was cut with {cancelled:,} request{'s' * (cancelled != 1)} in "
                "flight")
    return f"the backlog drained {x['drain_s']:,.1f} s after the schedule" + (
        f", {cancelled:,} cut" if cancelled else "")


def overloaded(d: ReportData) -> list[Finding]:
    """The endpoint could not keep up with the offered load: achieved throughput clearly below
    the offered rate in a stage (``reports.overload``), or queueing (server-reported queue
    time) dominating TTFT. A capacity search's probes above the capacity it claims (and its
    warm-up, void and cut probes) are how it found the limit, not evidence
    (``diagnose.search``)."""
    out = []
    f = d.frame
    f = f[keep_mask(f, exempt(d.stages))]
    names = labels(d.stages)
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
            ev.append((f"{_stage_name(x, names)}: achieved / offered",
                       f"{x['throughput_rps']:,.2f} / {x['offered_rps']:,.2f} req/s "
                       f"({x['completed']:,} of {x['scheduled']:,} requests completed over "
                       f"{x['achieved_s']:,.1f} s, scheduled over {x['offered_s']:,.1f} s; "
                       f"{_drain_text(x)}; Poisson p = {x['p_value']:.2g})"))
            ev.append((f"{_stage_name(x, names)}: first tokens/s",
                       f"{x['started_rps']:,.2f} req/s (the last first token "
                       f"{x['started_s']:,.1f} s after the first send; p = "
                       f"{x['started_p']:.2g}): requests waited before their prefill"))
        for _, x in short.iterrows():
            ev.append((f"{_stage_name(x, names)}: goodput at SLO (classes with an SLO)",
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
                f"{_stage_name(x, names)} ({x['offered_rps']:,.2f} req/s offered, "
                f"{x['throughput_rps']:,.2f} achieved)" for _, x in within.iterrows())))
        worst = over.sort_values("throughput_rps").iloc[0] if len(over) else None
        title = (f"{ep}: overloaded: achieved {worst['throughput_rps']:,.2f} req/s of "
                 f"{worst['offered_rps']:,.2f} offered ({_stage_name(worst, names)})"
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
            numbers={"stages": [_stage_name(x, names) for _, x in over.iterrows()],
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
            best = (float(ms), f"{s.workload} {stage_label(s)}",
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

