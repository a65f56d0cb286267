"""The prefix-cache protocol of ``kvbench run``: before each job the endpoint's cache is put in
the job's ``cache`` state (``reset``, ``warm`` = reset then prime, ``as-is``), and the engine's
own token counters are read just before and just after the job, so ``reports.cache_verify``
can set the records' hit ratio beside the engine's over exactly that job.

Reset goes through the engine adapter's own call (vLLM's dev-mode ``/reset_prefix_cache``,
SGLang's ``/flush_cache``, llama.cpp's per-slot erase, the emulator's vLLM-style route). Where
there is none, or it is refused, the job runs on a fresh workload seed instead (prompts no
earlier run sent), and its entry says so. Priming sends each distinct shared prefix of the
workload once (cut to its shared tokens, one output token, not recorded): what a warm cache
holds when the measured requests begin.

Each job's ``CacheState`` lands in run.json's ``cache_states``."""

from __future__ import annotations

import hashlib
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace

from kvbench import engines
from kvbench.core.contract import CacheState, CacheTheory
from kvbench.runs.preflight import http_json

RESET_TIMEOUT_S = 30.0
PRIME_TIMEOUT_S = 600.0
_HTTP_ERRORS = (urllib.error.URLError, OSError, ValueError, KeyError, TypeError)


def reset(url: str, adapter: engines.EngineAdapter, headers: dict) -> tuple[bool, str]:
    """Empty the engine's prefix cache through its own call: (done, what was done or why not)."""
    call = adapter.reset_cache
    if call is None:
        return False, f"{adapter.title} has no cache-reset call"
    from kvbench.collectors.prometheus import read_bounded

    paths = [call.path]
    if adapter.list_slots is not None:  # llama.cpp: one erase per slot
        try:
            slots = http_json(url + adapter.list_slots.path, headers=headers,
                              method=adapter.list_slots.method, timeout=RESET_TIMEOUT_S)
        except _HTTP_ERRORS as exc:
            return False, (f"{adapter.list_slots.method} {adapter.list_slots.path} failed "
                           f"({_why(exc)}; {adapter.list_slots.note})")
        ids = adapter.slot_ids(slots) if adapter.slot_ids else []
        if not ids:
            return False, f"{adapter.list_slots.path} listed no slot"
        paths = [call.path.format(slot=i) for i in ids]
    for path in paths:
        req = urllib.request.Request(url + path, data=b"", method=call.method,
                                     headers=dict(headers))
        try:
            with urllib.request.urlopen(req, timeout=RESET_TIMEOUT_S) as r:
                read_bounded(r, url + path, 1 << 20, time.monotonic() + RESET_TIMEOUT_S)
        except _HTTP_ERRORS as exc:
            return False, f"{call.method} {path} failed ({_why(exc)}; {call.note})"
    shown = paths[0] if len(paths) == 1 else f"{call.path} for {len(paths)} slots"
    return True, f"{call.method} {shown}"


def _why(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    return str(getattr(exc, "reason", exc))[:120]


# The built-in emulator's offload-tier sizes per engine (``endpoints.metrics.TIER_CAPACITY``)
TIER_CAPACITY = "kvbench:kv_tier_capacity_tokens"


def read_counters(metrics_url: str, adapter: engines.EngineAdapter,
                  headers: dict) -> dict | None:
    """The engine's token counters now (summed over label sets), with its KV geometry where it
    publishes it: {hits, queries, prompt, generation, tier_hits, block_tokens,
    capacity_tokens, tier_capacity_tokens}; None when /metrics cannot be read. ``tier_hits``:
    hits served from offload tiers below HBM (the first of ``adapter.tier_hits`` published;
    None: none is); ``tier_capacity_tokens``: those tiers' KV per replica, where the engine
    publishes it."""
    from kvbench.collectors.prometheus import get_bounded, parse_metrics

    try:
        text = get_bounded(metrics_url, dict(headers), timeout_s=10)
        batch, _ = parse_metrics(text, t_ns=time.time_ns(), endpoint="")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    sums: dict[str, float] = {}
    geometry = None
    tiers: dict[str, float] = {}  # engine -> its tiers' tokens
    for name, labels, value in zip(batch.column("metric").to_pylist(),
                                   batch.column("labels").to_pylist(),
                                   batch.column("value").to_pylist()):
        sums[name] = sums.get(name, 0.0) + value
        if name == adapter.cache_config and geometry is None:
            geometry = adapter.geometry(dict(labels or []))
        elif name == TIER_CAPACITY:
            eng = dict(labels or []).get("engine", "")
            tiers[eng] = tiers.get(eng, 0.0) + value
    out = {k: sums.get(n) if n else None for k, n in (
        ("hits", adapter.prefix_hits), ("queries", adapter.prefix_queries),
        ("prompt", adapter.prompt_tokens), ("generation", adapter.generation_tokens))}
    out["tier_hits"] = next((sums[n] for n in adapter.tier_hits if n in sums), None)
    out["block_tokens"], out["capacity_tokens"] = geometry or (None, None)
    out["tier_capacity_tokens"] = max(tiers.values()) if tiers else None
    return out


def shared_prefixes(workload, tokenizer) -> list[str]:
    """The distinct shared prefixes of ``workload``'s requests as completion prompts: each
    request's prompt (a chat request's rendered prompt) cut to its ``shared_prefix_tokens``.
    A prefix holding earlier responses (an agent's later turns) is left out: the live
    conversation holds the server's own answers, not the stand-ins of the offline requests, so
    priming it would only spend prefill and evict prefixes that do repeat (on the default mix
    those were 966k of 1.72M primed tokens)."""
    seen: dict[str, None] = {}
    for req in workload.requests():
        n = req.shared_prefix_tokens
        if n <= 0 or req.prefix_from_responses:
            continue
        text = req.prompt if req.messages is None else tokenizer.render_prompt(req.messages)
        cut = cut_to_tokens(text, n, tokenizer)
        if cut:
            seen.setdefault(cut, None)
    return list(seen)


def cut_to_tokens(text: str, n: int, tokenizer) -> str:
    """The longest prefix of ``text`` (at a word boundary) of at most ``n`` tokens.

    The token count of a word prefix grows with its length. The search starts where the
    whole text's tokens per word put the n-th token, brackets the answer by doubling steps
    from there, then bisects: a few counts of long texts instead of a bisection's ~15 (on the
    default mix, 9.2 s of priming preparation became a fraction of that)."""
    words = text.split(" ")

    def fits(k: int) -> bool:
        return tokenizer.count_prompt(" ".join(words[:k])) <= n

    total = tokenizer.count_prompt(text)
    if total <= n:
        return text
    guess = min(len(words) - 1, max(0, len(words) * n // max(total, 1)))
    step = max(1, len(words) // 256)
    if fits(guess):  # lo fits; find a hi that does not
        lo, hi = guess, guess + step
        while hi < len(words) and fits(hi):
            lo, hi, step = hi, hi + step, step * 2
        hi = min(hi, len(words)) - 1  # the largest k that may still fit
    else:  # hi does not fit; find a lo that does
        hi, lo = guess - 1, guess - step
        while lo > 0 and not fits(lo):
            hi, lo, step = lo - 1, lo - step, step * 2
        lo = max(lo, 0)
    while lo < hi:  # lo fits (or is 0), everything above hi does not
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def prime(url: str, model: str, prefixes: list[str], headers: dict) -> tuple[int, int, str]:
    """Send each prefix once (one output token, not recorded): (sent, prompt tokens the
    server counted, first failure or "")."""
    sent = tokens = 0
    for text in prefixes:
        try:
            out = http_json(url + "/v1/completions", {"model": model, "prompt": text,
                                                      "max_tokens": 1, "stream": False},
                            headers, timeout=PRIME_TIMEOUT_S)
        except _HTTP_ERRORS as exc:
            return sent, tokens, f"priming request {sent + 1} failed ({_why(exc)})"
        sent += 1
        tokens += int((out.get("usage") or {}).get("prompt_tokens") or 0)
    return sent, tokens, ""


def fresh_seed(job) -> int:
    """A workload seed no earlier run used (from the run id): fresh prefixes without a reset."""
    digest = hashlib.blake2b(f"{job.run_id}/{job.workload}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


@dataclass
class JobCache(CacheState):
    """A job's ``CacheState`` while it runs, holding the prompts priming sent (``finish``
    simulates the cache from them); run.json does not get them."""

    primed: list[str] = field(default_factory=list, repr=False, compare=False)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("primed", None)
        return out


def prepare(job, adapter: engines.EngineAdapter, headers: dict, workload=None):
    """Put the endpoint's cache in ``job.cache``'s state before the job: (the job to run, its
    ``cache_states`` entry). ``workload``: the job's generator (for priming)."""
    ep = job.endpoint
    metrics_url = ep.metrics_url or ep.url + "/metrics"
    entry = JobCache(endpoint=ep.name, workload=job.workload, profile=job.profile,
                     stage=job.stage_index if job.pacing == "closed" else None,
                     mode=job.cache, engine=adapter.name, seed=job.seed)
    if job.cache == "as-is":
        entry.started_from = "as-is: not reset, whatever earlier traffic left cached"
    else:
        done, how = reset(ep.url, adapter, headers)
        entry.reset = {"done": done, "how" if done else "why": how}
        if not done:
            job = _fresh(job, entry, how, workload)
            workload = None  # the fresh seed's prompts are primed, if any
        if job.cache == "warm":
            if workload is None:
                workload = job.build_workload()
            from kvbench.workloads.tokenizer import get_tokenizer

            tok = getattr(workload, "tokenizer", None) or get_tokenizer(job.tokenizer)
            prefixes = shared_prefixes(workload, tok)
            sent, tokens, failed = prime(ep.url, ep.model, prefixes, headers)
            entry.primed = prefixes[:sent]
            entry.primed_prefixes, entry.primed_tokens = sent, tokens
            if failed:
                entry.notes.append(failed)
            state = "empty" if done else "fresh prefixes"
            entry.started_from = (f"warm: {state}, then {sent} shared prefix"
                                  f"{'es' * (sent != 1)} ({tokens:,} tokens) sent once")
        elif done:
            entry.started_from = f"empty: reset by {how}"
    entry.counters_before = read_counters(metrics_url, adapter, headers)
    entry.t_start_ns = time.time_ns()
    return job, entry


def _fresh(job, entry: CacheState, why: str, workload):
    """No reset: the same workload on a seed no earlier run used, when that changes its
    prompts (a table with its own ``seed`` keeps it: then the run starts as-is). Returns the
    job to run; ``entry`` says which."""
    seed = fresh_seed(job)
    salted = replace(job, seed=seed)
    try:
        before = next(iter(workload.requests()), None) if workload is not None else None
        after = next(iter(salted.build_workload().requests()), None)
        fresh = before is None or after is None or (before.prompt, before.messages) != (
            after.prompt, after.messages)
    except Exception as exc:  # noqa: BLE001 - a job we cannot rebuild runs as configured
        fresh, after = False, exc
    if fresh:
        entry.seed, entry.fresh_seed = seed, True
        entry.started_from = (f"fresh prefixes: not reset ({why}); the workload ran on "
                              f"seed {seed} instead of {job.seed}, so no earlier run sent "
                              "its prompts")
        entry.notes.append("a fresh seed changes the request schedule too: a gate pairs "
                           "it with a baseline only when both used the same seed")
        return salted
    entry.started_from = (f"as-is: not reset ({why}), and the workload pins its own seed, "
                          "so its prompts may already be cached")
    return job


def finish(entry: JobCache, job, adapter: engines.EngineAdapter, headers: dict,
           workload=None) -> JobCache:
    """The entry completed after the job: the engine's counters read now and the theoretical
    hit ratio of exactly the requests the job sent (after what priming sent), at the engine's
    block size where it publishes one (its family's default otherwise), over every tier the
    engine keeps KV in (``tiers``). ``workload``: the configured generator (rebuilt here when
    the job ran on a fresh seed)."""
    ep = job.endpoint
    primed, entry.primed = entry.primed, []
    entry.counters_after = after = read_counters(ep.metrics_url or ep.url + "/metrics",
                                                 adapter, headers)
    entry.t_end_ns = time.time_ns()
    geom = after or entry.counters_before or {}
    block = int(geom.get("block_tokens") or adapter.default_block_tokens)
    capacity = geom.get("capacity_tokens") or (ep.options or {}).get("kv_capacity_tokens")
    try:
        if workload is None or entry.fresh_seed:
            workload = job.build_workload()
        ids, finished = sent(job, entry)
        entry.theoretical = theoretical(workload, ids, primed, block, capacity,
                                        finished=finished, tiers=tiers(entry))
    except Exception as exc:  # noqa: BLE001 - the run's records matter more
        entry.notes.append(f"theoretical hit ratio not computed ({exc})"[:200])
    return entry


def tiers(entry: CacheState) -> int | None | bool:
    """The KV an engine keeps below HBM per replica, as the theoretical ratio models it: the
    tokens its offload tiers hold where it publishes them (the built-in emulator's DRAM and
    disk: a prefix evicted from HBM but still in DRAM is a hit); True (unbounded) where it
    served hits from a tier whose size it does not publish (vLLM with a KV connector); None:
    HBM alone."""
    before, after = entry.counters_before or {}, entry.counters_after or {}
    size = after.get("tier_capacity_tokens") or before.get("tier_capacity_tokens")
    if size:
        return int(size)
    b, a = before.get("tier_hits"), after.get("tier_hits")
    if a is not None and b is not None and a - b > 0:
        return True
    return None


def sent(job, entry: CacheState) -> tuple[list[str], list[bool]]:
    """The request ids the job had prefilled, in send order (its records within its time
    window: finished, or a first token seen), and whether each finished (its record holds
    the server's usage; a request cut in flight holds none)."""
    import pyarrow.compute as pc

    from kvbench.core import store

    t = store.read_table(job.run_dir, "requests", columns=[
        "endpoint", "workload", "request_id", "t_sent", "status", "ttft_ns"])
    if t.num_rows == 0:
        return [], []
    mask = pc.and_(pc.and_(pc.equal(t["endpoint"], job.endpoint.name),
                           pc.equal(t["workload"], job.workload)),
                   pc.and_(pc.greater_equal(t["t_sent"], entry.t_start_ns),
                           pc.less_equal(t["t_sent"], entry.t_end_ns)))
    # only what the server prefilled: finished, or a first token seen
    mask = pc.and_(mask, pc.or_(pc.equal(t["status"], "ok"), pc.is_valid(t["ttft_ns"])))
    rows = t.filter(mask).sort_by("t_sent")
    return ([str(x) for x in rows["request_id"].to_pylist()],
            [x != "cancelled" for x in rows["status"].to_pylist()])


def sent_ids(job, entry: CacheState) -> list[str]:
    """The request ids the job had prefilled, in send order (``sent``)."""
    return sent(job, entry)[0]


def theoretical(workload, ids: list[str], primed: list[str], block_tokens: int,
                capacity_tokens: int | None, finished: list[bool] | None = None,
                tiers: int | bool | None = None) -> CacheTheory:
    """Hit ratio an ideal prefix cache reaches on ``ids`` (request ids, ``#pass`` suffixes
    allowed) in order, after ``primed`` completion prompts: unbounded, and LRU over
    ``capacity_tokens`` where known, plus ``tiers`` (tokens held in offload tiers below HBM:
    a prefix in any tier is a hit; True: tiers of unknown size, so unbounded). ``finished``:
    per id, whether its request finished; the ratio over those alone is
    ``hit_ratio_finished`` (the records' cached tokens cover only them), the cache simulated
    over all."""
    from kvbench.workloads.describe import PrefixCacheSim, base_request_id, block_keys
    from kvbench.workloads.tokenizer import BuiltinTokenizer, get_tokenizer

    tok = getattr(workload, "tokenizer", None) or get_tokenizer()
    split = tok.tokens if isinstance(tok, BuiltinTokenizer) else tok.encode
    split_prompt = tok.tokens if isinstance(tok, BuiltinTokenizer) else tok.encode_prompt
    wanted = {base_request_id(i) for i in ids}
    keys_of: dict[str, tuple[int, list]] = {}
    for r in workload.requests():
        if r.request_id in wanted and r.request_id not in keys_of:
            toks = split(tok.render_chat(r.messages)) if r.messages is not None \
                else split_prompt(r.prompt)
            keys_of[r.request_id] = (len(toks), block_keys(toks, block_tokens))
    unbounded_tiers = tiers is True
    modelled = None if not capacity_tokens or unbounded_tiers else \
        int(capacity_tokens) + (int(tiers) if tiers else 0)
    sim = PrefixCacheSim(None if modelled is None else modelled // block_tokens)
    for text in primed:
        sim.add(block_keys(split_prompt(text), block_tokens))
    total = hits = hits_lru = missing = 0
    done_total = done_hits = n_done = 0
    finished = finished if finished is not None and len(finished) == len(ids) else None
    for k, i in enumerate(ids):
        got = keys_of.get(base_request_id(i))
        if got is None:
            missing += 1
            continue
        h, hl = sim.add(got[1])
        total += got[0]
        hits += h * block_tokens
        hits_lru += (hl or 0) * block_tokens
        if finished is not None and finished[k]:
            n_done += 1
            done_total += got[0]
            done_hits += (h if hl is None else hl) * block_tokens
    extra = {}
    if tiers:
        extra = {"tier_tokens": None if unbounded_tiers else int(tiers),
                 "tiers_unbounded": True if unbounded_tiers else None}
    if finished is not None:
        extra.update(hit_ratio_finished=done_hits / done_total if done_total else None,
                     requests_finished=n_done)
    return CacheTheory(requests=len(ids) - missing, unmatched=missing, prompt_tokens=total,
                       hit_ratio_unbounded=hits / total if total else None,
                       hit_ratio_lru=hits_lru / total if total and modelled else None,
                       block_tokens=block_tokens, capacity_tokens=capacity_tokens,
                       after_priming=len(primed), **extra)
