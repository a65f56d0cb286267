"""The capacity search (``[profiles.*] pacing = "search"``): for one endpoint x workload, the
highest offered Poisson rate at which every class with an SLO meets its attainment target, or
with ``search.loop = "closed"`` the highest number of closed-loop users (each probe a stage of
that many users, ``loadgen.pacing.ClosedLoopStages``; the plan in whole users).

``kvbench run`` drives it (``run``): one Locust child for the whole search, fed one probe at a
time through a control file in the run directory (``search-<endpoint>-<workload>.json``),
which the child's dispatcher reads between stages (``ProbeFeed``) and which can cut the running
probe. Each probe is an ordinary stage of the run (records, metrics, report and gate see
stages); its role in the search (ramp, refine, bisect), its verdict and why it stopped are
written beside them and land in run.json's stage entries (``annotate``, called by finalize).

The plan (``Planner``): ramp geometrically from ``start_rps`` by ``growth`` to the first
failing probe (down from the start when it fails), then bisect the bracket geometrically until
fail / pass - 1 is within ``precision``. A probe straddling the target is run again at the
same rate (``refine`` times; its requests pooled, so the sample grows). When the bracket is
narrow enough,
its lower end is probed again (``confirm``, pooled) unless two probes already judged it: one
short probe can fall between two queue bursts and pass a rate the endpoint does not sustain;
a confirmation that fails refutes the rate and the search goes on below it. A rate still
straddling after its refinements (or its confirmation) sits about where the attainment crosses
the target: its pooled estimate decides, and the pass it gives is marked ``estimate`` (the
report says the capacity was not shown at the confidence asked). Counting every such rate as
failed, as this search first did, biased it low by about the width of one interval.

The verdict is ``reports.capacity.probe_verdict``; while a probe runs it is cut as soon as it is saturated
(``reports.capacity.saturated``), or when its failure can no longer change once half of it ran
(a queue burst in its first seconds is one draw, not a verdict); a failed probe's stragglers
are cancelled too, so that its backlog does not weigh on the next, lower probe; after its
schedule, the search waits for its stragglers only as long as they could change the verdict
(``settle_s`` at most), so long answers do not idle the endpoint.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvbench.core import store
from kvbench.runs import lifeline

POLL_S = 0.5  # how often the search reads the records (the shards flush about every 0.5 s)
# A probe runs at least this many mean response times: the number in flight settles within
# about one or two below capacity, and the steady-state test compares its middle with its end
STEADY_RESIDENCES = 3.0
FEED_WAIT_S = 120.0  # a child with no control file for this long ends (no kvbench run)


def control_path(run_dir: Path | str, endpoint: str, workload: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{endpoint}-{workload}")
    return Path(run_dir) / f"search-{safe}.json"


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the child side

@dataclass(frozen=True)
class Probe:
    index: int
    rate_rps: float | None  # open loop (None: a closed-loop probe)
    duration_s: float
    role: str = "ramp"  # ramp | refine | bisect | confirm
    users: int | None = None  # closed loop: the users the probe runs

    @property
    def level(self) -> float:
        """What the search varies: the offered rate, or the number of users."""
        return self.users if self.users is not None else self.rate_rps

    def text(self) -> str:
        return (f"{self.users} users" if self.users is not None
                else f"{self.rate_rps:g} req/s")


class ProbeFeed:
    """The load process's side: the probes kvbench run asks for, one at a time; a cut of the
    running probe ends its arrivals and cancels its requests in flight."""

    def __init__(self, run_dir: Path | str, endpoint: str, workload: str) -> None:
        self.path = control_path(run_dir, endpoint, workload)

    def probes(self, dispatcher):
        import gevent

        current = {"index": None}
        cut_done: set = set()
        ended: set = set()

        def watch():
            while True:
                data = _read(self.path) or {}
                for i in data.get("end", []):  # its arrivals end, its requests finish
                    if i not in ended and i == current["index"]:
                        ended.add(i)
                        dispatcher.end_stage()
                for i in data.get("cut", []):
                    if i in cut_done:
                        continue
                    cut_done.add(i)
                    if i == current["index"]:
                        dispatcher.end_stage()
                    # its requests in flight (a saturated queue, or a failed probe's backlog
                    # that would weigh on the next one) go; other probes' stay
                    dispatcher.cancel_stage(i)
                if data.get("done"):
                    return
                gevent.sleep(0.1)

        watcher = gevent.spawn(watch)
        k = 0
        waited = 0.0
        try:
            while True:
                data = _read(self.path)
                probes = (data or {}).get("probes", [])
                if len(probes) > k:
                    p = probes[k]
                    k += 1
                    waited = 0.0
                    current["index"] = int(p["index"])
                    users = p.get("users")
                    yield Probe(int(p["index"]),
                                None if p.get("rate_rps") is None else float(p["rate_rps"]),
                                float(p["duration_s"]),
                                users=None if users is None else int(users))
                    continue
                if data is not None and data.get("done"):
                    return
                if data is None and waited > FEED_WAIT_S:
                    raise RuntimeError(f"no capacity search drives this run ({self.path} never "
                                       "appeared); pacing = \"search\" runs under kvbench run")
                gevent.sleep(0.05)
                waited += 0.05
        finally:
            watcher.kill(block=False)


# --------------------------------------------------------------------------- the plan

@dataclass
class Planner:
    """Where to probe next, from the verdicts so far (pure; ``spec``: SearchSpec as a dict)."""

    spec: dict
    history: list = field(default_factory=list)  # (Probe, verdict)
    residence_s: float | None = None  # mean response time at the last passing rate

    @property
    def closed(self) -> bool:
        """A closed-loop search: its levels are numbers of users (integers)."""
        return self.spec.get("loop") == "closed"

    def tries(self, rate: float) -> int:
        return sum(1 for p, _ in self.history if p.level == rate)

    def verdict_at(self, rate: float) -> str | None:
        """The settled verdict at ``rate`` (its last probe's, on all its requests pooled): a
        straddle after its refinements, or on a confirmation, counts as fail."""
        vs = [v for p, v in self.history if p.level == rate]
        if not vs:
            return None
        last = vs[-1]
        if last == "straddle" and (len(vs) > self.spec["refine"] or "pass" in vs[:-1]):
            return "fail"
        return last

    def bracket(self) -> tuple[float | None, float | None]:
        rates = sorted({p.level for p, _ in self.history})
        settled = {r: self.verdict_at(r) for r in rates}
        passes = [r for r, v in settled.items() if v == "pass"]
        lo = max(passes) if passes else None
        fails = [r for r, v in settled.items() if v == "fail" and (lo is None or r > lo)]
        return lo, (min(fails) if fails else None)

    def duration(self, rate: float) -> float:
        """A probe's length: ``probe_s``, longer at low rates to send ``min_requests``, and
        at least ``steady_residences`` (default ``STEADY_RESIDENCES``) mean response times of
        the last passing rate plus the records' lag, so that its second half shows whether the
        number in flight settled (``reports.capacity.not_steady``); at most ``max_probe_s``. A
        refinement is as long again, its requests pooled with the earlier ones at its rate."""
        s = self.spec
        k = s.get("steady_residences", STEADY_RESIDENCES)
        floor = (k * self.residence_s + 1.0) if self.residence_s and k else 0.0
        if self.closed:  # ``rate`` users send about users / response time requests a second
            need = s["min_requests"] * self.residence_s / rate if self.residence_s else 0.0
        else:
            need = s["min_requests"] / rate
        return min(max(s["probe_s"], need, floor), s["max_probe_s"])

    def _probe(self, index: int, level: float, role: str) -> Probe:
        if self.closed:
            return Probe(index, None, self.duration(level), role, users=int(level))
        return Probe(index, level, self.duration(level), role)

    def next(self) -> Probe | None:
        s = self.spec
        index = len(self.history)
        if self.history:
            p, v = self.history[-1]
            tries = sum(1 for q, _ in self.history if q.level == p.level)
            if v == "straddle" and tries <= s["refine"]:
                return self._probe(index, p.level, "refine")
        if self.closed:
            return self._next_users(index)
        lo, hi = self.bracket()
        if not self.history:
            rate, role = s["start_rps"], "ramp"
        elif hi is None:
            rate, role = lo * s["growth"], "ramp"
            if rate > s["max_rps"]:
                return None
        elif lo is None:
            rate, role = hi / s["growth"], "ramp"
            if rate < s["min_rps"]:
                return None
        else:
            if hi / lo - 1 <= s["precision"]:
                if s.get("confirm", True) and self.tries(lo) < 2:
                    return Probe(index, lo, self.duration(lo), "confirm")
                return None
            rate, role = math.sqrt(lo * hi), "bisect"
        rate = float(f"{rate:.4g}")
        return Probe(index, rate, self.duration(rate), role)

    def _next_users(self, index: int) -> Probe | None:
        """The closed loop's plan, in whole users: up from ``start_users`` by ``growth`` (one
        more at least, ``max_users`` at most) to the first failure, down from the start by
        ``growth`` (one fewer at least, one user at least) when it fails, then geometric
        bisection until the bracket is one user wide or within ``precision``; the
        confirmation as in the open loop."""
        s = self.spec
        lo, hi = self.bracket()
        if not self.history:
            return self._probe(index, s["start_users"], "ramp")
        if hi is None:  # up to max_users itself: the most the search may claim
            if lo >= s["max_users"]:
                return None
            n = min(s["max_users"], max(lo + 1, round(lo * s["growth"])))
            return self._probe(index, n, "ramp")
        if lo is None:  # down to one user
            if hi <= 1:
                return None
            return self._probe(index, max(1, min(hi - 1, round(hi / s["growth"]))), "ramp")
        if hi - lo <= 1 or hi / lo - 1 <= s["precision"]:
            if s.get("confirm", True) and self.tries(lo) < 2:
                return self._probe(index, lo, "confirm")
            return None
        n = min(hi - 1, max(lo + 1, round(math.sqrt(lo * hi))))
        return self._probe(index, n, "bisect")

    def record(self, probe: Probe, verdict: str) -> None:
        self.history.append((probe, verdict))


# --------------------------------------------------------------------------- the driver

@dataclass
class Result:
    rc: int
    error: str | None
    log_path: Path
    capacity_rps: float | None
    fail_rps: float | None
    probes: list  # [{index, rate_rps, role, verdict, why, ...}]


def _record_columns() -> list[str]:
    """The record columns a probe's verdict reads."""
    from kvbench.reports.frame import FRAME_COLUMNS

    return sorted(set(FRAME_COLUMNS) | {"chunk_offsets_ns", "request_id", "worker"})


def _frames(job, index: int, slo: dict, tails: dict):
    """(finished records, still-running starts) of probe ``index`` as request frames, from
    ``tails``: ``store.ShardTail`` of the run's "requests" and "starts", kept between calls
    (each call parses only what was written since the last)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvbench.reports.frame import request_frame

    def mine(t):
        m = pc.and_(pc.and_(pc.equal(t.column("endpoint"), job.endpoint.name),
                            pc.equal(t.column("workload"), job.workload)),
                    pc.equal(t.column("stage"), index))
        return t.filter(m)

    recs, starts = mine(tails["requests"].read()), mine(tails["starts"].read())
    done_ids = set(zip(recs.column("worker").to_pylist(), recs.column("request_id").to_pylist()))
    keep = [(w, r) not in done_ids for w, r in zip(starts.column("worker").to_pylist(),
                                                   starts.column("request_id").to_pylist())]
    pend = starts.filter(pa.array(keep, pa.bool_())) if len(keep) else starts
    done = request_frame(recs, slo=slo) if recs.num_rows else None
    pending = None
    if pend.num_rows:
        n = pend.num_rows
        cols_p = {c: pend.column(c) for c in pend.column_names}
        full = {}
        for f in store.TABLES["requests"]:
            full[f.name] = cols_p.get(f.name, pa.nulls(n, f.type))
        full["status"] = pa.array(["cancelled"] * n)
        table = pa.table({k: (v if isinstance(v, (pa.Array, pa.ChunkedArray)) else v)
                          for k, v in full.items()})
        pending = request_frame(table.select(
            [c for c in _record_columns() if c in table.column_names]), slo=slo)
    sent = starts.column("t_sent").to_numpy(zero_copy_only=False).astype(np.int64)
    sched = starts.column("t_scheduled").to_numpy(zero_copy_only=False).astype(np.int64)
    recent = sent >= (sent.max() - 1_000_000_000) if len(sent) else sent.astype(bool)
    lateness = float(np.median(sent[recent] - sched[recent]) / 1e6) if recent.any() else None
    ages = ((time.time_ns() - pend.column("t_sent").to_numpy(zero_copy_only=False)
             .astype(np.int64)) / 1e9) if pend.num_rows else np.empty(0)
    load = {"lateness_ms": lateness, "sent": len(sent),
            "first_ns": int(sched.min()) if len(sched) else None, "pending_ages_s": ages}
    if len(sched):  # sends and finishes, seconds from the first arrival (not_steady)
        base = int(sched.min())
        r_sent = recs.column("t_sent").to_numpy(zero_copy_only=False).astype(np.float64)
        r_e2e = recs.column("e2e_ns").to_numpy(zero_copy_only=False).astype(np.float64)
        # a request that ended without an answer's length (an error) left at its send
        fin = r_sent + np.where(np.isnan(r_e2e), 0.0, r_e2e)
        load.update(sent_s=(sent - base) / 1e9,
                    done_s=np.concatenate([(fin - base) / 1e9, np.full(pend.num_rows, np.nan)]),
                    now_s=(time.time_ns() - base) / 1e9)
    return done, pending, load


def _empty_like(frame):
    return frame.iloc[0:0] if frame is not None else None


class Watch:
    """One probe being judged: ``step`` reads its requests so far and says its verdict once it
    is known (None before). While its schedule runs it is cut when saturated or already failed;
    after it, its verdict waits for the stragglers only as long as they could change it."""

    def __init__(self, frames, slo: dict, probe: Probe, pooled: list[int], spec: dict,
                 t_start: float, e2e_ref_s: float | None) -> None:
        self.frames, self.slo, self.probe, self.spec = frames, slo, probe, spec
        self.t_start = t_start
        self.end = t_start + probe.duration_s
        self.settle_end = self.end + spec["settle_s"]
        self.e2e_ref_s = e2e_ref_s
        self.kw = dict(target=spec["target"], confidence=spec["confidence"],
                       min_class_requests=spec["min_class_requests"], seed=probe.index)
        self.old = [f for i in pooled for f in frames(i)[:1] if f is not None]
        self.cut = False
        self.ended = False  # ended early on a shown pass (its requests in flight finish)
        self.detail = None  # the last ProbeVerdict (the pessimistic one while requests run)
        self.estimate = None  # the worst class's attainment over its finished requests

    def _why(self, v) -> str:
        return _why(v, self.spec["target"], self.spec["confidence"])

    def _unsteady(self, done, load: dict) -> str | None:
        """``reports.capacity.not_steady`` on this probe's sends and finishes (None where the
        backend does not give them)."""
        from kvbench.reports import capacity as C

        if "sent_s" not in load:
            return None
        w = self.e2e_ref_s
        if w is None and done is not None and len(done):
            e2e = done["e2e_ms"].to_numpy(float)
            e2e = e2e[e2e == e2e]
            w = float(e2e.mean()) / 1e3 if len(e2e) else None
        return C.not_steady(load["sent_s"], load["done_s"], load["now_s"],
                            self.probe.duration_s, w)

    def running(self, now: float) -> bool:
        return now < self.end and not self.cut and not self.ended

    def step(self, now: float) -> tuple[str | None, str]:
        import pandas as pd

        from kvbench.reports import capacity as C

        done, pending, load = self.frames(self.probe.index)
        frames = self.old + ([done] if done is not None else [])
        d = pd.concat(frames, ignore_index=True) if frames else None
        n_pend = 0 if pending is None else len(pending)
        if d is None:
            if now > self.settle_end:
                return "fail", "no request of the probe finished"
            return None, ""
        p = pending if pending is not None else d.iloc[0:0]
        decided, v = C.bounded_verdict(d, p, self.slo, **self.kw)
        self.detail = v
        self.estimate = _worst_finished(d)
        if now < self.end:
            elapsed = now - self.t_start
            # (a closed loop cannot outrun its endpoint: its users wait for their answers, so
            # no queue grows beyond them and nothing is offered that was not sent)
            sat = None if self.probe.users is not None else (
                C.saturated(load["pending_ages_s"], elapsed, self.probe.rate_rps,
                            self.e2e_ref_s, load["lateness_ms"])
                or C.short_of_offered(load["sent"], elapsed, self.probe.rate_rps))
            # (whether it is steady is judged at its end, over the whole second half: near
            # capacity a queue's burst over a second or two looked like a growing backlog and
            # cut a probe at 93% of the capacity after 3 s, search_truth seed 101)
            # a failure is cut once half the probe ran: a queue burst in its first second or
            # two is all a shorter sample holds, and one burst is one draw, whatever the
            # number of requests it spans (saturation is cut at once)
            if sat or (decided == "fail" and elapsed >= self.probe.duration_s / 2):
                self.cut = True
                why = f"saturated: {sat}" if sat else self._why(v)
                return "fail", f"cut after {now - self.t_start:.1f} s: {why}"
            # a ramp probe that has shown its pass (not thinly) after half its length ends
            # there: far below the capacity the rest would only spend the budget the bisection
            # needs (its requests in flight finish)
            if (decided == "pass" and self.probe.role == "ramp"
                    and elapsed >= self.probe.duration_s / 2
                    and not any(c.thin for c in v.classes)):
                self.ended = True
                return "pass", f"ended after {elapsed:.1f} s, shown: {self._why(v)}"
            return None, ""
        if decided == "pass":
            # its latencies passed, but a backlog still building would fail them later. Near
            # capacity a queue also wanders for longer than a probe (an M/M/4 at 90% of its
            # capacity looked unsteady in 5% of 10 s probes), so a first sign is refined (the
            # rate probed again, pooled) and only a refinement or confirmation that still
            # shows it fails
            unsteady = self._unsteady(done, load) if self.probe.users is None else None
            if unsteady and (self.probe.role in ("refine", "confirm")
                             or not self.spec["refine"]):
                return "fail", f"not steady again: {unsteady} ({self._why(v)})"
            if unsteady:
                return "straddle", f"not steady: {unsteady} ({self._why(v)})"
        if decided is not None:
            return decided, self._why(v) + (f" ({n_pend} still running: the verdict holds "
                                            "whatever their outcome)" if n_pend else "")
        if now > self.settle_end:  # stragglers still running: they missed their chance
            return v.verdict, (self._why(v) + f" ({n_pend} still running "
                               f"{self.spec['settle_s']:g} s after the probe: counted as "
                               "misses)")
        return None, ""


def _why(v, target: float = 0.95, confidence: float = 0.95) -> str:
    w = v.worst
    if w is None:
        return "no request with an SLO"
    from kvbench.reports.capacity import thin_text

    miss = f", mostly {w.missed}" if w.missed and w.attainment < 1 else ""
    thin = thin_text(v.classes, target, confidence)
    return (f"worst class {w.request_class}: {w.met}/{w.requests} within SLO "
            f"[{w.low:.2f}, {w.high:.2f}]{miss}" + (f"; thin: {thin}" if thin else ""))


def _say(line: str) -> None:
    print(line, flush=True)


class LocustBackend:
    """Where ``drive`` sends its probes in a real search: one Locust child for the whole
    search, fed through the control file; a probe's requests are read back from the run
    directory's record shards and start sidecars. (``bench/search_sim.py`` drives the same
    state machine against the emulator in virtual time.)"""

    def __init__(self, job, processes: int = 1) -> None:
        from kvbench.runs import locust

        self.job, self.slo = job, job.slo
        self.run_dir = job.run_dir
        self.ctl = control_path(self.run_dir, job.endpoint.name, job.workload)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        job_file = job.save(self.run_dir / job.file_name())
        self.cmd, _ = locust.command(job, job_file, processes)
        self.log_path = self.run_dir / f"locust-{job_file.stem.removeprefix('job-')}.log"
        self.child = None
        self._logf = None
        self.tails = {"requests": store.ShardTail(self.run_dir, "requests", _record_columns()),
                      "starts": store.ShardTail(self.run_dir, "starts")}

    def publish(self, state: dict) -> None:
        _write(self.ctl, state)

    def launch(self) -> None:
        env = {**os.environ, **self.job.secret_env(), **lifeline.child_env()}
        self._logf = open(self.log_path, "w")
        from kvbench.runs import locust

        self.child = locust.track(subprocess.Popen(
            self.cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=env,
            start_new_session=True))

    def alive(self) -> bool:
        return self.child.poll() is None

    def started(self, index: int) -> float | None:
        return _wait_started(self.run_dir, self.job, index, self.child)

    def frames(self, index: int):
        return _frames(self.job, index, self.slo, self.tails)

    def e2e_mean_s(self, index: int) -> float | None:
        return _e2e_mean_s(self.run_dir, self.job, index)

    now = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)

    def abort(self) -> None:
        from kvbench.runs import locust

        locust.stop(self.child)

    def close(self) -> tuple[int, str | None]:
        from kvbench.runs import locust

        try:
            rc = self.child.wait(max(60.0, self.job.drain_s + 30.0))
        except subprocess.TimeoutExpired:
            rc = locust.stop(self.child)
        finally:
            locust.untrack(self.child)
            self._logf.close()
            locust._scrub(self.log_path)
        return rc, locust._error(self.log_path, rc, self.job)


def run(job, processes: int = 1, say=_say) -> Result:
    """Search ``job``'s endpoint x workload; every probe is a stage of one Locust child."""
    backend = LocustBackend(job, processes)
    planner, state = drive(backend, job.search, say)
    rc, error = backend.close()
    lo, hi = planner.bracket()
    return Result(rc, error, backend.log_path, lo, hi, state["probes"])


def drive(backend, spec: dict, say=_say) -> tuple[Planner, dict]:
    """The search's state machine over ``backend`` (``LocustBackend``'s methods): the planner
    and the control state (probes with their verdicts, cuts, notes) when it ends.

    Pipelined: when a probe's schedule ends before its verdict is known (answers still
    streaming), the next probe starts at once on the assumption that it passed; if it did not,
    that next probe is cut and marked void (no verdict), and the search goes on from the real
    verdict. One probe at most is speculative."""
    state = {"probes": [], "cut": [], "end": [], "done": False, "notes": []}
    backend.publish(state)
    planner = Planner(spec)
    t0 = backend.now()
    ref = {"e2e": None}
    entries: dict[int, dict] = {}

    def cut(i):
        state["cut"].append(i)
        backend.publish(state)

    def settle(w: Watch, verdict: str, why: str) -> str:
        """Record ``w``'s verdict in the plan and the control file; the settled verdict."""
        few = [c for c in (w.detail.classes if w.detail is not None else [])
               if c.verdict == "straddle"]
        if (verdict == "straddle" and w.probe.role == "ramp" and few
                and all(c.met == c.requests for c in few)):
            # straddling only for want of requests of a rare class, none of which missed: no
            # evidence either way, and a ramp far below capacity should not spend the budget
            # refining it (the capacity is confirmed before it is claimed)
            verdict = "pass"
            why += ("; too few requests of " + ", ".join(c.request_class for c in few)
                    + " to judge, none missed: the ramp goes on")
        planner.record(w.probe, verdict)
        entry = entries[w.probe.index]
        if verdict == "straddle" and planner.verdict_at(w.probe.level) == "fail":
            worst = w.detail.worst if w.detail is not None else None
            est = worst.attainment if worst is not None else math.nan
            tried = ("the confirmation" if w.probe.role == "confirm" else
                     f"{spec['refine']} refinement(s)")
            if not est >= spec["target"]:
                verdict = "fail"
                why += (f"; still straddling after {tried}, its estimate {est:.3f} under "
                        "the target: counted as failed")
                entry["estimate"] = True
            else:
                # as many requests as the search affords and still not conclusive: the rate
                # sits about where the attainment crosses the target; its estimate decides,
                # and the capacity it supports is marked as not shown at the confidence
                verdict = "pass"
                why += (f"; still straddling after {tried}: its "
                        f"estimate {est:.3f} meets the target, not shown at "
                        f"{spec['confidence']:.0%} confidence")
                entry["estimate"] = True
            planner.history[-1] = (w.probe, verdict)
        entry.update(verdict=verdict, why=why)
        if verdict == "fail" and w.probe.index not in state["cut"]:
            # its stragglers (a queue built above capacity) would weigh on the next probe,
            # which runs lower: they go, as misses (the verdict is settled already)
            state["cut"].append(w.probe.index)
        backend.publish(state)
        if verdict == "pass":
            ref["e2e"] = backend.e2e_mean_s(w.probe.index) or ref["e2e"]
            planner.residence_s = ref["e2e"]
        p = w.probe
        say(f"    probe {p.index + 1} ({p.role}) {p.text()}, {p.duration_s:g} s: "
            f"{verdict.upper()}: {why}")
        return verdict

    def start(probe: Probe) -> Watch | None:
        entry = {"index": probe.index, "rate_rps": probe.rate_rps,
                 "duration_s": probe.duration_s, "role": probe.role,
                 "target": spec["target"], "confidence": spec["confidence"]}
        if probe.users is not None:
            entry["users"] = probe.users
        entries[probe.index] = entry
        state["probes"].append(entry)
        backend.publish(state)
        t_start = backend.started(probe.index)
        if t_start is None:
            return None
        pooled = [q.index for q, _ in planner.history if q.level == probe.level]
        return Watch(backend.frames, backend.slo, probe, pooled, spec, t_start, ref["e2e"])

    def warm_up(probe: Probe) -> None:
        """Load at the start rate for ``warmup_s``, unjudged: a cold prefix cache, an empty
        batch and an idle queue are not the state a probe should measure (on the default
        mix the cold contracts' prefills failed chat's TTFT at every rate for the first
        minute, and the search put the offloaded endpoint at 3.9 req/s against its 12)."""
        entry = {"index": probe.index, "rate_rps": probe.rate_rps,
                 "duration_s": probe.duration_s, "role": "warmup", "verdict": None,
                 "why": "warm-up: not judged"}
        if probe.users is not None:
            entry["users"] = probe.users
        entries[probe.index] = entry
        state["probes"].append(entry)
        backend.publish(state)
        t_start = backend.started(probe.index)
        if t_start is None:
            return
        while backend.alive() and backend.now() < t_start + probe.duration_s:
            backend.sleep(POLL_S)
        say(f"    warm-up {probe.text()}, {probe.duration_s:g} s: not judged")

    def plan(after: Watch | None = None) -> Probe | None:
        """The next probe (assuming ``after`` passes, if given), within the budget."""
        if after is not None:
            hyp = Planner(spec, list(planner.history), planner.residence_s)
            hyp.record(after.probe, "pass")
            probe = hyp.next()
        else:
            probe = planner.next()
        if probe is None:
            return None
        probe = replace(probe, index=len(state["probes"]))
        spent = backend.now() - t0
        if spent + probe.duration_s > spec["budget_s"]:
            if not state["notes"]:
                state["notes"].append({"stop": "budget", "after_s": round(spent, 1)})
            return None
        return probe

    backend.launch()
    try:
        if spec.get("warmup_s"):
            warm_up(Probe(0, None, spec["warmup_s"], "warmup", users=spec["start_users"])
                    if planner.closed else
                    Probe(0, spec["start_rps"], spec["warmup_s"], "warmup"))
        probe = plan()
        current = start(probe) if probe else None
        behind: Watch | None = None  # a probe whose stragglers are still being judged
        while current is not None or behind is not None:
            backend.sleep(POLL_S)
            if not backend.alive():
                break
            now = backend.now()
            if behind is not None:
                v, why = behind.step(now)
                if v is not None:
                    behind_index = behind.probe.index
                    v = settle(behind, v, why)
                    behind = None
                    if v != "pass" and current is not None:  # the guess was wrong
                        cut(current.probe.index)
                        entries[current.probe.index].update(
                            verdict=None, role=current.probe.role + " (void)",
                            why=f"started assuming probe {behind_index + 1} passed")
                        backend.publish(state)
                        planner_probe = plan()
                        current = start(planner_probe) if planner_probe else None
                        continue
                    if current is None:  # nothing speculative ran: plan from the verdict
                        nxt = plan()
                        current = start(nxt) if nxt else None
                        continue
            if current is None:
                continue
            was_running = current.running(now)
            v, why = current.step(now)
            if was_running:
                if v is not None:  # cut (saturated or failed already) or ended (passed)
                    if current.ended:
                        state["end"].append(current.probe.index)
                        backend.publish(state)
                    else:
                        cut(current.probe.index)
                    settle(current, v, why)
                    current = None
                else:
                    continue
            elif v is not None:
                settle(current, v, why)
                current = None
            elif behind is None:  # schedule over, verdict pending: speculate if it looks a pass
                behind, current = current, None
                if not _promising(behind, spec["target"]):
                    # its estimate so far misses the target: the guess would likely be void,
                    # and a void probe (a ramp 1.7x higher) leaves a backlog that fails the
                    # lower probe after it (sim seed 106: 28.27 req/s failed at a capacity of
                    # 31.2 after a void 62.7 req/s probe); wait for the verdict instead
                    continue
            else:
                continue
            if current is None and behind is None:
                nxt = plan()
                current = start(nxt) if nxt else None
            elif current is None and behind is not None:
                nxt = plan(after=behind)
                current = start(nxt) if nxt else None
    except BaseException:
        backend.abort()
        raise
    finally:
        state["done"] = True
        backend.publish(state)
    return planner, state


def _worst_finished(d) -> float | None:
    """The lowest attainment of a class with an SLO over its finished requests (``d``: request
    frame rows), None when none finished."""
    judged = d[d["has_slo"].to_numpy(bool)]
    if not len(judged):
        return None
    met = judged["slo_met"].to_numpy(bool) & judged["ok"].to_numpy(bool)
    return float(judged.assign(_met=met).groupby("request_class", observed=True)["_met"]
                 .mean().min())


def _promising(w: Watch, target: float) -> bool:
    """Whether ``w``'s finished requests point to a pass (its worst class's attainment over
    them meets the target): only then does the next probe start before its verdict is known.
    (Its requests still running are no evidence either way: counting them as misses, as the
    pessimistic verdict does, held every probe with long answers back, and the endpoint
    idled 16 s of a 55 s budget waiting for them.)"""
    return w.estimate is not None and w.estimate >= target


def _wait_started(run_dir: Path, job, index: int, child, wait_s: float = 120.0):
    """The monotonic time probe ``index`` began (its stage opened in a sidecar)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            return None
        for m in store.read_proc_meta(run_dir):
            st = m.get("open_stage") or {}
            done = [s.get("index") for s in m.get("stages", [])
                    if s.get("endpoint") == job.endpoint.name]
            if (st.get("index") == index and st.get("endpoint") == job.endpoint.name) \
                    or index in done:
                ago = (time.time_ns() - int(st.get("t_start_ns") or time.time_ns())) / 1e9
                return time.monotonic() - max(0.0, ago)
        time.sleep(0.05)
    return None


def _e2e_mean_s(run_dir: Path, job, index: int) -> float | None:
    import pyarrow.compute as pc

    t = store.read_table(run_dir, "requests", ["endpoint", "workload", "stage", "status",
                                               "e2e_ns"], parquet=False)
    m = pc.and_(pc.and_(pc.equal(t.column("endpoint"), job.endpoint.name),
                        pc.equal(t.column("workload"), job.workload)),
                pc.and_(pc.equal(t.column("stage"), index), pc.equal(t.column("status"), "ok")))
    v = pc.mean(t.filter(m).column("e2e_ns")).as_py()
    return v / 1e9 if v else None


# --------------------------------------------------------------------------- run.json

def annotate(run_dir: Path | str, stages: list[dict]) -> list[dict]:
    """run.json stages with each probe's ``search`` note ({role, verdict, why[, stop]}) from
    the control files of the run's searches."""
    notes = {}
    for path in Path(run_dir).glob("search-*.json"):
        data = _read(path) or {}
        stop = next((n.get("stop") for n in data.get("notes", [])), None)
        probes = data.get("probes", [])
        for k, p in enumerate(probes):
            note = {"role": p.get("role"), "verdict": p.get("verdict"), "why": p.get("why")}
            if p.get("estimate"):
                note["estimate"] = True
            for key in ("target", "confidence"):  # what the report judges it against
                if p.get(key) is not None:
                    note[key] = p[key]
            if stop and k == len(probes) - 1:
                note["stop"] = stop
            notes[(path.name, p.get("index"))] = note
    if not notes:
        return stages
    out = []
    for st in stages:
        key = (control_path("", st.get("endpoint", ""), st.get("workload", "")).name,
               st.get("index"))
        out.append({**st, "search": notes[key]} if key in notes else st)
    return out
