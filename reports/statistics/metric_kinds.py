"""What kinds of metric there are, each with its definition over a request frame
(``value``) and its own replicate strategy (``replicates``, from the bootstrap engine in
``reports.resampling``): per-request values resample requests, ITL gaps resample whole requests
(a cluster bootstrap), counts draw binomially, rates over a fixed wall time may add Poisson
count noise. Which request counts as what (finished, an error, within SLO, ...) is
``reports.definitions``', read from the frame by ``reports.frame.defined``; the registry of
named metrics is ``reports.metrics``. ``DEFINITIONS`` is the prose every report prints.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import pandas as pd

from kvbench.reports.statistics import resampling as R
from kvbench.reports.measures.frame import achieved_s, defined, itl_values
from kvbench.reports.statistics.resampling import drop_nan

DEFINITIONS = {
    "TTFT": "time to first token: arrival of the first chunk carrying a generated token, "
            "minus t_sent (successful requests).",
    "TPOT": "time per output token: (E2E - TTFT) / (completion_tokens - 1), per request, "
            "when completion_tokens > 1.",
    "ITL": "inter-token latency: gaps between consecutive token-carrying chunks, pooled over "
           "successful requests; a chunk carrying k tokens is one gap.",
    "E2E": "end to end: last byte of the response minus t_sent (successful requests).",
    "lateness": "client lateness: t_sent - t_scheduled, every request sent (the load "
                "generator's own delay; never hidden).",
    "intended": "latency from the intended send time (coordinated omission): TTFT or E2E plus "
                "the request's lateness, (t_sent - t_scheduled) + TTFT and likewise for E2E "
                "(successful requests): a backlog that delays sends behind a slow endpoint "
                "counts against it. Equal to TTFT and E2E when every request was sent on time "
                "(think-time replays, closed loops).",
    "throughput": "achieved throughput: requests finished (succeeded or failed; not those "
                  "cancelled at the stop) per second of the achieved interval, from the stage's "
                  "first send to its last completion, drain included (as vllm bench serve and "
                  "GuideLLM measure it); input and output tokens/s count successful requests' "
                  "server-reported usage over the same interval. Summed over stages, each "
                  "stage's interval once.",
    "offered": "offered rate: requests scheduled in the stage (every record, cancelled ones "
               "included; arrivals dropped at max_in_flight are not records) / the schedule "
               "window: the stage's duration_s for an open-loop rate, the stage start to the "
               "last scheduled arrival for a trace replay; none for a closed loop (users).",
    "started": "first tokens/s: successful requests per second from the stage's first send "
               "to its last first token: the rate at which the endpoint started serving. A "
               "long answer stretches the achieved interval (a 15 s answer in a 10 s stage) "
               "but not this one; a queue before the prefill stretches both.",
    "overloaded": "a stage is overloaded when both its achieved throughput and its first "
                  "tokens/s are clearly below its offered rate: each more than 20% below, and "
                  "the Poisson probability of so few requests at 80% of the offered rate over "
                  "its interval under 1% (beyond arrival noise). Achieved alone below offered "
                  "with first tokens on schedule is the drain of long answers, not overload. "
                  "The same test on goodput (with first tokens/s) says the stage served fewer "
                  "requests within SLO than it was offered.",
    "goodput": "requests that succeeded and met every SLO of their class (TTFT, TPOT, E2E), per "
               "second of the achieved interval; SLO attainment is their share of the requests "
               "that finished: errors count as misses, requests cancelled at the stop are left "
               "out. A class without an SLO table shows \"no SLO\": its requests are in neither "
               "(never met by default).",
    "hit ratio": "prefix-cache hit ratio: sum(cached_tokens) / sum(prompt_tokens) over "
                 "successful requests reporting cached_tokens; engine: increase of the "
                 "prefix-cache hit counter / increase of the query counter, as named by the "
                 "engine adapter of the endpoint's family (where the query counter counts only "
                 "computed tokens, as llama.cpp's does: hits / (hits + queries)).",
    "error rate": "requests that failed (http_error, timeout, disconnected, protocol_error) / "
                  "requests that finished (all but those cancelled at the stop).",
    "cancelled": "cancelled at the stop: a request still in flight when its stage or the run "
                 "ended (or was interrupted), cut by kvbench after the drain bound: recorded "
                 "and counted apart, never an error, and left out of error rate, SLO "
                 "attainment, throughput and latency. The server may still have counted its "
                 "tokens.",
    "percentiles": "linear interpolation between order statistics (numpy's default); "
                   "confidence intervals by a seeded bootstrap over requests.",
    "wall time": "sum over the load stages in the rows of (t_end - t_start) from run.json; "
                 "without it, last response end minus first scheduled send per stage (rates "
                 "and the cost per output token use the achieved interval).",
}


def quantile(values: np.ndarray, q: float) -> float:
    """numpy's 'linear' q-quantile of the non-NaN values (NaN when there are none)."""
    v = drop_nan(values)
    return float(np.quantile(v, q)) if len(v) else math.nan


def mean(values: np.ndarray) -> float:
    v = drop_nan(values)
    return float(v.mean(dtype=np.float64)) if len(v) else math.nan


def _no_replicates(resamples: int) -> np.ndarray:
    return np.full(resamples, np.nan)


# --------------------------------------------------------------------------------------------
# metric kinds


class Metric(ABC):
    """A metric's definition (``value``) and its replicate strategy (``replicates``)."""

    unit = ""
    higher_is_better = False
    term = ""  # the entry of DEFINITIONS that defines it
    # True for a rate over a fixed wall time: when two runs' arrival schedules differ, its
    # count of arrivals is itself random (``schedule_noise``)
    counts_arrivals = False
    paired = False  # True when it is a statistic of per-request values (``paired_replicates``)

    def __init__(self, name: str, label: str):
        self.name = name
        self.label = label

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def definition(self) -> str:
        return DEFINITIONS[self.term]

    @abstractmethod
    def value(self, frame: pd.DataFrame) -> float:
        """The metric over the requests of ``frame``."""

    @abstractmethod
    def replicates(self, frame: pd.DataFrame, resamples: int,
                   rng: np.random.Generator) -> tuple[float, np.ndarray]:
        """(estimate, seeded bootstrap replicates) over the requests of ``frame``."""

    def schedule_noise(self, reps: np.ndarray, n: int,
                       rng: np.random.Generator) -> np.ndarray | None:
        """Replicates with the run's number of arrivals (``n``) redrawn, for a comparison of
        runs whose arrival schedules differ; None when the metric does not count arrivals."""
        return R.poisson_count_noise(reps, n, rng) if self.counts_arrivals else None


class Sample(Metric):
    """A quantile (``q``) or mean (q None) of a sample of values taken from the frame; metrics
    over the same ``source`` share one extraction in ``evaluate``."""

    unit = "ms"
    source = ""

    def __init__(self, name: str, label: str, term: str, q: float | None):
        super().__init__(name, label)
        self.term = term
        self.q = q

    @abstractmethod
    def sample(self, frame: pd.DataFrame) -> np.ndarray:
        """The values the quantile or mean is taken over (NaN where a request has none)."""

    def of(self, values: np.ndarray) -> float:
        return quantile(values, self.q) if self.q is not None else mean(values)

    def value(self, frame: pd.DataFrame) -> float:
        return self.of(self.sample(frame))

    def replicates(self, frame, resamples, rng):
        return self.sample_replicates(frame, drop_nan(self.sample(frame)), resamples, rng)

    @abstractmethod
    def sample_replicates(self, frame: pd.DataFrame, values: np.ndarray, resamples: int,
                          rng: np.random.Generator) -> tuple[float, np.ndarray]:
        """``replicates`` given the frame's sample (NaN dropped), already extracted."""


class PerRequest(Sample):
    """Over one value per request (a frame column): requests are independent draws."""

    paired = True

    def __init__(self, name: str, label: str, term: str, column: str, q: float | None):
        super().__init__(name, label, term, q)
        self.source = column

    def sample(self, frame):
        return frame[self.source].to_numpy()

    def sample_replicates(self, frame, values, resamples, rng):
        if self.q is not None:
            return R.quantile_replicates(values, self.q, resamples, rng)
        return R.mean_replicates(values, resamples, rng)

    def request_values(self, frame: pd.DataFrame) -> np.ndarray:
        """One value per request (NaN where it has none), for pairing requests of two runs."""
        return frame[self.source].to_numpy(np.float64)

    def _rows_statistic(self, x: np.ndarray) -> np.ndarray:
        return (np.nanquantile(x, self.q, axis=1) if self.q is not None
                else np.nanmean(x, axis=1))

    def paired_replicates(self, base: np.ndarray, cur: np.ndarray, resamples: int,
                          rng: np.random.Generator) -> tuple[np.ndarray, int]:
        """(replicates of current / baseline, pairs) over matched requests' values."""
        return R.paired_ratio_replicates(base, cur, self._rows_statistic, resamples, rng)


class PooledGaps(Sample):
    """Over the ITL gaps pooled across requests. Gaps of one request share its load, batch
    and output length, so they are correlated: a cluster bootstrap over requests."""

    source = "itl_ms"

    def __init__(self, name: str, label: str, term: str, q: float | None,
                 max_requests: int = R.CLUSTER_MAX):
        super().__init__(name, label, term, q)
        self.max_requests = max_requests  # m-out-of-n above this many requests with gaps

    def sample(self, frame):
        return itl_values(frame)

    def sample_replicates(self, frame, values, resamples, rng):
        store = frame.attrs.get("itl")
        if store is None:
            itl_values(frame)  # raises the explanatory error
        rows = np.asarray(frame["itl_row"].to_numpy(), np.int64)
        lens = store.offsets[rows + 1] - store.offsets[rows]
        return R.cluster_replicates(lambda ids: store.gather(rows[ids]), lens, self.q,
                                    resamples, rng, self.max_requests, pooled=values)


class _Sum(Metric):
    """A sum over requests (a count, tokens), resampled with the stage wall time fixed."""

    def replicates(self, frame, resamples, rng):
        est = self.value(frame)
        if len(frame) == 0 or est != est:
            return est, _no_replicates(resamples)
        return est, self._draws(frame, resamples, rng)

    @abstractmethod
    def _draws(self, frame: pd.DataFrame, resamples: int,
               rng: np.random.Generator) -> np.ndarray:
        """Replicates of the metric (the estimate is known and finite)."""


def finished(frame: pd.DataFrame) -> np.ndarray:
    """Requests that finished, succeeded or failed: all but those cancelled at the stop."""
    return defined(frame, "finished")


def failed(frame: pd.DataFrame) -> np.ndarray:
    """Requests that failed (errors): neither ok nor cancelled at the stop."""
    return defined(frame, "failed")


class Count(_Sum):
    """Requests whose flag is set, per second of the stages' achieved interval (``per_second``;
    ``window`` picks another time of the stages) or as a share of the requests ``over``
    selects (default: all); binomial draws over those."""

    def __init__(self, name: str, label: str, term: str, flag: Callable[[pd.DataFrame],
                 np.ndarray], per_second: bool, higher_is_better: bool,
                 over: Callable[[pd.DataFrame], np.ndarray] | None = None,
                 window: Callable[[pd.DataFrame], float] = achieved_s):
        super().__init__(name, label)
        self.window = window
        self.term = term
        self.flag = flag
        self.over = over
        self.per_second = per_second
        self.counts_arrivals = per_second
        self.higher_is_better = higher_is_better
        self.unit = "req/s" if per_second else "fraction"

    def _flags(self, frame: pd.DataFrame) -> np.ndarray:
        """The flag of each request of the denominator."""
        flags = np.asarray(self.flag(frame), bool)
        return flags if self.over is None else flags[np.asarray(self.over(frame), bool)]

    def value(self, frame):
        if self.per_second:
            return _rate(int(np.asarray(self.flag(frame), bool).sum()), frame, self.window)
        flags = self._flags(frame)
        return float(flags.sum()) / len(flags) if len(flags) else math.nan

    def _draws(self, frame, resamples, rng):
        flags = self._flags(frame)  # resampling the requests that finished only
        if not len(flags):
            return _no_replicates(resamples)
        draws = R.count_replicates(flags, resamples, rng)
        return draws / self.window(frame) if self.per_second else draws / len(flags)


class TokenRate(_Sum):
    """Server-reported tokens of successful requests per second of the achieved interval."""

    unit = "tok/s"
    higher_is_better = True
    counts_arrivals = True
    term = "throughput"

    def __init__(self, name: str, label: str, column: str):
        super().__init__(name, label)
        self.column = column

    def value(self, frame):
        return _rate(np.nansum(frame[self.column].to_numpy()[frame["ok"].to_numpy()]), frame)

    def _draws(self, frame, resamples, rng):
        ok = frame["ok"].to_numpy()
        per_row = np.where(ok, np.nan_to_num(frame[self.column].to_numpy()), 0.0)
        _, reps = R.mean_replicates(per_row, resamples, rng)
        return reps * len(frame) / achieved_s(frame)


class PrefixHitRatio(_Sum):
    """sum(cached_tokens) / sum(prompt_tokens) over successful requests reporting both."""

    unit = "fraction"
    higher_is_better = True
    term = "hit ratio"

    @staticmethod
    def _tokens(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        rows = defined(frame, "hit_counted")
        return frame["cached_tokens"].to_numpy()[rows], frame["prompt_tokens"].to_numpy()[rows]

    def value(self, frame):
        cached, prompt = self._tokens(frame)
        total = prompt.sum()
        return float(cached.sum() / total) if total > 0 else math.nan

    def _draws(self, frame, resamples, rng):
        return R.ratio_replicates(*self._tokens(frame), resamples, rng)[1]


def _rate(count: float, frame: pd.DataFrame,
          window: Callable[[pd.DataFrame], float] = achieved_s) -> float:
    w = window(frame)
    return float(count) / w if w == w and w > 0 else math.nan


def with_slo(frame: pd.DataFrame) -> np.ndarray:
    """Requests whose class has an SLO."""
    return defined(frame, "has_slo")


def met_slo(frame: pd.DataFrame) -> np.ndarray:
    """Requests that succeeded and met every SLO of a class that has one."""
    return defined(frame, "met")


def judged(frame: pd.DataFrame) -> np.ndarray:
    """Requests SLO attainment is over: those that finished, of a class with an SLO."""
    return defined(frame, "judged")


class Goodput(Count):
    """Requests within SLO per second; "no SLO" (NaN) when no request has a class with one."""

    def value(self, frame):
        return super().value(frame) if with_slo(frame).any() else math.nan

    def replicates(self, frame, resamples, rng):
        if not len(frame) or not with_slo(frame).any():
            return math.nan, _no_replicates(resamples)
        return super().replicates(frame, resamples, rng)
