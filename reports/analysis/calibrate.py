"""Fit the built-in engine model's options to a calibration run (``kvbench calibrate``).

Over 400 lines, kept whole: each parameter's estimator reads the same per-request frame and the
same overlap geometry (who was in flight beside whom), and the fit order matters (decode
first, then prefill with the decode floor known, then the step budget with the rate known).

The model fitted is ``kvbench.model.costmodel.step_ms``: a step takes
``max(compute_tokens / rate, a + b * kv_tokens)`` (``a`` = weights / HBM bandwidth, ``b`` = KV
bytes per token / HBM bandwidth), a request's first token comes after the front end
(``f`` ms per prompt token) and its prefill steps. Estimators, each from the records' shapes
(never from stage names, so any run with such requests serves):

* decode floor ``a`` and KV slope ``b``: TPOT of requests with long outputs against the KV
  tokens in flight beside them (time-weighted), least squares; requests that shared steps with
  a long uncached prompt (over ``PREFILL_INTRUSION_TOKENS``) are left out; with a third term,
  ``c`` per sequence in the step (``step_us_per_seq``), where the run shows one (a CPU
  engine: decodes of short and long contexts separate it from the KV slope);
* front end ``f`` and prefill rate: TTFT of requests that ran alone (no other request in
  flight), cold and cached, least squares on the step model (iterated: which chunks are
  compute- or memory-bound); without cached prompts only ``f + 1/rate`` is identified (both
  linear in prompt length) and the whole slope is charged to the rate; with cached prompts, a
  term quadratic in the context (``prefill_ms_per_token2``) where the run shows one;
* step token budget: the longest inter-token gaps of decoding requests that shared steps with a
  prompt longer than the budget: a full chunk step takes ``budget / rate``;
* max sequences: the most requests decoding at once when more were in flight (queueing onset);
* KV capacity: the engine's cache-config metric, else an eviction probe: re-asked prefixes hit
  below a reuse distance (distinct tokens sent since the prefix's last use) and miss above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from kvbench.model import costmodel as cm
from kvbench.model import profiles as pf
from kvbench.reports.analysis import engine_counters

PREFILL_INTRUSION_TOKENS = 256  # an uncached prompt this short stays under the decode floor
LONG_PROMPT_TOKENS = 2048  # a prompt this long in a decode's steps marks a budget probe
MIN_DECODE_TOKENS = 16  # outputs this long give a TPOT sample
PER_SEQ_SHARE = 0.05  # a per-sequence step term worth less of the mean TPOT is left out
QUADRATIC_SHARE = 0.05  # a prefill quadratic worth less of the longest prompt's TTFT: left out

# which stage of [profiles.calibrate] supplies each parameter (for the "missing" sentences)
STAGE = {
    "decode": "the decode stages (workloads calib_decode and calib_decode_long: long outputs "
              "at fixed concurrencies 1..32)",
    "prefill": "the prefill stage (workload calib_prefill: unique prompts of several lengths, "
               "one user)",
    "frontend": "the cached-prefix stage (workload calib_cached: re-asked prefixes, one user)",
    "budget": "the mixed stage (workload calib_mixed: decodes sharing steps with prompts "
              "longer than the step budget)",
    "seqs": "a decode stage with more users than the engine runs at once (calib_decode at "
            "32 users)",
    "kv": "the eviction stage (workload calib_evict: one user re-asking documents at random "
          "from a set larger than the cache)",
}


@dataclass
class Param:
    name: str
    value: float
    stderr: float
    status: str  # fit | bound | metrics
    unit: str = ""
    n: int = 0
    rms: float | None = None  # residual RMS of the fit that gave it (ms), where one did
    note: str = ""


@dataclass
class Fit:
    params: dict[str, Param] = field(default_factory=dict)
    extra: dict[str, Param] = field(default_factory=dict)  # fitted terms that are no option
    notes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # one sentence each
    unreliable: str | None = None

    def options(self, defaults: dict) -> dict:
        """The builtin endpoint's options: fitted values, a bound's floor or the default."""
        out = {}
        for name, p in self.params.items():
            v = p.value
            if p.status == "bound":
                v = max(v, defaults.get(name, v))
            out[name] = int(round(v)) if name in INT_OPTIONS else float(f"{v:.6g}")
        return out


INT_OPTIONS = {"kv_capacity_tokens", "max_num_seqs", "step_token_budget", "kv_bytes_per_token"}


# ----------------------------------------------------------------------------- the frame

def frame(requests: pa.Table, endpoint: str) -> pd.DataFrame:
    """The endpoint's finished requests, times in ms from the run's first send."""
    df = requests.to_pandas()
    df = df[(df["endpoint"] == endpoint) & (df["status"] == "ok")].copy()
    if df.empty:
        return df
    df = df[df["ttft_ns"].notna() & df["e2e_ns"].notna()].copy()
    p = df["prompt_tokens"].fillna(df["prompt_tokens_client"]).astype(float)
    df["P"] = p
    df["C"] = df["cached_tokens"].fillna(0).astype(float).clip(lower=0)
    df["has_cached"] = df["cached_tokens"].notna()
    df["U"] = (p - df["C"]).clip(lower=1)
    df["O"] = df["completion_tokens"].fillna(df["completion_tokens_client"]).fillna(0).astype(float)
    t0 = df["t_sent"].min()
    df["start"] = (df["t_sent"] - t0) / 1e6
    df["ttft"] = df["ttft_ns"] / 1e6
    df["e2e"] = df["e2e_ns"] / 1e6
    df["first"] = df["start"] + df["ttft"]
    df["end"] = df["start"] + df["e2e"]
    return df.sort_values("start").reset_index(drop=True)


def _overlap(a0, a1, b0, b1) -> np.ndarray:
    """Pairwise overlap length of intervals [a0, a1] (rows) and [b0, b1] (columns)."""
    return np.clip(np.minimum(a1[:, None], b1[None, :]) - np.maximum(a0[:, None], b0[None, :]),
                   0, None)


def _ls(X: np.ndarray, y: np.ndarray):
    """Least squares: (coefficients, their standard errors, residuals)."""
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    res = y - X @ coef
    dof = max(1, len(y) - X.shape[1])
    s2 = float(res @ res) / dof
    try:
        cov = s2 * np.linalg.inv(X.T @ X)
        se = np.sqrt(np.clip(np.diag(cov), 0, None))
    except np.linalg.LinAlgError:
        se = np.full(X.shape[1], np.inf)
    return coef, se, res


def _rms(res: np.ndarray) -> float:
    return float(np.sqrt(np.mean(res ** 2))) if len(res) else 0.0


# ----------------------------------------------------------------------------- the fit

def fit(requests: pa.Table, engine: pa.Table | None, endpoint: str, *,
        model: str = "llama-3-70b", weight_dtype: str = "fp8", prefix_keys: dict | None = None,
        use_metrics: bool = True) -> Fit:
    """``prefix_keys``: request id -> what its shared prefix is (a document), for workloads
    whose single-turn requests share prefixes (the eviction probe; sticky sessions need
    none); ``use_metrics=False`` finds the KV capacity by the eviction probe even where the
    engine publishes it."""
    out = Fit()
    df = frame(requests, endpoint)
    if df.empty:
        out.missing.append(f"endpoint {endpoint!r} has no finished requests in this run; "
                           "run kvbench run --profile calibrate against it")
        return out
    weight_bytes = pf.MODELS[model].weight_bytes(weight_dtype)
    alone = _alone(df)
    a, b, c = _decode(df, out, weight_bytes)
    # a prefix counts as found whole when it is within one engine block of its length (vLLM
    # CPU caches in 128-token blocks: a 4,001-token prefix is 3,968 cached tokens)
    geo = _kv_metrics(engine, endpoint)
    tol = max(16, geo[0]) if geo else 16
    _prefill(df, alone, out, a, b, c, tol)
    rate = out.params["prefill_tok_per_ms"].value if "prefill_tok_per_ms" in out.params else None
    _budget(df, out, rate, a)
    _seqs(df, out)
    _kv(df, engine, endpoint, out, alone, prefix_keys, use_metrics, tol)
    _interference(df, engine, endpoint, out)
    return out


def _alone(df: pd.DataFrame) -> np.ndarray:
    s, e = df["start"].to_numpy(), df["end"].to_numpy()
    ov = _overlap(s, e, s, e)
    np.fill_diagonal(ov, 0)
    return ov.max(axis=1) <= 0


def _decode(df: pd.DataFrame, out: Fit, weight_bytes: float):
    """TPOT = a + b * (KV tokens in the batch) [+ c * (sequences in the batch)], both
    time-weighted over the request's decode. The per-sequence term ``c`` is kept only where
    it is significant and worth at least ``PER_SEQ_SHARE`` of the mean TPOT: a CPU engine
    of a tiny model spends more per sequence (sampling, detokenising, streaming) than on its
    KV; on the GPU model it is absent and the two-term fit stands."""
    first, end = df["first"].to_numpy(), df["end"].to_numpy()
    O, P, U = df["O"].to_numpy(), df["P"].to_numpy(), df["U"].to_numpy()
    dec = O >= MIN_DECODE_TOKENS
    if dec.sum() < 4:
        out.missing.append("decode step time: the run has no requests with long outputs; "
                           f"it needs {STAGE['decode']}")
        return None, None, 0.0
    ov = _overlap(first, end, first, end)  # decode intervals against decode intervals
    span = np.maximum(end - first, 1e-9)
    weight = ov / span[:, None]
    x = weight @ (P + O / 2)  # time-weighted KV tokens decoding beside (and in) each request
    xn = weight.sum(axis=1)  # time-weighted sequences decoding beside (and with) it
    # prefills inside the request's decode: another request's first token in its interval
    starts = df["start"].to_numpy()
    inside = (df["first"].to_numpy()[None, :] > first[:, None]) & \
             (starts[None, :] < end[:, None])
    long_u = U > PREFILL_INTRUSION_TOKENS
    intruded = (inside & long_u[None, :]).any(axis=1)
    use = dec & ~intruded
    if use.sum() < 4:
        out.missing.append("decode step time: every long-output request shared its steps "
                           "with long prefills; it needs " + STAGE["decode"])
        return None, None, 0.0
    tpot = (df["e2e"].to_numpy() - df["ttft"].to_numpy()) / (O - 1).clip(min=1)
    X = np.column_stack([np.ones(use.sum()), x[use]])
    y = tpot[use]
    if np.ptp(x[use]) < 1e-6 * max(1.0, x[use].max()):
        out.missing.append("decode step time against context: every decode ran with the same "
                           "KV in flight; it needs " + STAGE["decode"])
        return None, None, 0.0
    coef, se, res, keep = _robust(X, y)
    c, c_se = 0.0, 0.0
    X3 = np.column_stack([X, xn[use]])
    if len(y) >= 8 and np.linalg.matrix_rank(X3) == 3:
        coef3, se3, res3, keep3 = _robust(X3, y)
        c3 = float(coef3[2])
        if (c3 > 3 * se3[2] and c3 * float(np.mean(xn[use])) >= PER_SEQ_SHARE * float(np.mean(y))
                and coef3[0] > 0 and coef3[1] > 0):
            coef, se, res, keep, c, c_se = coef3, se3, res3, keep3, c3, float(se3[2])
    a, b = float(coef[0]), float(coef[1])
    n = int(keep.sum())
    rms = _rms(res)
    if a <= 0 or b <= 0:
        out.missing.append(f"decode step time: the fit gave a floor of {a:.3g} ms and a KV "
                           f"slope of {b:.3g} ms/token, not a memory-bound decode; it needs "
                           + STAGE["decode"] + " at two context lengths")
        return (a if a > 0 else None), None, 0.0
    bw = weight_bytes / (a / 1e3)  # bytes/s
    se_bw = bw * se[0] / a
    kvb = b / 1e3 * bw
    se_kvb = kvb * float(np.hypot(se[1] / b, se[0] / a))
    out.params["hbm_gb_s"] = Param("hbm_gb_s", bw / 1e9, se_bw / 1e9, "fit", "GB/s", n, rms,
                                   f"decode floor {a:.3f} ms = model weights "
                                   f"{weight_bytes / 1e9:.1f} GB / bandwidth")
    out.params["kv_bytes_per_token"] = Param(
        "kv_bytes_per_token", kvb, se_kvb, "fit", "B", n, rms,
        f"KV slope {b * 1e6:.3f} ns per token in the batch x bandwidth")
    out.extra["decode_floor_ms"] = Param("decode_floor_ms", a, float(se[0]), "fit", "ms", n, rms)
    out.extra["decode_ms_per_kv_token"] = Param("decode_ms_per_kv_token", b, float(se[1]), "fit",
                                                "ms", n, rms)
    if c > 0:
        out.params["step_us_per_seq"] = Param(
            "step_us_per_seq", c * 1e3, c_se * 1e3, "fit", "us", n, rms,
            "per sequence in each step, beside the KV slope: host work per sequence")
        out.notes.append(f"decode steps grow by {c * 1e3:.0f} us per sequence beyond their KV "
                         "reads (a CPU engine's per-sequence work): fitted as step_us_per_seq")
    return a, b, c


def _robust(X: np.ndarray, y: np.ndarray):
    """Least squares, then one refit without points beyond 4 MADs (host stalls)."""
    coef, se, res = _ls(X, y)
    mad = np.median(np.abs(res - np.median(res))) * 1.4826 + 1e-9
    keep = np.abs(res) <= 4 * mad
    if keep.sum() >= X.shape[1] + 2 and keep.sum() < len(y):
        coef, se, res = _ls(X[keep], y[keep])
    else:
        keep = np.ones(len(y), bool)
    return coef, se, res, keep


def _chunks(u: float, done: float, budget: float):
    while u > 0:
        c = min(u, budget)
        yield c, done + c
        u -= c
        done += c


def _prefill(df: pd.DataFrame, alone: np.ndarray, out: Fit, a, b, c=0.0, tol=16) -> None:
    """TTFT = c0 + f P + sum over chunks of max(chunk / rate, a + b ctx) for lone requests."""
    # a shared prefix that was not (wholly) found is an eviction-probe sample, not a designed
    # cold prompt: measured, such rows (one prompt length, many of them) pulled the rate 10%
    # off, so the prefill fit takes cold prompts that share nothing and fully cached ones
    shared = df["shared_prefix_tokens"].fillna(0).to_numpy()
    probe = (shared > 0) & (df["C"].to_numpy() < shared - tol)
    sub = df[alone & ~probe]
    if len(sub) < 4:
        out.missing.append("prefill rate: fewer than 4 requests ran alone; it needs "
                           + STAGE["prefill"])
        return
    a = (a if a is not None else 0.0) + c  # a lone request's step: one sequence
    b = b if b is not None else 0.0
    budget = float(cm.STEP_TOKEN_BUDGET)
    P, C, U, y = (sub[k].to_numpy() for k in ("P", "C", "U", "ttft"))
    done = P - U
    cached = (C >= 0.5 * P) & (C > 0)
    cold = U >= 0.9 * P
    if cold.sum() < 3 or np.ptp(U[cold]) < 0.2 * U[cold].max():
        out.missing.append("prefill rate: the run has too few cold prompts of different "
                           "lengths sent alone; it needs " + STAGE["prefill"])
        return
    separable = cached.sum() >= 3 and np.ptp(P[cached]) > 0.2 * P[cached].max()
    # attention over the context: a prompt's uncached tokens each attend to every token
    # before them, (P^2 - done^2) token pairs; the GPU model has none, a CPU engine of a tiny
    # model spends as much there as on the rest at a few thousand tokens
    Q = P ** 2 - done ** 2
    quad = False
    inv = 1 / 40.0
    for _ in range(8):  # which chunks are compute-bound depends on the rate
        comp = np.zeros(len(P))
        mem = np.zeros(len(P))
        for i in range(len(P)):
            for c, ctx in _chunks(U[i], done[i], budget):
                m = a + b * ctx
                if c * inv >= m:
                    comp[i] += c
                else:
                    mem[i] += m
        cols = [np.ones(len(P)), comp] + ([P] if separable else [])
        X = np.column_stack(cols)
        coef, se, res = _ls(X, y - mem)
        if separable and len(P) >= 8:  # else its cross term (2 x cached x uncached) would
            # stand in for the front end on the cached prompts
            cq, sq, rq = _ls(np.column_stack(cols + [Q]), y - mem)
            k = float(cq[-1])
            quad = (k > 3 * sq[-1] and cq[1] > 0
                    and k * Q.max() >= QUADRATIC_SHARE * float(y[np.argmax(Q)]))
            if quad:
                coef, se, res = cq, sq, rq
        if coef[1] <= 0:
            break
        if abs(coef[1] - inv) < 1e-6 * inv:
            inv = coef[1]
            break
        inv = float(coef[1])
    if inv <= 0:
        out.missing.append("prefill rate: TTFT did not grow with prompt length; it needs "
                           + STAGE["prefill"])
        return
    n = len(y)
    rms = _rms(res)
    rate = 1 / inv
    out.params["prefill_tok_per_ms"] = Param("prefill_tok_per_ms", rate, float(se[1]) / inv ** 2,
                                             "fit", "tokens/ms", n, rms)
    if separable:
        f = float(coef[2])
        out.params["frontend_us_per_prompt_token"] = Param(
            "frontend_us_per_prompt_token", max(0.0, f * 1e3), float(se[2]) * 1e3, "fit", "us",
            n, rms, "separated from the prefill rate by cached prompts (front end on every "
                    "prompt token, compute on uncached ones)")
    else:
        out.params["frontend_us_per_prompt_token"] = Param(
            "frontend_us_per_prompt_token", 0.0, 0.0, "fit", "us", n, rms,
            "not separable from the prefill rate without cached prompts: their combination "
            "is fitted and charged to prefill_tok_per_ms (1/rate + front end)")
        out.notes.append("prefill rate and front-end cost are not separable in this run (no "
                         "cached-prefix stage): prefill_tok_per_ms holds their combination")
    out.extra["ttft_intercept_ms"] = Param("ttft_intercept_ms", float(coef[0]), float(se[0]),
                                           "fit", "ms", n, rms, "HTTP and client overhead")
    if quad:
        k = float(coef[-1])
        out.params["prefill_ms_per_token2"] = Param(
            "prefill_ms_per_token2", k, float(se[-1]), "fit", "ms/token^2", n, rms,
            "attention: (context after - context before)^2 per prefill chunk")
        out.notes.append(f"prefill time grows with the square of the context ({k:.3g} ms per "
                         f"token^2: {k * 4096 ** 2:.0f} ms for a cold 4,096-token prompt beside "
                         f"{4096 * inv:.0f} ms at the linear rate): fitted as "
                         "prefill_ms_per_token2")
        return
    # the quadratic term (attention over the prompt), on cold prompts only
    Uc, yc = U[cold], y[cold] - mem[cold]
    if cold.sum() >= 5:
        q, qse, qres = _ls(np.column_stack([np.ones(len(Uc)), Uc, Uc ** 2]), yc)
        out.extra["prefill_ms_per_token2"] = Param(
            "prefill_ms_per_token2", float(q[2]), float(qse[2]), "fit", "ms/token^2",
            int(cold.sum()), _rms(qres),
            "quadratic term of cold prefill time; the built-in model has none (0 expected)")


def _budget(df: pd.DataFrame, out: Fit, rate, a) -> None:
    """The longest steps of decodes sharing steps with a prompt longer than the budget."""
    if rate is None:
        out.missing.append("step token budget: no prefill rate to convert step times; it "
                           "needs " + STAGE["prefill"])
        return
    first, end, U = df["first"].to_numpy(), df["end"].to_numpy(), df["U"].to_numpy()
    starts = df["start"].to_numpy()
    long_ = U >= LONG_PROMPT_TOKENS
    inside = (df["first"].to_numpy()[None, :] > first[:, None]) & (starts[None, :] < end[:, None])
    dec = (df["O"].to_numpy() >= MIN_DECODE_TOKENS) & (inside & long_[None, :]).any(axis=1)
    if dec.sum() < 2:
        out.missing.append("step token budget: no decoding request shared steps with a long "
                           "prompt; it needs " + STAGE["budget"])
        return
    gaps = []
    for offs in df.loc[dec, "chunk_offsets_ns"]:
        if offs is not None and len(offs) > 1:
            d = np.diff(np.asarray(offs, dtype=float)) / 1e6
            gaps.append(d[d > 1.5 * np.median(d)])  # the steps a prefill chunk stretched
    g = np.concatenate(gaps) if gaps else np.zeros(0)
    if len(g) < 3:
        out.missing.append("step token budget: too few inter-token gaps; it needs "
                           + STAGE["budget"])
        return
    top = np.quantile(g, 0.9)
    cluster = g[(g >= 0.85 * top) & (g <= 1.15 * top)]
    step = float(np.median(cluster))
    budget = step * rate
    u_max = float(U[long_].max())
    rate_rel = out.params["prefill_tok_per_ms"].stderr / rate
    se = budget * float(np.hypot(np.std(cluster) / step / np.sqrt(len(cluster)), rate_rel))
    if budget >= 0.9 * u_max:
        out.params["step_token_budget"] = Param(
            "step_token_budget", u_max, 0.0, "bound", "tokens", len(cluster), None,
            f"never bound: the longest prompt ({u_max:.0f} tokens) fit in one step; at least "
            f"{u_max:.0f}")
        return
    if a is not None and step < 1.2 * a:
        out.notes.append("step token budget: the longest steps are near the decode floor, so "
                         "the budget is memory-bound and poorly identified")
    out.params["step_token_budget"] = Param("step_token_budget", budget, se, "fit", "tokens",
                                            len(cluster), None,
                                            f"full-chunk step {step:.2f} ms x prefill rate")


def _sweep(s: np.ndarray, e: np.ndarray):
    """(levels, durations): how long each number of intervals were open at once."""
    t = np.concatenate([s, e])
    d = np.concatenate([np.ones(len(s)), -np.ones(len(e))])
    o = np.lexsort((d, t))  # ends before starts at a tie
    t, d = t[o], d[o]
    lvl = np.cumsum(d)[:-1]
    dur = np.diff(t)
    return lvl, dur


def _seqs(df: pd.DataFrame, out: Fit) -> None:
    """Max sequences: the most decoding at once, when more were in flight."""
    lvl, dur = _sweep(df["first"].to_numpy(), df["end"].to_numpy())
    if dur.sum() <= 0:
        out.missing.append("max sequences: no concurrent decodes; it needs " + STAGE["seqs"])
        return
    levels = np.arange(int(lvl.max()) + 1)
    share = np.array([dur[lvl >= k].sum() for k in levels]) / dur.sum()
    # the highest level held at least 3% of the time (a moment's overlap at a hand-off is not)
    m = int(levels[share >= 0.03].max())
    flvl, fdur = _sweep(df["start"].to_numpy(), df["end"].to_numpy())
    in_flight = int(flvl[fdur > 0].max()) if (fdur > 0).any() else 0
    # queueing onset: time with more in flight than decoding at the plateau
    waited = (df["ttft"] > 3 * df["ttft"].median()).mean()
    if in_flight > m + 1 and waited > 0.05:
        out.params["max_num_seqs"] = Param("max_num_seqs", m, 0.5, "fit", "sequences",
                                           len(df), None,
                                           f"decoding plateau at {m} with {in_flight} in flight")
    else:
        out.params["max_num_seqs"] = Param("max_num_seqs", max(m, in_flight), 0.0, "bound",
                                           "sequences", len(df), None,
                                           f"never bound: at least {max(m, in_flight)}")


def _kv(df: pd.DataFrame, engine: pa.Table | None, endpoint: str, out: Fit, alone,
        keys: dict | None, use_metrics: bool, tol: int = 16) -> None:
    geo = _kv_metrics(engine, endpoint) if use_metrics else None
    if geo is not None:
        block, cap = geo
        out.params["kv_capacity_tokens"] = Param("kv_capacity_tokens", cap, 0.0, "metrics",
                                                 "tokens", 1, None,
                                                 f"cache config: {cap // block} blocks of "
                                                 f"{block} tokens")
        return
    lower, exact, upper = _reuse(df, alone, keys, tol)
    why = "not read from the engine's metrics" if not use_metrics else \
        "the engine's /metrics gave no cache config"
    if exact:
        e = np.asarray(exact)
        med = float(np.median(e))
        lo = max([x for x in lower if x <= med * 1.05] or [med])
        se = float(max(np.std(e) / np.sqrt(len(e)), block_tokens_se(len(e))))
        out.params["kv_capacity_tokens"] = Param(
            "kv_capacity_tokens", med, se, "fit", "tokens", len(e), None,
            f"eviction probe ({why}): {len(e)} partly evicted prefixes, capacity = LRU stack "
            f"distance + cached tokens; {len(lower)} full hits (at least {lo:.0f}), "
            f"{len(upper)} misses")
        return
    if lower and upper:
        lo, hi = max(lower), min(upper)
        if lo > hi:  # out of order (concurrency, host noise): the middle of the overlap
            lo, hi = hi, lo
        out.params["kv_capacity_tokens"] = Param(
            "kv_capacity_tokens", (lo + hi) / 2, (hi - lo) / np.sqrt(12), "fit", "tokens",
            len(lower) + len(upper), None,
            f"eviction probe ({why}): full hits up to {lo:.0f}, misses from {hi:.0f} tokens "
            "of LRU stack distance")
        return
    if lower:
        out.params["kv_capacity_tokens"] = Param(
            "kv_capacity_tokens", max(lower), 0.0, "bound", "tokens", len(lower), None,
            f"eviction probe ({why}): never evicted; at least {max(lower):.0f}")
        return
    out.missing.append(f"KV capacity: {why} and the run re-asked no prefix after enough "
                       "other tokens to evict it; it needs " + STAGE["kv"])


def block_tokens_se(n: int) -> float:
    return 16.0 / np.sqrt(max(n, 1))  # a block's rounding


def _reuse(df: pd.DataFrame, alone, keys: dict | None, tol: int = 16):
    """Per re-asked prefix: its LRU stack distance D (tokens of other requests since its last
    use, each prefix counted once) and what it kept; returns lists of capacity estimates:
    lower bounds (D + cached, fully hit), exact (D + cached, partly evicted: the engine drops
    a prefix's blocks tail first) and upper bounds (D + cached, nothing beyond the common
    prefix kept). Only requests sent one at a time, within one stage (each stage's job starts
    from a reset cache)."""
    lower: list[float] = []
    exact: list[float] = []
    upper: list[float] = []
    rid = df["request_id"].to_numpy()
    key = np.array([(keys or {}).get(r) for r in rid], dtype=object)
    sess = df["session_id"].to_numpy()
    shared = df["shared_prefix_tokens"].fillna(0).to_numpy()
    for i in range(len(df)):  # a sticky session is its own prefix
        if key[i] is None and shared[i] > 0:
            key[i] = ("session", sess[i])
    P, O, Cc = df["P"].to_numpy(), df["O"].to_numpy(), df["C"].to_numpy()
    known = df["has_cached"].to_numpy()
    stage = df["stage"].fillna(-1).to_numpy()
    for st in np.unique(stage):
        idx = [i for i in np.flatnonzero(stage == st) if alone[i]]
        keyed = [i for i in idx if key[i] is not None and known[i]]
        if len(keyed) < 3:
            continue
        # what nearly every request keeps (a system prompt): the low end of the cached tokens
        common = float(np.quantile([Cc[i] for i in keyed], 0.1))
        last: dict = {}
        for n, i in enumerate(idx):
            k = key[i]
            if k is None or not known[i]:
                continue
            j = last.get(k)
            last[k] = n
            if j is None:
                continue
            seen: set = set()
            d = 0.0
            for m in idx[j + 1:n]:
                km = key[m]
                if km is None or km not in seen:
                    d += P[m] + O[m] - common  # the common prefix is one set of blocks
                    if km is not None:
                        seen.add(km)
                else:
                    d += max(0.0, P[m] - shared[m]) + O[m]  # its own tail only
            c = Cc[i]
            est = d + c
            if c >= shared[i] - tol:
                lower.append(est)
            elif c <= common + tol:
                upper.append(d + common)
            else:
                exact.append(est)
    return lower, exact, upper


def _kv_metrics(engine: pa.Table | None, endpoint: str):
    if engine is None or engine.num_rows == 0:
        return None
    by_ep = engine_counters.adapters(engine)
    ad = by_ep.get(endpoint)
    if ad is None or not ad.cache_config:
        return None
    rows = engine.filter(pa.compute.and_(pa.compute.equal(engine.column("endpoint"), endpoint),
                                         pa.compute.equal(engine.column("metric"),
                                                          ad.cache_config)))
    for labels in reversed(rows.column("labels").to_pylist()):
        geo = ad.geometry(dict(labels or []))
        if geo:
            return geo
    return None


def _interference(df: pd.DataFrame, engine: pa.Table | None, endpoint: str, out: Fit) -> None:
    """Engine counters beyond what the run sent: someone else's load shared the endpoint."""
    if engine is None or engine.num_rows == 0:
        return
    by_ep = engine_counters.adapters(engine)
    ad = by_ep.get(endpoint)
    if ad is None or not ad.generation_tokens:
        return
    gen = engine_counters.counter_increase(engine, ad.generation_tokens).get(endpoint)
    if gen is None:
        return
    sent = float(df["O"].sum())
    # cache warming sends each shared prefix once, unrecorded, with a one-token answer
    warm = float(df.loc[df["shared_prefix_tokens"].fillna(0) > 0, "session_id"].nunique())
    if gen > 1.1 * (sent + warm) + 64:
        out.unreliable = (f"the engine generated {gen:.0f} tokens but this run received "
                          f"{sent:.0f}: load the run did not send shared the endpoint, so "
                          "the fit is unreliable")
