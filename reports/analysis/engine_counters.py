"""Engine counters in the ``engine`` table, read through each endpoint's engine adapter.

Which metric names an endpoint's engine publishes (prefix-cache hits and queries, preemptions)
is the adapter's knowledge (``kvbench.engines``): the adapter is detected per endpoint from the
names in that endpoint's rows, so any registered family works, vLLM's names or llama.cpp's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvbench import engines
from kvbench.engines import EngineAdapter


def counter_delta(t_ns: np.ndarray, series: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Increase of each counter series over its samples, counting resets as restarts from 0.

    Returns one delta per distinct ``series`` id (sorted ids)."""
    if len(values) == 0:
        return np.zeros(0)
    order = np.lexsort((t_ns, series))
    s, v = series[order], values[order]
    d = np.diff(v)
    same = s[1:] == s[:-1]
    inc = np.where(d >= 0, d, v[1:])  # after a reset the counter counts from zero again
    inc = np.where(same, inc, 0.0)
    uniq, first = np.unique(s, return_index=True)
    sums = np.add.reduceat(np.concatenate([[0.0], inc]), first) if len(inc) else np.zeros(
        len(uniq))
    return sums


def counter_increase(engine: pa.Table, metric: str) -> dict[str, float]:
    """Total increase of a counter per endpoint (summed over its label sets)."""
    if engine.num_rows == 0:
        return {}
    rows = engine.filter(pc.equal(engine.column("metric"), metric))
    if rows.num_rows == 0:
        return {}
    labels = [str(sorted(x)) if x else "" for x in rows.column("labels").to_pylist()]
    ep = rows.column("endpoint").to_pylist()
    keys = pd.Categorical([f"{e}\x00{lab}" for e, lab in zip(ep, labels)])
    codes = np.asarray(keys.codes, np.int64)
    deltas = counter_delta(rows.column("t_ns").to_numpy(), codes,
                           rows.column("value").to_numpy(zero_copy_only=False))
    out: dict[str, float] = {}
    for code, delta in zip(np.unique(codes), deltas):
        name = keys.categories[code].split("\x00", 1)[0]
        out[name] = out.get(name, 0.0) + float(delta)
    return out


def adapters(engine: pa.Table) -> dict[str, EngineAdapter]:
    """Per endpoint, the adapter of the engine family its scraped metric names belong to
    (endpoints of an unknown engine are left out)."""
    if engine.num_rows == 0:
        return {}
    pairs = engine.select(["endpoint", "metric"]).group_by(["endpoint", "metric"]).aggregate([])
    names: dict[str, set[str]] = {}
    for ep, metric in zip(pairs.column("endpoint").to_pylist(),
                          pairs.column("metric").to_pylist()):
        if ep is not None and metric is not None:
            names.setdefault(str(ep), set()).add(str(metric))
    found = {ep: engines.detect(ms) for ep, ms in names.items()}
    return {ep: a for ep, a in found.items() if a is not None}


def _by_counter(by_ep: dict[str, EngineAdapter], counter) -> dict[str, list[str]]:
    """Counter name -> endpoints whose adapter names it (``counter(adapter)``)."""
    out: dict[str, list[str]] = {}
    for ep, a in by_ep.items():
        name = counter(a)
        if name:
            out.setdefault(name, []).append(ep)
    return out


def _increases(engine: pa.Table, by_ep: dict[str, EngineAdapter], counter) -> dict[str, float]:
    """Per endpoint, the increase of the counter its adapter names (``counter(adapter)``)."""
    out: dict[str, float] = {}
    for name, eps in _by_counter(by_ep, counter).items():
        inc = counter_increase(engine, name)
        out.update({ep: inc[ep] for ep in eps if ep in inc})
    return out


def tier_hits(engine: pa.Table, by_ep: dict[str, EngineAdapter] | None = None
              ) -> dict[str, tuple[str, float]]:
    """Per endpoint: (counter, increase) of the hits its offload tiers served (the first of
    its adapter's ``tier_hits`` the endpoint published: vLLM's external prefix-cache hits,
    else LMCache's hit tokens; they count the same hits)."""
    by_ep = adapters(engine) if by_ep is None else by_ep
    out: dict[str, tuple[str, float]] = {}
    names = {n for a in by_ep.values() for n in a.tier_hits}
    incs = {n: counter_increase(engine, n) for n in sorted(names)}
    for ep, a in by_ep.items():
        for n in a.tier_hits:
            if ep in incs.get(n, {}):
                out[ep] = (n, incs[n][ep])
                break
    return out


def hit_ratio(engine: pa.Table) -> dict[str, float]:
    """Per endpoint: the engine's prefix-cache hit ratio over the run, from the increases of
    the hit and query counters its adapter names (``EngineAdapter.hit_ratio``), its hits
    counting those its offload tiers served (``tier_hits``) beside HBM's."""
    by_ep = adapters(engine)
    hits = _increases(engine, by_ep, lambda a: a.prefix_hits if a.hit_counters() else None)
    queries = _increases(engine, by_ep, lambda a: a.prefix_queries if a.hit_counters() else None)
    tiers = tier_hits(engine, by_ep)
    out = {}
    for ep, q in queries.items():
        h = hits.get(ep, 0.0) + tiers.get(ep, ("", 0.0))[1]
        ratio = by_ep[ep].hit_ratio(h, q)
        if ratio is not None:
            out[ep] = ratio
    return out


def preemptions(engine: pa.Table, windows: dict[str, list[tuple[int, int]]] | None = None
                ) -> dict[str, tuple[str, float]]:
    """Per endpoint: (the counter its adapter names, its increase) for engine preemptions.
    ``windows``: per endpoint, the (start, end) ns it is judged over (the increase between
    the samples within each; an endpoint not named: the whole run)."""
    by_ep = adapters(engine)
    if not by_ep:
        return {}
    if windows:
        t = engine.column("t_ns").to_numpy()
        eps = np.asarray(engine.column("endpoint").to_pylist(), dtype=object)
        incs: dict[str, float] = {}
        for ep, spans in windows.items():  # each window on its own: no gap between them
            for t0, t1 in spans:
                part = engine.filter(pa.array((eps == ep) & (t >= t0) & (t <= t1)))
                got = _increases(part, by_ep, lambda a: a.preemptions)
                incs[ep] = incs.get(ep, 0.0) + got.get(ep, 0.0)
        rest = _increases(engine.filter(pa.array(~np.isin(eps, list(windows)))), by_ep,
                          lambda a: a.preemptions)
        inc = {**rest, **{ep: v for ep, v in incs.items() if ep in by_ep}}
    else:
        inc = _increases(engine, by_ep, lambda a: a.preemptions)
    return {ep: (by_ep[ep].preemptions, v) for ep, v in inc.items()}


QUEUE_TIME_SUFFIX = "queue_time_seconds"  # vLLM's request_queue_time_seconds histogram


def queue_time(engine: pa.Table) -> dict[str, tuple[str, float, float]]:
    """Per endpoint: (histogram name, mean seconds, requests) of the engine's own request queue
    time histogram (a ``*queue_time_seconds`` histogram's _sum and _count increases over the
    run, vLLM's ``vllm:request_queue_time_seconds``), where it publishes one."""
    if engine.num_rows == 0:
        return {}
    names = {str(x) for x in engine.column("metric").unique().to_pylist() if x}
    out: dict[str, tuple[str, float, float]] = {}
    for base in sorted(n[:-len("_sum")] for n in names
                       if n.endswith(QUEUE_TIME_SUFFIX + "_sum")):
        if base + "_count" not in names:
            continue
        sums = counter_increase(engine, base + "_sum")
        counts = counter_increase(engine, base + "_count")
        for ep, n in counts.items():
            if n > 0 and ep not in out:
                out[ep] = (base, sums.get(ep, 0.0) / n, n)
    return out


def _token_counters(a: EngineAdapter) -> dict[str, tuple[str, ...]]:
    """Per quantity the records hold, the counters whose increases sum to it on this engine."""
    out: dict[str, tuple[str, ...]] = {}
    if a.prompt_tokens:
        out["prompt_tokens"] = (a.prompt_tokens,)
    elif a.queries_exclude_hits and a.prefix_hits and a.prefix_queries:
        out["prompt_tokens"] = (a.prefix_hits, a.prefix_queries)  # cached + computed
    if a.prefix_hits:
        out["cached_tokens"] = (a.prefix_hits,)
    if a.generation_tokens:
        out["completion_tokens"] = (a.generation_tokens,)
    return out


# a token quantity of the records -> the keys of the counters kvbench reads around each job
# (``runs.cache.read_counters``) whose increases make the engine's side of it
JOB_COUNTERS = {"prompt_tokens": ("prompt",), "cached_tokens": ("hits", "tier_hits"),
                "completion_tokens": ("generation",)}


def job_increases(states) -> dict[str, dict[str, float]]:
    """Per endpoint, each token quantity's increase of the engine's counters summed over its
    jobs (run.json ``cache_states``: the counters read just before and just after each job),
    for endpoints whose every job has both readings; priming requests fall outside them. The
    run-level samples cannot stand in where a built-in endpoint ran its workloads on servers
    of their own side by side (the sampler follows one server per endpoint)."""
    out: dict[str, dict[str, float]] = {}
    broken: set[str] = set()
    for st in states:
        ep = str(st.endpoint)
        before, after = st.counters_before or {}, st.counters_after or {}
        if not before or not after:
            broken.add(ep)
            continue
        if any(k not in before or k not in after for keys in JOB_COUNTERS.values()
               for k in keys):  # a run from before a counter was read: the samples decide
            broken.add(ep)
            continue
        mine = out.setdefault(ep, {})
        for quantity, keys in JOB_COUNTERS.items():
            got = [(after.get(k), before.get(k)) for k in keys]
            if got[0][0] is None or got[0][1] is None:
                broken.add(ep)
                continue
            inc = sum(float(a) - float(b) for a, b in got if a is not None and b is not None
                      and float(a) >= float(b))
            mine[quantity] = mine.get(quantity, 0.0) + inc
    return {ep: v for ep, v in out.items() if ep not in broken and len(v) == len(JOB_COUNTERS)}


def comparison(engine: pa.Table, frame: pd.DataFrame,
               primed: dict[str, tuple[int, int]] | None = None,
               jobs: dict[str, dict[str, float]] | None = None) -> list[dict]:
    """Per endpoint and token count, the records' sum over the requests that finished
    (server-reported usage) beside the increase of the engine's own counters over the run,
    and why they may differ.

    A request cancelled at the stop never received its usage, so the records lack its tokens
    while the server counted its prompt (and cached) tokens: each endpoint's row says how many
    there were. ``primed``: per endpoint, (requests, prompt tokens) the cache protocol sent to
    prime warm jobs (run.json ``cache_states``): the engine counted them, the records do not.
    ``jobs``: per endpoint, the counters' increases around its jobs (``job_increases``):
    where given they are the engine's side (priming excluded) instead of the run's samples.
    Rows: {endpoint, quantity, records, engine, diff, cancelled, note}."""
    by_ep = adapters(engine)
    if not by_ep:
        return []
    increases: dict[str, dict[str, float]] = {}
    names = {n for a in by_ep.values() for ns in _token_counters(a).values() for n in ns}
    for name in names:
        for ep, v in counter_increase(engine, name).items():
            increases.setdefault(ep, {})[name] = v
    tiers = tier_hits(engine, by_ep)  # offload tiers' hits count with HBM's
    ep_col = frame["endpoint"].astype(str).to_numpy()
    rows = []
    for ep, a in sorted(by_ep.items()):
        sel = ep_col == ep
        if not sel.any():
            continue
        sub = frame[sel]
        cancelled = int(sub["cancelled"].sum())
        for quantity, counters in _token_counters(a).items():
            inc = increases.get(ep, {})
            around_jobs = (jobs or {}).get(ep)
            if around_jobs is None and not all(c in inc for c in counters):
                continue
            # requests cancelled at the stop have no usage (their prompt count would be the
            # client's plan): the records' side is the requests that finished
            mine = float(np.nansum(sub[quantity].to_numpy()[~sub["cancelled"].to_numpy()]))
            if around_jobs is not None:
                theirs = float(around_jobs[quantity])
            else:
                theirs = float(sum(inc[c] for c in counters))
                if quantity == "cached_tokens" and ep in tiers:
                    theirs += tiers[ep][1]
            note = ""
            if cancelled and quantity != "completion_tokens":
                note = (f"{cancelled:,} request{'s' * (cancelled != 1)} cancelled at the "
                        "stop: the server counted their tokens, the client could not")
            elif cancelled:
                note = (f"{cancelled:,} request{'s' * (cancelled != 1)} cancelled at the "
                        "stop: tokens the server generated for them before the cut are not "
                        "in the records")
            n_primed, primed_tokens = (primed or {}).get(ep, (0, 0)) if around_jobs is None \
                else (0, 0)  # read around each job: its priming came before
            if n_primed and quantity != "cached_tokens":
                what = (f"{primed_tokens:,} prompt tokens" if quantity == "prompt_tokens" else
                        f"up to {n_primed:,} generated tokens")
                note = "; ".join(x for x in (note, (
                    f"the engine also counted the {n_primed:,} priming request"
                    f"{'s' * (n_primed != 1)} ({what}) sent before warm jobs, which are not "
                    "records: the prefix-cache table checks each job without them")) if x)
            elif n_primed:
                note = "; ".join(x for x in (note, (
                    f"the engine's count includes whatever the {n_primed:,} priming request"
                    f"{'s' * (n_primed != 1)} found cached")) if x)
            rows.append({"endpoint": ep, "quantity": quantity.replace("_", " "),
                         "engine_family": a.title, "records": mine, "engine": theirs,
                         "diff": (mine / theirs - 1) if theirs else float("nan"),
                         "cancelled": cancelled, "note": note})
    return rows
