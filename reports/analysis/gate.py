"""The nightly gate: a noise-aware comparison of a run with its baseline.

Over 400 lines, kept whole: the rule evaluation and its outputs (console text, JUnit, Markdown,
JSON records) stay together, so a verdict reads the same in each.

For each rule the statistic is bootstrapped in both runs (``reports.metrics``: the same metric
definitions as the report), the replicates are paired at random, and the ratio current /
baseline gets a percentile confidence interval. A relative rule (``max_increase_pct``,
``max_decrease_pct``) turns the allowed change into a ratio limit; an absolute rule
(``max_value``) bounds the current statistic itself.

Verdicts: ``pass`` when the whole interval is within the limit, ``fail`` when the whole
interval lies beyond it, ``inconclusive`` when it straddles the limit (the change may be noise).
A gate never passes on nothing: a run without records, a rule over a class or endpoint one run
lacks, a rule whose statistic has no value in a run (its column all null or dropped), or no
check at all is a ``DataError`` (exit 3), not a verdict. Only when the user asks (``--allow-missing``,
or ``allow_missing = true`` on the rule) does a rule without data become the verdict
``missing``, which does not fail the gate and is said in every output. In a paired comparison
the values shown and the interval are both taken over the matched requests.

Rates (``*_rps``, ``*_tps``) are counts over a fixed stage wall time. Resampling requests keeps
their number fixed, which is right when both runs replayed the same seeded arrival schedule; when
the schedules differ (another seed, rate, duration, workload or pacing) the number of arrivals
is itself random, so each replicate is also scaled by Poisson(n) / n (the count of a Poisson
process in a fixed window). Without it two A/A runs with different seeds "fail" goodput on a
zero-width interval.

A run of more than ``MAX_REQUESTS`` compacted requests (a soak, a 10M-request night) is not
loaded whole (``load_bounded``): the gate judges a seeded uniform sample of about
``MAX_REQUESTS`` of them, read a row group at a time, so a gate on two such runs stays within a
bounded memory. The figures it compares and prints are nevertheless exact: each rule's
statistic over ALL the run's requests (``statistics.columnar_groups.exact_figures``: the
registry's definitions evaluated batch by batch, percentiles by exact selection). Only the noise
interval comes from the sample: its bootstrap spread (rates scaled by n / m, the inverse of the
sampled fraction) is rescaled by sqrt(m / n) to the whole run's (m-out-of-n, as the ITL cluster
bootstrap does) and centred on the exact figure; pairing is off (two samples share few
requests), and the rule's note says so in every output. Runs at or under the bound are judged
exactly as before. The bound is ``MAX_REQUESTS``, or ``$KVBENCH_GATE_MAX_REQUESTS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

import numpy as np
import pandas as pd

from kvbench.core.errors import DataError, UserError
from kvbench.core.store import RunMeta, load_results
from kvbench.reports.statistics import metrics as M

# "missing": a rule without data that the user allowed; it neither passes nor fails the gate
VERDICT_ORDER = {"missing": -1, "pass": 0, "inconclusive": 1, "fail": 2}
ALLOWED = "allowed by --allow-missing or the rule's allow_missing"


@dataclass(frozen=True)
class RuleResult:
    metric: str
    endpoint: str
    request_class: str
    kind: str  # "relative" | "absolute"
    limit: float  # ratio limit (relative) or absolute ceiling, in the metric's unit
    baseline: float  # NaN for absolute rules
    current: float
    low: float  # CI of the ratio (relative) or of the current value (absolute)
    high: float
    n_baseline: int
    n_current: int
    verdict: str
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.metric}[endpoint={self.endpoint},class={self.request_class}]"

    def describe(self) -> str:
        unit = M.METRIC_INFO[self.metric].unit
        if self.verdict == "missing":
            return f"{self.metric}: no data to judge, {self.note}"
        if self.kind == "relative":
            change = (self.current / self.baseline - 1) * 100 if self.baseline else math.nan
            return (f"{self.metric} {self.baseline:.4g} -> {self.current:.4g} {unit} "
                    f"({change:+.1f}%), ratio CI [{self.low:.3f}, {self.high:.3f}] vs limit "
                    f"{self.limit:.3f}{'; ' + self.note if self.note else ''}")
        return (f"{self.metric} {self.current:.4g} {unit}, CI [{self.low:.4g}, {self.high:.4g}] "
                f"vs max {self.limit:.4g}{'; ' + self.note if self.note else ''}")


MAX_REQUESTS = 200_000  # above this many compacted requests a run is judged on a sample
MAX_REQUESTS_ENV = "KVBENCH_GATE_MAX_REQUESTS"  # overrides it (tests, small hosts)


def sample_bound() -> int:
    """The sampling bound: ``$KVBENCH_GATE_MAX_REQUESTS`` when set, else ``MAX_REQUESTS``."""
    import os

    text = os.environ.get(MAX_REQUESTS_ENV, "").strip()
    if not text:
        return MAX_REQUESTS
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"${MAX_REQUESTS_ENV}={text!r}: give a whole number of requests "
                        "(at least 1), or unset it")
    return int(text)


@dataclass(frozen=True)
class Sampled:
    """A run judged on ``m`` of its ``n`` requests (``load_bounded``)."""

    m: int
    n: int

    @property
    def fraction(self) -> float:
        return self.m / self.n


def load_bounded(path, max_requests: int | None = None, seed: int = 0):
    """``load_results`` of the run at ``path``, unless its compacted requests are more than
    ``max_requests`` (default ``sample_bound()``: ``MAX_REQUESTS`` or its environment
    override): then its requests table is a seeded uniform sample of about that many, read a
    row group at a time, and ``results.sampled`` says so (a ``Sampled``; None when the run is
    whole). Live shards of such a run are not sampled."""
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvbench.core.checks import check_requests, records_source
    from kvbench.core.compact import Results, align_worker_clocks
    from kvbench.core.runjson import read_meta
    from kvbench.core.schema import REQUESTS, TABLES
    from kvbench.core.shards import read_table
    from kvbench.reports.statistics.columnar import parquet_batches, parquet_files

    limit = sample_bound() if max_requests is None else max_requests
    run_dir = Path(path)
    files = parquet_files(run_dir)
    try:
        n = sum(pq.ParquetFile(f).metadata.num_rows for f, _ in files)
    except (OSError, pa.ArrowException):
        n = 0  # a damaged file: the store's reader says so in one sentence
    if n <= limit:
        results = load_results(run_dir)
        results.sampled = None
        return results
    rng = np.random.default_rng(seed)
    names = sorted(set().union(*(pq.read_schema(f).names for f, _ in files))
                   | {k for _, keys in files for k in keys})
    kept = []
    for f, keys in files:  # each file's own columns (an older one lacks some)
        own = [c for c in names if c in keys or c in pq.read_schema(f).names]
        for part in parquet_batches([(f, keys)], own, batch_size=128 * 1024):
            rows = np.flatnonzero(rng.random(part.num_rows) < limit / n)
            if len(rows):
                kept.append(pa.Table.from_batches([part.take(pa.array(rows))]))
    requests = pa.concat_tables(kept, promote_options="permissive")
    for i, field in enumerate(REQUESTS):  # hive keys read back as their own types
        j = requests.schema.get_field_index(field.name)
        if j < 0:
            requests = requests.append_column(field, pa.nulls(requests.num_rows, field.type))
        elif requests.schema.field(j).type != field.type:
            requests = requests.set_column(j, field, requests.column(j).cast(field.type))
    requests = requests.select(REQUESTS.names)
    meta = read_meta(run_dir)
    tables = {name: read_table(run_dir, name, strict=True) for name in TABLES
              if name != "requests"}
    check_requests(requests, records_source(run_dir))
    tables["requests"] = align_worker_clocks(requests, meta.worker_clock_offsets_ns)
    results = Results(run_dir, meta, tables)
    results.sampled = Sampled(requests.num_rows, n)
    return results


def _frame(results, slo: dict | None) -> pd.DataFrame:
    frame = M.request_frame(results.requests, stages=results.meta.stages, slo=slo)
    frame.attrs["sampled"] = getattr(results, "sampled", None)
    return frame


def _sampled(frame: pd.DataFrame) -> Sampled | None:
    return frame.attrs.get("sampled")


def _replicates(frame: pd.DataFrame, metric: str, resamples: int,
                seed: int, exact: float | None = None) -> tuple[float, np.ndarray]:
    """``M.bootstrap_replicates``; on a sampled run (``load_bounded``) a rate is scaled by
    n / m and the replicates' spread about the estimate by sqrt(m / n), then moved to centre
    on ``exact`` (the statistic over the whole run) when it is given."""
    est, reps = M.bootstrap_replicates(frame, metric, resamples, seed)
    s = _sampled(frame)
    if s is None or not math.isfinite(est):
        return (exact, reps) if exact is not None and s is not None else (est, reps)
    if M.METRIC_INFO[metric].counts_arrivals:
        est, reps = est / s.fraction, reps / s.fraction
    reps = est + (reps - est) * math.sqrt(s.fraction)
    if exact is not None:
        est, reps = exact, reps - est + exact
    return est, reps


def _exact_figures(results, frame: pd.DataFrame, wants: set, slo) -> dict:
    """The wanted (metric, endpoint, class) figures over every request of a sampled run (a
    pooled baseline: its runs together); {} for a run judged whole."""
    if _sampled(frame) is None or not wants:
        return {}
    from kvbench.reports.statistics.columnar_groups import exact_figures

    parts = getattr(results, "parts", None) or [results]
    runs = [(p.path, p.meta.stages, p.meta.worker_clock_offsets_ns) for p in parts]
    return exact_figures(runs, sorted(wants), slo=slo)


def _arrivals(frame: pd.DataFrame) -> int:
    """The requests of ``frame``'s run it stands for (the sample's over its fraction)."""
    s = _sampled(frame)
    return len(frame) if s is None else int(round(len(frame) / s.fraction))


def _select(frame: pd.DataFrame, endpoint: str, request_class: str) -> pd.DataFrame:
    rows = np.asarray(frame["endpoint"] == endpoint)
    if request_class != "*":
        # not in place: pandas may hand back a read-only view
        rows = rows & np.asarray(frame["request_class"] == request_class)
    return frame[rows]


def _schedule(meta: RunMeta, endpoint: str) -> tuple:
    """What fixes the arrivals an endpoint saw: seed, workloads and its stages' pacing."""
    cfg = meta.config
    stages = sorted((str(s.workload), int(s.index or 0), s.pacing, s.rate_rps, s.duration_s,
                     s.users) for s in meta.stages if s.endpoint == endpoint)
    # every workload table: a mix's components live under their own names
    wl = cfg.get("workloads") or {}
    return ((cfg.get("suite") or {}).get("seed"), repr(sorted(wl.items())), tuple(stages))


def same_schedule(baseline_meta: RunMeta, current_meta: RunMeta, endpoint: str) -> bool:
    """True when both runs replayed the same seeded open-loop arrivals at ``endpoint``."""
    b, c = _schedule(baseline_meta, endpoint), _schedule(current_meta, endpoint)
    open_loop = all(st[2] not in (None, "closed") for st in c[2])
    return bool(c[2]) and open_loop and b == c


PAIRED_MIN = 30  # fewer matched requests than this: the unpaired interval is used


@dataclass(frozen=True)
class Paired:
    """A paired comparison: the statistic in each run over the matched requests only, and the
    replicates of their ratio over the same requests."""

    baseline: float
    current: float
    ratio: np.ndarray
    pairs: int


def _paired_ratio(fb: pd.DataFrame, fc: pd.DataFrame, info: M.Metric, resamples: int,
                  rng: np.random.Generator) -> Paired | None:
    """Estimates and replicates of current/baseline for a per-request quantile or mean over
    the requests both runs sent (matched on session and turn), resampled with the same
    indices in both. The estimates are taken over those same requests, so the change shown
    and its interval describe one set of requests.

    With the same seeded schedule, request i is the same prompt at the same offset in both
    runs, so its latencies are correlated; resampling pairs measures the noise of the
    difference instead of the two runs' spreads added together. Metrics that are not a
    statistic of per-request values (ITL's pooled gaps, rates) keep the unpaired interval."""
    if not info.paired:
        return None
    kb, kc = _request_keys(fb), _request_keys(fc)
    common, ib, ic = np.intersect1d(kb, kc, assume_unique=False, return_indices=True)
    if len(common) < PAIRED_MIN:
        return None
    # A guard against ids that match but requests that do not: the same prompt has the same
    # length in both runs.
    pb = fb["prompt_tokens"].to_numpy(np.float64)[ib]
    pc_ = fc["prompt_tokens"].to_numpy(np.float64)[ic]
    if np.mean(pb == pc_) < 0.9:
        return None
    vb, vc = info.request_values(fb)[ib], info.request_values(fc)[ic]
    ratio, n = info.paired_replicates(vb, vc, resamples, rng)
    return Paired(info.of(vb), info.of(vc), ratio, n)


def _request_keys(f: pd.DataFrame) -> np.ndarray:
    """session and turn of each request, as one string (a missing session is "")."""
    sess = f["session_id"].astype(object).fillna("").astype(str)
    turn = pd.Series(f["turn"].to_numpy(), index=sess.index).astype(object).fillna("").astype(str)
    return (sess + "\x1f" + turn).to_numpy()


def _interval(reps: np.ndarray, confidence: float) -> tuple[float, float]:
    reps = reps[np.isfinite(reps)]
    if len(reps) == 0:
        return math.nan, math.nan
    a = (1 - confidence) / 2
    lo, hi = np.quantile(reps, [a, 1 - a])
    return float(lo), float(hi)


def evaluate(baseline, current, gate_cfg, *, slo: dict | None = None,
             seed: int = 0, allow_missing: bool = False) -> list[RuleResult]:
    """Every rule of ``gate_cfg`` (kvbench.config.GateConfig) on two ``Results``. A rule with
    no data is a ``DataError`` unless ``allow_missing`` (or the rule's ``allow_missing``):
    then it is a ``missing`` result."""
    if not gate_cfg.rules:
        raise UserError("the gate has no rules; add [gate] rules to bench.toml")
    slo = slo if slo is not None else current.meta.slo
    cur = _frame(current, slo)
    base = _frame(baseline, slo) if baseline is not None else None
    endpoints_cur = list(cur["endpoint"].cat.categories) if len(cur) else []
    if not len(cur):
        raise DataError(f"{_where(current)}: the current run has no records, so the gate has "
                        "nothing to judge (not a pass); check that the run sent requests")
    if base is not None and not len(base):
        raise DataError(f"{_where(baseline)}: the baseline run has no records, so the gate "
                        "has nothing to compare with (not a pass); choose another --baseline")
    exact_b, exact_c = _exact(gate_cfg, endpoints_cur, current, cur, baseline, base, slo)
    out: list[RuleResult] = []
    for i, rule in enumerate(gate_cfg.rules):
        try:
            metric = M.metric_name(rule.metric)
        except UserError as exc:
            raise DataError(f"gate rule {i} ({rule.metric}): {exc}") from None
        if rule.endpoint == "*":
            eps = endpoints_cur
        elif rule.endpoint in endpoints_cur:
            eps = [rule.endpoint]
        else:
            raise DataError(f"gate rule {i} names endpoint {rule.endpoint!r}, which the current "
                            f"run does not have; use one of {endpoints_cur} or \"*\"")
        allowed = allow_missing or bool(getattr(rule, "allow_missing", False))
        for ep in eps:
            try:
                _require_records(i, rule, metric, ep, cur, current, "current", allowed)
                if base is not None and rule.max_value is None:
                    _require_records(i, rule, metric, ep, base, baseline, "baseline", allowed)
                shared = baseline is not None and same_schedule(baseline.meta, current.meta, ep)
                result = _one(rule, metric, ep, base, cur, gate_cfg, seed + 7919 * i,
                              shared_schedule=shared, exact=(exact_b, exact_c))
                if result.verdict == "missing":
                    run = baseline if "baseline run" in result.note else current
                    raise _NoData(_where(run), result.note)
            except _NoData as exc:
                if not allowed:
                    raise DataError(f"{exc.where}: gate rule {i} ({metric}) has no data to judge "
                                    f"for endpoint {ep!r} and {_cls(rule)} ({exc.why}), which "
                                    "is not a pass; check the runs' records, or pass "
                                    "--allow-missing (or set allow_missing = true on the rule) "
                                    "to accept that") from None
                result = _missing(rule, metric, ep, exc.why)
            out.append(result)
    if not out:
        raise DataError(f"{_where(current)}: the gate evaluated no check (no rule matched an "
                        "endpoint of the current run), which is not a pass; fix the [gate] "
                        "rules' endpoint names")
    return out


def _exact(gate_cfg, endpoints: list, current, cur, baseline, base, slo) -> tuple[dict, dict]:
    """The exact figures every rule needs, of each sampled run (one scan per run)."""
    want_c, want_b = set(), set()
    for rule in gate_cfg.rules:
        try:
            metric = M.metric_name(rule.metric)
        except UserError:
            continue  # evaluate says so, for its rule
        for ep in (endpoints if rule.endpoint == "*" else
                   [rule.endpoint] if rule.endpoint in endpoints else []):
            want_c.add((metric, ep, rule.request_class))
            if rule.max_value is None:
                want_b.add((metric, ep, rule.request_class))
    exact_c = _exact_figures(current, cur, want_c, slo)
    exact_b = {} if base is None else _exact_figures(baseline, base, want_b, slo)
    return exact_b, exact_c


def _where(results) -> str:
    return str(getattr(results, "path", None) or "run")


class _NoData(Exception):
    """A rule that found nothing to judge (turned into a ``DataError`` unless allowed)."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(why)
        self.where, self.why = where, why


def _cls(rule) -> str:
    return "any class" if rule.request_class == "*" else f"class {rule.request_class!r}"


def _missing(rule, metric: str, endpoint: str, why: str) -> RuleResult:
    """The result of a rule without data that the user allowed."""
    kind = "absolute" if rule.max_value is not None else "relative"
    limit = rule.max_value if rule.max_value is not None else (
        1 + rule.max_increase_pct / 100 if rule.max_increase_pct is not None
        else 1 - rule.max_decrease_pct / 100)
    return RuleResult(metric=metric, endpoint=endpoint, request_class=rule.request_class,
                      kind=kind, limit=limit, baseline=math.nan, current=math.nan,
                      low=math.nan, high=math.nan, n_baseline=0, n_current=0,
                      verdict="missing", note=f"{why}; {ALLOWED}")


def _require_records(i: int, rule, metric: str, endpoint: str, frame: pd.DataFrame, results,
                     side: str, allowed: bool = False) -> None:
    """A rule over a class (or endpoint) with no records in a run is an error, not a check."""
    if len(_select(frame, endpoint, rule.request_class)):
        return
    if allowed:
        raise _NoData(_where(results), f"the {side} run has no records of it")
    raise DataError(f"{_where(results)}: the {side} run has no records of endpoint "
                    f"{endpoint!r} and {_cls(rule)}, so gate rule {i} ({metric}) cannot be "
                    "judged (not a pass); fix the rule's class or endpoint, choose runs that "
                    "sent those requests, or pass --allow-missing to accept that")


def _one(rule, metric: str, endpoint: str, base, cur, gate_cfg, seed: int,
         shared_schedule: bool = False, exact: tuple[dict, dict] = ({}, {})) -> RuleResult:
    info = M.METRIC_INFO[metric]
    conf, b = gate_cfg.confidence, gate_cfg.bootstrap_resamples
    key = (metric, endpoint, rule.request_class)
    fc = _select(cur, endpoint, rule.request_class)
    est_c, reps_c = _replicates(fc, metric, b, seed, exact[1].get(key))
    sides = [("current", _sampled(cur))]
    if rule.max_value is None and base is not None:
        sides.insert(0, ("baseline", _sampled(base)))
    sampled = [(side, x) for side, x in sides if x is not None]
    sample_note = ("" if not sampled else
                   " and ".join(side for side, _ in sampled) + " figures exact over all "
                   + " and ".join(f"{x.n:,}" for _, x in sampled) + " requests; intervals "
                   "from seeded samples of " + " and ".join(f"{x.m:,} of {x.n:,}"
                                                            for _, x in sampled)
                   + " requests, rescaled by sqrt(m/n)")
    common = dict(metric=metric, endpoint=endpoint, request_class=rule.request_class,
                  n_current=len(fc))
    if rule.max_value is not None:
        lo, hi = _interval(reps_c, conf)
        if len(fc) == 0 or math.isnan(est_c):
            verdict, note = "missing", f"{metric} has no value in the current run's records"
        elif hi <= rule.max_value or (lo == hi == est_c and est_c <= rule.max_value):
            verdict, note = "pass", ""
        elif lo > rule.max_value:
            verdict, note = "fail", ""
        else:
            verdict, note = "inconclusive", ""
        note = _with(note, sample_note if verdict != "missing" else "")
        return RuleResult(kind="absolute", limit=rule.max_value, baseline=math.nan,
                          current=est_c, low=lo, high=hi, n_baseline=0, verdict=verdict,
                          note=note, **common)
    if base is None:
        raise DataError(f"gate rule {rule.metric} is relative and needs a baseline; give "
                        "--baseline")
    fb = _select(base, endpoint, rule.request_class)
    est_b, reps_b = _replicates(fb, metric, b, seed + 1, exact[0].get(key))
    if rule.max_increase_pct is not None:
        limit = 1 + rule.max_increase_pct / 100
    else:
        limit = 1 - rule.max_decrease_pct / 100
    increase_rule = rule.max_increase_pct is not None
    note = ""
    if len(fb) == 0 or len(fc) == 0 or math.isnan(est_b) or math.isnan(est_c):
        lo = hi = math.nan
        side = "current" if len(fc) == 0 or math.isnan(est_c) else "baseline"
        verdict, note = "missing", f"{metric} has no value in the {side} run's records"
    elif est_b == 0:
        lo = hi = math.nan
        if est_c == 0:
            verdict, note = "pass", "zero in both runs"
        else:
            verdict, note = "inconclusive", "baseline is zero: a ratio is undefined"
    else:
        rng = np.random.default_rng(seed + 2)
        noisy_b = None if shared_schedule else info.schedule_noise(reps_b, _arrivals(fb), rng)
        if noisy_b is not None:
            reps_b, reps_c = noisy_b, info.schedule_noise(reps_c, _arrivals(fc), rng)
            note = "arrival schedules differ: the rate's interval includes Poisson count noise"
        paired = (_paired_ratio(fb, fc, info, b, rng) if shared_schedule and not sample_note
                  else None)
        if paired is not None:
            ratio, est_b, est_c = paired.ratio, paired.baseline, paired.current
            note = (f"paired bootstrap over {paired.pairs} requests replayed in both runs "
                    "(same seeded schedule); both values over those requests")
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = reps_c / reps_b[rng.permutation(len(reps_b))]
        lo, hi = _interval(ratio, conf)
        if math.isnan(lo):
            verdict = "inconclusive"
        elif increase_rule:
            verdict = "pass" if hi <= limit else "fail" if lo > limit else "inconclusive"
        else:
            verdict = "pass" if lo >= limit else "fail" if hi < limit else "inconclusive"
    if increase_rule == info.higher_is_better:
        warn = ("this rule bounds an increase of a higher-is-better metric" if increase_rule
                else "this rule bounds a decrease of a lower-is-better metric")
        note = f"{note}; {warn}" if note else warn
    note = _with(note, sample_note if verdict != "missing" else "")
    return RuleResult(kind="relative", limit=limit, baseline=est_b, current=est_c, low=lo,
                      high=hi, n_baseline=len(fb), verdict=verdict, note=note, **common)


def _with(note: str, more: str) -> str:
    return f"{note}; {more}" if note and more else note or more


def overall(results: list[RuleResult]) -> str:
    """The worst verdict of the rules judged (``missing`` only when every rule lacked data,
    which the user allowed); no results is not a pass (``evaluate`` never returns none)."""
    if not results:
        raise DataError("the gate evaluated no check, which is not a pass")
    return max((r.verdict for r in results), key=VERDICT_ORDER.__getitem__)


def missing_note(results: list[RuleResult]) -> str:
    """The sentence every output carries when rules without data were allowed ("" if none)."""
    n = sum(r.verdict == "missing" for r in results)
    if not n:
        return ""
    return (f"{n} of {len(results)} check{'s' * (len(results) != 1)} had no data and "
            f"{'were' if n != 1 else 'was'} not judged ({ALLOWED})")


def exit_code(verdict: str, strict: bool = False) -> int:
    """0 pass, 1 fail, 2 inconclusive when ``strict`` (else 0); ``missing`` (every rule
    without data, which the user allowed) is 0."""
    return {"pass": 0, "missing": 0, "fail": 1, "inconclusive": 2 if strict else 0}[verdict]


def junit_xml(results: list[RuleResult], suite: str = "kvbench-gate") -> str:
    """JUnit XML, one test case per rule and endpoint; inconclusive rules are 'skipped'."""
    fails = sum(r.verdict == "fail" for r in results)
    skips = sum(r.verdict in ("inconclusive", "missing") for r in results)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f'<testsuite name={quoteattr(suite)} tests="{len(results)}" failures="{fails}" '
             f'skipped="{skips}" errors="0">']
    if missing_note(results):
        lines += ["  <properties>",
                  f'    <property name="missing" value={quoteattr(missing_note(results))}/>',
                  "  </properties>"]
    for r in results:
        lines.append(f'  <testcase classname={quoteattr(suite)} name={quoteattr(r.name)}>')
        if r.verdict == "fail":
            lines.append(f'    <failure message={quoteattr(r.describe())}/>')
        elif r.verdict == "inconclusive":
            lines.append(f'    <skipped message={quoteattr("inconclusive: " + r.describe())}/>')
        elif r.verdict == "missing":
            lines.append(f'    <skipped message={quoteattr("no data: " + r.describe())}/>')
        lines.append(f"    <system-out>{escape(r.describe())}</system-out>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"


def junit_error(message: str, suite: str = "kvbench-gate") -> str:
    """JUnit XML for a gate that could not judge: one test case in error, so CI shows it
    instead of an empty (passing) suite."""
    return "\n".join([
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<testsuite name={quoteattr(suite)} tests="1" failures="0" skipped="0" errors="1">',
        f'  <testcase classname={quoteattr(suite)} name="gate">',
        f'    <error message={quoteattr(message)}/>',
        "  </testcase>", "</testsuite>"]) + "\n"


_ICON = {"pass": "PASS", "fail": "FAIL", "inconclusive": "INCONCLUSIVE",
         "missing": "NO DATA (allowed)"}


def markdown(results: list[RuleResult], baseline_label: str, current_label: str,
             confidence: float) -> str:
    verdict = overall(results)
    out = [f"### kvbench gate: **{_ICON[verdict]}**", "",
           f"Baseline `{baseline_label}`, current `{current_label}`; "
           f"{confidence:.0%} bootstrap intervals of current / baseline."
           + (f" **{missing_note(results)}.**" if missing_note(results) else ""), "",
           "| verdict | metric | endpoint | class | baseline | current | change | interval | limit |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.verdict == "missing":
            out.append(f"| {_ICON[r.verdict]} | {r.metric} | {_md(r.endpoint)} | "
                       f"{_md(r.request_class)} | | | | | {_md(r.note)} |")
            continue
        if r.kind == "relative":
            change = f"{(r.current / r.baseline - 1) * 100:+.1f}%" if r.baseline else "n/a"
            interval = f"[{r.low:.3f}, {r.high:.3f}]"
            limit = f"ratio {'<=' if r.limit >= 1 else '>='} {r.limit:.3f}"
            base = f"{r.baseline:.4g}"
        else:
            change, base = "", ""
            interval = f"[{r.low:.4g}, {r.high:.4g}]"
            limit = f"<= {r.limit:.4g}"
        out.append(f"| {_ICON[r.verdict]} | {r.metric} | {_md(r.endpoint)} | "
                   f"{_md(r.request_class)} | {base} | {r.current:.4g} | {change} | {interval} | "
                   f"{limit} |")
    return "\n".join(out) + "\n"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def to_records(results: list[RuleResult]) -> list[dict]:
    """Plain dicts (for run.json and the HTML report's gate section)."""
    return [{"metric": r.metric, "endpoint": r.endpoint, "request_class": r.request_class,
             "kind": r.kind, "limit": r.limit, "baseline": r.baseline, "current": r.current,
             "low": r.low, "high": r.high, "verdict": r.verdict, "note": r.note,
             "text": r.describe()} for r in results]
