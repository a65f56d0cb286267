"""The server's own per-request times from the spans it exported over OTLP (the run's ``spans``
table, ``kvbench.runs.otlp``), joined to the records by request id: TTFT split into the
server's queue, its prefill (scheduled to first token), its front end (arrival to queue, the
rest of its own TTFT) and what lies outside the server (network and client: the client's TTFT
minus the server's)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

# what servers put around the client's id (vLLM: "cmpl-<id>-0", "chatcmpl-<id>")
ID_PREFIXES = ("chatcmpl-", "cmpl-", "cmpl_", "req-")


def candidates(span_id: str):
    """Ids a span's request id may stand for: itself, without a server prefix, then with its
    trailing ``-part``s stripped one at a time (choice index, a random suffix)."""
    yield span_id
    base = span_id
    for p in ID_PREFIXES:
        if base.startswith(p):
            base = base[len(p):]
            yield base
            break
    while "-" in base:
        base = base.rsplit("-", 1)[0]
        yield base


def join(requests: pa.Table, spans: pa.Table) -> pd.DataFrame:
    """One row per record matched to a span: the record's endpoint, client TTFT, and the span's
    times (ns). Matches on the record's ``request_id`` or ``server_request_id``. A run whose
    jobs replay one workload sends each id once per job: a span then joins the record of that
    id sent nearest its own start (``t_sent`` against the span's ``t_ns``), never the last."""
    if spans.num_rows == 0 or requests.num_rows == 0:
        return pd.DataFrame()
    cols = [c for c in ("request_id", "server_request_id", "endpoint", "status", "ttft_ns",
                        "t_sent") if c in requests.column_names]
    rec = requests.select(cols).to_pandas()
    index: dict[str, list[int]] = {}
    for col in ("server_request_id", "request_id"):  # the record's own id wins
        if col in rec:
            for i, v in enumerate(rec[col].to_numpy()):
                if isinstance(v, str) and v:
                    got = index.setdefault(v, [])
                    if i not in got:
                        got.append(i)
    sent = rec["t_sent"].to_numpy(np.float64) if "t_sent" in rec else None
    sp = spans.to_pandas()
    starts = sp["t_ns"].to_numpy(np.float64) if "t_ns" in sp else None
    rows, spans_at = [], []
    for j, sid in enumerate(sp["trace_request_id"].to_numpy()):
        if not isinstance(sid, str):
            continue
        hits = next((index[c] for c in candidates(sid) if c in index), None)
        if not hits:
            continue
        hit = hits[-1]
        if len(hits) > 1 and sent is not None and starts is not None \
                and not np.isnan(starts[j]):
            dist = np.abs(sent[hits] - starts[j])
            if not np.isnan(dist).all():
                hit = hits[int(np.nanargmin(dist))]
        rows.append(hit)
        spans_at.append(j)
    if not rows:
        return pd.DataFrame()
    out = rec.iloc[rows].reset_index(drop=True)
    got = sp.iloc[spans_at].reset_index(drop=True)
    for c in ("queue_ns", "prefill_ns", "decode_ns", "ttft_ns", "e2e_ns", "trace_request_id"):
        out["server_" + c if c != "trace_request_id" else c] = got[c].to_numpy()
    out["_row"] = rows  # one span per record: the last that joined it
    out = out.drop_duplicates(subset=["_row"], keep="last").drop(columns=["_row"])
    return out.drop(columns=["t_sent"], errors="ignore").reset_index(drop=True)


def breakdown(joined: pd.DataFrame) -> list[dict]:
    """Per endpoint, medians in ms over matched requests that finished: client TTFT, server
    queue, prefill, front end (server TTFT - queue - prefill) and outside the server (client
    TTFT - server TTFT)."""
    if joined.empty:
        return []
    ok = joined[(joined["status"] == "ok") & joined["ttft_ns"].notna()]
    out = []
    for ep, sub in ok.groupby("endpoint", sort=True):
        def med(x) -> float:
            x = np.asarray(x, np.float64)
            x = x[~np.isnan(x)]
            return float(np.median(x)) / 1e6 if len(x) else float("nan")

        client = sub["ttft_ns"].to_numpy(np.float64)
        server = sub["server_ttft_ns"].to_numpy(np.float64)
        queue = sub["server_queue_ns"].to_numpy(np.float64)
        prefill = sub["server_prefill_ns"].to_numpy(np.float64)
        out.append({"endpoint": str(ep), "requests": int(len(sub)),
                    "client_ttft_ms": med(client), "server_ttft_ms": med(server),
                    "queue_ms": med(queue), "prefill_ms": med(prefill),
                    "frontend_ms": med(server - queue - prefill),
                    "outside_ms": med(client - server),
                    "decode_ms": med(sub["server_decode_ns"])})
    return out
