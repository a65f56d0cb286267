"""The live summary of a run, for watching it while it runs: exact TTFT / TPOT / ITL / lateness
percentiles per endpoint and class over a sliding window and since start, SLO attainment,
goodput, hit ratio, requests in flight and dropped, and what the collectors of ``kvbench run``
write beside the records (``loadgen.telemetry``).

Nothing here runs per request: the record sink hands each batch it wrote (about twice a second,
its column lists by name) to ``LiveStats.tap``, which only queues it; a greenlet derives the
queued batches every ``TICK_S``, by evaluating the report's own per-request definitions
(``reports.definitions``, numpy only: no pyarrow or pandas in a load process, issue 13).
Percentiles are numpy's linear ones over the records' own values (as the reports take them),
never Locust's rounded histogram: TTFT, TPOT and lateness as exact floats, ITL as exact counts
per microsecond (``loadgen.live_quantiles``). A worker sends what it derived to the master
(``kvbench_live`` messages), so the master's summary is exact over every worker's requests.
``bench/live_cost.py`` measures the cost; ``tests/test_live_vs_report.py`` holds the figures
equal to the report's on the same shards.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import time
from pathlib import Path
from typing import Mapping

import numpy as np

from kvbench.core.rows import RowTail, shard_files
# the quantile structures are re-exported: kvbench.loadgen.liveview.live.* imports keep working
from kvbench.loadgen.liveview.live_quantiles import (PER_REQUEST, QS, KeyStats,  # noqa: F401
                                            MicroHist, SinceStart, micro_quantiles, quantiles,
                                            quantiles_of)
from kvbench.loadgen.liveview.telemetry import TelemetryTail
from kvbench.reports.measures import definitions as D
from kvbench.runs.progress import live_path

WINDOW_S = 30.0  # the sliding window of the "now" figures (by completion time)
TICK_S = 0.5  # how often queued batches are derived (a worker sends them to the master)
PROGRESS_TICKS = 2  # the progress file is rewritten every this many ticks (a second)
LIVE_MSG = "kvbench_live"  # worker -> master: derived arrays of a tick
LIVE_STATE_MSG = "kvbench_live_state"  # worker -> master: in flight / dropped / stage now
LIVE_WANTED_MSG = "kvbench_live_wanted"  # master with a web UI -> workers: send your values
RECENT_TTFT = 1000  # TTFT values a progress file carries (kvbench run's p50 over processes)


def _columns(batch) -> Mapping[str, list]:
    """A batch as the sink hands it over ({column: list}); an Arrow batch or table (tests,
    benches) through its ``to_pydict``, so pyarrow is never imported here."""
    return batch.to_pydict() if hasattr(batch, "to_pydict") else batch


# what the live view takes of the definitions (``reports.definitions``)
_DERIVED = ("ok", "cancelled", "failed", "judged", "met", "hit_counted", "ttft_ms", "tpot_ms",
            "lateness_ms", "prompt_tokens", "cached_tokens", "itl_gaps_ns")


def derive(batch, slo: dict) -> dict:
    """A REQUESTS batch ({column: list of values}) -> {(endpoint, class): (arrays, counts)},
    by the report's definitions (``reports.definitions``), vectorised (no per-row Python but
    the list conversions and the per-class split); ITL gaps to the nearest microsecond."""
    batch = _columns(batch)
    n = len(batch["status"])
    if n == 0:
        return {}
    d = D.evaluate(_DERIVED, batch, slo, n=n)
    f = {k: d[k].data for k in ("ok", "cancelled", "failed", "judged", "met", "hit_counted")}
    ms = {m: D.floats(d[f"{m}_ms"]) for m in PER_REQUEST}
    prompt, cached = d["prompt_tokens"].data, d["cached_tokens"].data
    gaps = d["itl_gaps_ns"]
    itl_us = D.gap_us(gaps.values)
    gap_row = np.repeat(np.arange(n), np.diff(gaps.offsets))
    groups = list(_groups(batch["endpoint"], batch["request_class"]))
    out = {}
    for key, rows in groups:
        hit = rows & f["hit_counted"]
        arrays = {m: v[rows & ~np.isnan(v)] for m, v in ms.items()}
        arrays["itl_us"] = itl_us if len(groups) == 1 else itl_us[rows[gap_row]]
        counts = {"done": int(rows.sum()), "ok": int((rows & f["ok"]).sum()),
                  "errors": int((rows & f["failed"]).sum()),
                  "cancelled": int((rows & f["cancelled"]).sum()),
                  "slo_judged": int((rows & f["judged"]).sum()),
                  "slo_met": int((rows & f["met"]).sum()),
                  "prompt_tokens": int(prompt[hit].sum()), "cached_tokens": int(cached[hit].sum())}
        out[key] = (arrays, counts)
    stage = np.array(batch["stage"], dtype=object)
    for s in sorted({v for v in batch["stage"] if v is not None}):  # per stage, for kvbench
        rows = stage == s  # run's progress line
        out[("", f"stage:{int(s)}")] = ({}, {"done": int(rows.sum()),
                                            "errors": int((rows & f["failed"]).sum())})
    return out


def _groups(ep_col: list, cls_col: list):
    """(endpoint, class) -> its rows (a bool mask), vectorised per distinct value."""
    eps, classes = list(dict.fromkeys(ep_col)), list(dict.fromkeys(cls_col))
    n = len(ep_col)
    ep_arr = np.array(ep_col, dtype=object) if len(eps) > 1 else None
    cls_arr = np.array(cls_col, dtype=object) if len(classes) > 1 else None
    for ep in eps:
        on_ep = np.ones(n, bool) if ep_arr is None else _equal(ep_arr, ep)
        for cls in classes:
            rows = on_ep if cls_arr is None else on_ep & _equal(cls_arr, cls)
            if rows.any():
                yield (ep, cls), rows


def _equal(values: np.ndarray, value) -> np.ndarray:
    """Elementwise ``values == value`` of an object array as bools (None matches None)."""
    return np.fromiter((v == value for v in values), bool, len(values)) if value is None else (
        values == value)


class LiveStats:
    """One per load process (and one on a distributed run's master, fed by its workers)."""

    def __init__(self, slo: dict | None = None, window_s: float = WINDOW_S,
                 clock=time.time_ns) -> None:
        self.slo = D.slo_limits(slo)  # {class: {metric: limit ms}}
        self.window_s = window_s
        self.keys: dict[tuple, KeyStats] = {}
        self.stages: dict[int, dict] = {}  # stage -> done, errors
        self.inbox: collections.deque = collections.deque()  # batches from the sink's thread
        self.outbox: list = []  # a worker's derived chunks for the master
        self.clock = clock  # epoch ns (a bench replays time faster)
        self.t0_ns = clock()
        self.recent_ttft: collections.deque = collections.deque(maxlen=RECENT_TTFT)
        self.state: dict = {}  # in flight, dropped, stage now (this process)
        self.remote_state: dict[str, dict] = {}  # a master's: per worker
        self.telemetry = None  # TelemetryTail where the run directory is known
        self.derive_s = 0.0  # CPU seconds spent deriving (bench/live_cost.py reads it)
        self.tails: dict[Path, RowTail] = {}  # ``follow``'s, per shard

    # -- the load process side
    def tap(self, batch) -> None:
        """The sink wrote ``batch`` ({column: list}; any thread): queue it (a deque append)."""
        self.inbox.append(batch)

    def follow(self, run_dir: Path) -> None:
        """Queue the records a run's load processes appended to their ``requests`` shards
        since the last call (another process watching a run: what the sink would have
        tapped), through the store's tail of ``.rows`` shards."""
        for path in shard_files(run_dir, "requests"):
            if path.suffix == ".rows":
                for batch in self.tails.setdefault(path, RowTail(path, "requests")).dicts():
                    self.tap(batch)

    def drain(self, keep_for_master: bool = False) -> None:
        """Derive what the sink queued."""
        t = time.thread_time()
        now = self.clock()
        while self.inbox:
            derived = derive(self.inbox.popleft(), self.slo)
            self.add(now, derived)
            if keep_for_master:
                self.outbox.append(_wire(derived))
        self.derive_s += time.thread_time() - t

    def add(self, t_ns: int, derived: dict) -> None:
        for key, (arrays, counts) in derived.items():
            if key[1].startswith("stage:"):
                st = self.stages.setdefault(int(key[1][6:]), {"done": 0, "errors": 0})
                for k in st:
                    st[k] += counts[k]
                continue
            ks = self.keys.get(key)
            if ks is None:
                ks = self.keys[key] = KeyStats()
            ks.add(t_ns, arrays, counts)
            ks.trim(t_ns, self.window_s)  # unwatched, the window still forgets
            if len(arrays["ttft"]):
                self.recent_ttft.extend(arrays["ttft"][-RECENT_TTFT:].tolist())

    # -- the master side
    def add_remote(self, data: dict) -> None:
        self.add(self.clock(), _unwire(data))

    # -- the views
    def summary(self) -> dict:
        now = self.clock()
        since_s = (now - self.t0_ns) / 1e9
        rows = []
        for (ep, cls), ks in sorted(self.keys.items()):
            s = ks.summary(self.window_s, now, since_s)
            rows.append({"endpoint": ep, "request_class": cls, **s,
                         "slo": self.slo.get(cls) or {}})
        state = dict(self.state)
        for w in self.remote_state.values():
            for k in ("in_flight", "dropped_at_cap", "started"):
                state[k] = state.get(k, 0) + (w.get(k) or 0)
            if w.get("open_stage") is not None:
                state["open_stage"] = w["open_stage"]
        tele = self.telemetry.summary(self.window_s) if self.telemetry is not None else {
            "note": "no run directory yet"}
        return {"t_ns": now, "since_s": since_s, "window_s": self.window_s, "rows": rows,
                "state": state, "workers": len(self.remote_state), "telemetry": tele,
                "stages": {str(k): v for k, v in sorted(self.stages.items())}}

    def progress(self) -> dict:
        """What kvbench run's progress line needs from this process (cheap: no sort)."""
        return {"t_ns": self.clock(), "pid": os.getpid(), "state": self.state,
                "stages": {str(k): v for k, v in self.stages.items()},
                "ttft_ms_recent": np.round(np.fromiter(self.recent_ttft, float), 3).tolist()}


_WIRE = {"ttft": np.float64, "tpot": np.float64, "lateness": np.float64, "itl_us": np.int64}


def _wire(derived: dict) -> dict:
    """Derived chunks as msgpack-able data (arrays as float64 bytes)."""
    return {"keys": [[k[0], k[1], {m: a.astype(_WIRE[m]).tobytes() for m, a in arrays.items()},
                      counts] for k, (arrays, counts) in derived.items()]}


def _unwire(data: dict) -> dict:
    return {(ep, cls): ({m: np.frombuffer(b, _WIRE[m]) for m, b in arrays.items()}, counts)
            for ep, cls, arrays, counts in data["keys"]}


# --------------------------------------------------------------------------- in a load process

def attach(ctx) -> LiveStats:
    """The live summary of a load context: taps its sink, derives once a second in a greenlet,
    and (under ``kvbench run``) keeps ``live-<host>-<pid>.json`` for its progress line."""
    import gevent
    from locust.runners import WorkerRunner

    env = ctx.environment
    stats = LiveStats(ctx.job.slo)
    stats.telemetry = TelemetryTail(ctx.run_dir)
    ctx.sink.taps.append(stats.tap)
    env.kvbench_live = stats
    runner = env.runner
    worker = isinstance(runner, WorkerRunner)
    # under kvbench run (a job file given: --kvbench-job) a progress line reads this process's
    job_file = getattr(getattr(env, "parsed_options", None), "kvbench_job", "")
    path = live_path(ctx.run_dir) if job_file else None
    if path is not None:  # gone with the process (kvbench run also sweeps them after a job)
        atexit.register(path.unlink, missing_ok=True)

    ticks = [0]
    _warm(ctx.job.slo)

    def tick() -> None:
        while True:
            gevent.sleep(TICK_S)
            try:
                # a worker sends its values only to a master with a web UI (it says so)
                send = worker and getattr(env, "kvbench_live_wanted", False)
                stats.drain(keep_for_master=send)
                d = ctx.dispatcher
                in_flight = d.in_flight if d is not None else max(
                    0, ctx.sink.started - ctx.sink.written - len(ctx.sink))
                stats.state = {"in_flight": in_flight, "started": ctx.sink.started,
                               "dropped_at_cap": d.dropped_at_cap if d is not None else 0,
                               "open_stage": st.to_dict() if (st := ctx.sink.meta.open_stage)
                               else None,
                               "pacing": ctx.pacing}
                if send:
                    for data in stats.outbox:
                        runner.send_message(LIVE_MSG, data)
                    stats.outbox = []
                    runner.send_message(LIVE_STATE_MSG, stats.state)
                ticks[0] += 1
                if path is not None and not ctx.sink.closed and ticks[0] % PROGRESS_TICKS == 0:
                    _write_json(path, stats.progress())
            except Exception:  # noqa: BLE001 - watching must never break the load
                import logging

                logging.getLogger("kvbench.live").debug("live tick failed", exc_info=True)
            if ctx.sink.closed:
                if path is not None:
                    path.unlink(missing_ok=True)
                return

    gevent.spawn(tick)
    return stats


def _warm(slo: dict | None) -> None:
    """Derive a two-row batch once before any load, into a throwaway summary: the first
    derivation's one-time costs (numpy's code paths) otherwise land in the first tick of the
    run, a 10 ms pause of every stream at 256 of them (bench/locust_path.py)."""
    from kvbench.core.rows import REQUEST_COLUMNS

    given = {"endpoint": ["w", "w"], "request_class": ["c", "c"], "status": ["ok", "cancelled"],
             "ttft_ns": [1_000_000, None], "e2e_ns": [3_000_000, None],
             "completion_tokens": [3, None], "prompt_tokens": [8, 8], "cached_tokens": [0, 0],
             "t_scheduled": [1, 1], "t_sent": [2, 2], "stage": [0, 0],
             "chunk_offsets_ns": [[1_000_000, 2_000_000, 3_000_000], []]}
    try:
        batch = {name: given.get(name, [None, None]) for name in REQUEST_COLUMNS}
        s = LiveStats(slo)
        s.tap(batch)
        s.drain()
        s.progress()
    except Exception:  # noqa: BLE001 - a warm-up must never stop the load
        import logging

        logging.getLogger("kvbench.live").debug("live warm-up failed", exc_info=True)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


def listen_as_worker(environment) -> None:
    """A worker sends its live values once its master asks (a master with a web UI)."""
    def on_wanted(environment, msg, **kw) -> None:
        environment.kvbench_live_wanted = True

    environment.runner.register_message(LIVE_WANTED_MSG, on_wanted)


def attach_master(environment, slo: dict | None, run_dir: Path | None) -> LiveStats:
    """A master's live summary, fed by its workers' messages."""
    stats = LiveStats(slo)
    if run_dir is not None:
        stats.telemetry = TelemetryTail(run_dir)
    environment.kvbench_live = stats
    runner = environment.runner

    def on_live(environment, msg, **kw) -> None:
        stats.add_remote(msg.data)

    def on_state(environment, msg, **kw) -> None:
        stats.remote_state[msg.node_id] = msg.data

    runner.register_message(LIVE_MSG, on_live)
    runner.register_message(LIVE_STATE_MSG, on_state)
    return stats
