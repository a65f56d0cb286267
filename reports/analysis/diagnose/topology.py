"""Findings that compare serving topologies and regions: disaggregation slower than colocation
for short prompts (the KV transfer tax), requests served in a remote region, and requests
served outside their residency region."""

from __future__ import annotations

import math

from kvbench.model import topologies
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose.base import MIN_ROWS, Finding, _fmt, _median

SHORT_PROMPT_TOKENS = 512  # seed 000: "Colocate prompts < 512 tokens"
TTFT_WORSE_FACTOR = 1.05  # disaggregated median TTFT 5% above colocated
CROSS_REGION_MS = 50.0  # remote-region median TTFT this much above local ...
CROSS_REGION_FACTOR = 1.2  # ... and 20% above it


def transfer_tax(d: ReportData) -> list[Finding]:
    f = d.frame
    # P/D split against plain replicas (no offload, no router), by the topologies' traits
    split = f["topology"].isin(topologies.where(splits_prefill_decode=True))
    plain = f["topology"].isin(topologies.where(splits_prefill_decode=False, offloads_kv=False,
                                                routes=False))
    short = f["ok"] & (f["prompt_tokens"] < SHORT_PROMPT_TOKENS)
    colo, dis = f[short & plain], f[short & split]
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
    long_ = f["ok"] & (f["prompt_tokens"] >= 4 * SHORT_PROMPT_TOKENS)
    lc, ld = f[long_ & plain]["ttft_ms"], f[long_ & split]["ttft_ms"]
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

