"""Arrival pacing. Open loop: one dispatcher per process starts requests at scheduled times
regardless of responses. Closed loop: Locust users, one session each (see user.py).
(Over 400 lines: the open-loop dispatcher and the closed-loop stages share the stage plan, the
cancel and the drain, and are read best side by side.)

Poisson means exponential gaps drawn one by one and never rescaled to fit a duration (a
rescaled sequence is no longer a Poisson process). Gamma gaps have mean ``1/rate`` and the given
coefficient of variation (cv > 1: burstier than Poisson). A stage boundary restarts the draw at
the new rate (memoryless for Poisson).
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import numpy as np

from kvbench.core.contract import StagePlan  # the plan of one stage, as the job holds it

PACINGS = ("closed", "poisson", "gamma", "constant", "trace")
LAG_KEPT = 4096  # the start lateness of the last this many arrivals (a soak sends millions;
# every request's lateness is in its record: t_sent - t_scheduled)


def share_of(n: int | None, index: int, count: int) -> int | None:
    """Process ``index``'s part of ``n`` requests split over ``count`` processes (the parts
    add up to ``n``)."""
    if n is None:
        return None
    return n // count + (1 if index < n % count else 0)


def gaps_s(pacing: str, rate_rps: float, rng: np.random.Generator, cv: float = 2.0,
           block: int = 1024) -> Iterator[float]:
    """Endless inter-arrival gaps in seconds for one process sending at ``rate_rps``."""
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    mean = 1.0 / rate_rps
    if pacing == "constant":
        yield from itertools.repeat(mean)
    elif pacing == "poisson":
        while True:
            yield from rng.exponential(mean, block).tolist()
    elif pacing == "gamma":
        shape = 1.0 / (cv * cv)  # cv of a gamma distribution is 1/sqrt(shape)
        while True:
            yield from rng.gamma(shape, mean / shape, block).tolist()
    else:
        raise ValueError(f"pacing {pacing!r} has no rate-driven gaps")


def shard(items: Iterable, index: int, count: int) -> Iterator:
    """Every ``count``-th item starting at ``index`` (one worker's share of a workload)."""
    return itertools.islice(items, index, None, count) if count > 1 else iter(items)


def shard_sessions(requests: Iterable, index: int, count: int) -> Iterator:
    """One worker's share of a request stream with every session whole on one worker (its
    turns keep their order and the trace's timing): the k-th distinct ``session_id`` met goes
    to worker ``k % count``, which every worker works out alike from the same stream; a request
    without a session is a session of its own."""
    if count <= 1:
        yield from requests
        return
    owner: dict = {}
    k = 0
    for req in requests:
        sid = getattr(req, "session_id", None)
        if sid is None:
            mine = k % count == index
            k += 1
        else:
            w = owner.get(sid)
            if w is None:
                w = owner[sid] = k % count
                k += 1
            mine = w == index
        if mine:
            yield req


def cycle_requests(make: Callable[[], Iterable], index: int = 0, count: int = 1) -> Iterator:
    """The workload's requests (this worker's share), again and again; later passes get
    ``#pass`` appended to request and session ids so records stay distinct."""
    for n in itertools.count():
        empty = True
        for req in shard_sessions(make(), index, count):
            empty = False
            if n:
                req = replace(req, request_id=f"{req.request_id}#{n}",
                              session_id=f"{req.session_id}#{n}")
            yield req
        if empty:
            return


class _Draining:
    """The end of a run, for both dispatchers: requests in flight (``in_flight``, in the gevent
    ``group``) finish or are cancelled."""

    in_flight: int
    group = None

    def cancel(self, timeout_s: float = 5.0) -> None:
        """Stop the requests in flight (each still records itself, as cancelled)."""
        if self.group is not None:
            self.group.kill(block=True, timeout=timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait for in-flight requests to end (at most ``timeout_s``)."""
        import gevent

        end = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < end:
            gevent.sleep(0.01)
        return self.in_flight == 0


class OpenLoopDispatcher(_Draining):
    """Starts ``send(request, t_scheduled_epoch_ns, stage_index)`` greenlets on schedule.

    ``share`` is this process's fraction of the configured rate (1/processes). Arrivals that
    find ``max_in_flight`` requests running are dropped and counted in ``dropped_at_cap``.
    A stage's ``requests`` (this process's share) ends it once that many were sent;
    ``max_requests`` ends the whole run so (``limit_reached`` then says which).
    ``on_stage_start(stage, t_start)`` and ``on_stage(stage, t_start, t_end)`` (epoch ns) mark
    each stage; ``stop`` ends the arrivals at once (the stage so far is reported, cut).
    """

    def __init__(self, send: Callable, requests: Iterator, stages: list[StagePlan], *,
                 pacing: str = "poisson", cv: float = 2.0, max_in_flight: int = 512,
                 seed: int = 0, share: float = 1.0, max_requests: int | None = None,
                 on_stage: Callable[[StagePlan, int, int], None] | None = None,
                 on_stage_start: Callable[[StagePlan, int], None] | None = None) -> None:
        self.send = send
        self.requests = requests
        self.stages = stages
        self.pacing = pacing
        self.cv = cv
        self.max_in_flight = max_in_flight
        self.rng = np.random.default_rng(seed)
        self.share = share
        self.on_stage = on_stage
        self.on_stage_start = on_stage_start
        self.stopped = None  # gevent Event, set by ``stop``
        self.in_flight = 0
        self.dropped_at_cap = 0
        self.started = 0
        # start lateness of the last LAG_KEPT launched arrivals (bounded: a list of every
        # arrival's grew by ~36 bytes a request for as long as the run went on; issue 34)
        self.lag_ns: collections.deque = collections.deque(maxlen=LAG_KEPT)
        self.exhausted = False
        self.max_requests = max_requests
        self.limit_reached: str | None = None  # "stage" or "run": a request count ended it
        self.group = None  # gevent Group of the requests in flight
        self.stage_cut = False  # ``end_stage`` cut the stage that ended last
        self._cut = None  # gevent Event set by ``end_stage``, cleared as each stage starts

    def end_stage(self) -> None:
        """End the current stage now (its arrivals stop; the next stage, if any, begins)."""
        if self._cut is not None:
            self._cut.set()

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds``; True when the run stopped or the stage was cut meanwhile."""
        import gevent

        gevent.wait([self.stopped, self._cut], timeout=seconds, count=1)
        return self.stopped.is_set() or self._cut.is_set()

    def _until(self, t_ns: int, mono) -> bool:
        """Sleep until ``t_ns`` (perf_counter ns); True when the run stopped or the stage was
        cut meanwhile. The loop's timers count from its cached time, which can be a little
        behind the clock, so a wake-up can come microseconds early: sleep the rest again (a
        request is never sent before its schedule)."""
        while True:
            delay = (t_ns - mono()) / 1e9
            if delay <= 0:
                return False
            if self._wait(delay):
                return True

    def cancel_stage(self, stage: int) -> None:
        """Cancel the requests in flight that were sent in ``stage`` (each records itself as
        cancelled); other stages' go on."""
        import gevent

        mine = [g for g in list(self.group or ())
                if len(getattr(g, "args", ())) > 2 and g.args[2] == stage]
        gevent.killall(mine, block=False)

    def stop(self) -> None:
        """Start nothing more (requests in flight go on; see ``wait_idle`` and ``cancel``)."""
        self._event().set()

    def _event(self):
        if self.stopped is None:
            import gevent.event

            self.stopped = gevent.event.Event()
        return self.stopped

    def run(self) -> None:
        import gevent.event
        from gevent.pool import Group

        self.group = group = Group()
        stopped = self._event()
        self._cut = cut = gevent.event.Event()

        mono, epoch = time.perf_counter_ns, time.time_ns
        offset = epoch() - mono()  # epoch = mono + offset, fixed for the run
        t = mono()
        for st in self.stages:
            if stopped.is_set():
                break
            t_start = max(t, mono())  # a stage fed lazily (capacity search) starts when it comes
            t_end = t_start + int(st.duration_s * 1e9)
            cut.clear()
            if self.on_stage_start is not None:
                self.on_stage_start(st, t_start + offset)
            if self.pacing == "trace":
                arrivals = self._trace_times(t_start, t_end)
            else:
                rate = (st.rate_rps or 0) * self.share
                arrivals = (self._counted_times(rate, t_start, t_end) if st.exact_count
                            else self._rate_times(rate, t_start, t_end))
            in_stage = 0
            for t_sched, req in arrivals:
                if self._counted(st, in_stage):  # a share of 0 (more processes than requests)
                    break
                if self._until(t_sched, mono):
                    break
                if stopped.is_set() or cut.is_set():
                    break
                if self.in_flight >= self.max_in_flight:
                    self.dropped_at_cap += 1
                    continue
                if req is None:
                    req = next(self.requests, None)
                    if req is None:
                        self.exhausted = True
                        break
                self.lag_ns.append(mono() - t_sched)
                self.in_flight += 1
                self.started += 1
                in_stage += 1
                group.spawn(self._one, req, t_sched + offset, st.index)
                if self._counted(st, in_stage):  # the stage (or run) ends with this send
                    break
            now = mono()
            counted = self.limit_reached is not None
            if now < t_end and not self.exhausted and not counted:
                self._wait((t_end - now) / 1e9)
            t = mono() if counted or self.pacing == "trace" else max(t_end, mono())
            self.stage_cut = cut.is_set()
            if stopped.is_set() or self.stage_cut:
                t = mono()  # cut: the stage ran until now
            if self.on_stage is not None:
                self.on_stage(st, t_start + offset, t + offset)
            if self.exhausted or self.limit_reached == "run":
                break
            self.limit_reached = None if self.limit_reached == "stage" else self.limit_reached

    def _counted(self, st: StagePlan, in_stage: int) -> bool:
        if self.max_requests is not None and self.started >= self.max_requests:
            self.limit_reached = "run"
        elif st.requests is not None and in_stage >= st.requests:
            self.limit_reached = "stage"
        return self.limit_reached is not None

    def _rate_times(self, rate: float, t_start: int, t_end: int) -> Iterator[int]:
        if rate <= 0:
            return
        t = float(t_start)
        for gap in gaps_s(self.pacing, rate, self.rng, self.cv):
            t += gap * 1e9
            if t >= t_end:
                return
            yield int(t), None

    def _counted_times(self, rate: float, t_start: int, t_end: int) -> Iterator[tuple]:
        """``round(rate x duration)`` arrivals at sorted uniform times in the stage."""
        n = int(round(rate * (t_end - t_start) / 1e9))
        if n <= 0:
            return
        for t in np.sort(self.rng.uniform(t_start, t_end, n)):
            yield int(t), None

    def _trace_times(self, t_start: int, t_end: int) -> Iterator[tuple]:
        """Trace arrivals: the requests' own ``arrival_offset_s`` from the stage start."""
        for req in self.requests:
            t = t_start + int((req.arrival_offset_s or 0.0) * 1e9)
            if t >= t_end:
                return
            yield t, req
        self.exhausted = True

    def _one(self, req, t_sched_epoch: int, stage: int) -> None:
        try:
            self.send(req, t_sched_epoch, stage)
        finally:
            self.in_flight -= 1


class ClosedLoopStages(_Draining):
    """Closed loop whose user count changes stage by stage (the closed-loop capacity search's
    probes, fed lazily): each user is a greenlet running ``run_user(user)``, one session at a
    time, each request waiting for the answer before the next. A stage of more users starts
    the missing ones at its start; one of fewer retires the extra ones once their request in
    flight ends (it is recorded in the stage it was sent in). Between two stages no user sends
    (``active`` is clear): a stage's requests are those sent within its window, as an open
    loop's arrivals are. Same controls as ``OpenLoopDispatcher``: ``end_stage``, ``stop``,
    ``cancel``, ``wait_idle``, ``cancel_stage``; ``on_stage_start`` / ``on_stage`` mark each
    stage (epoch ns). Process ``index`` of ``count`` runs its part of each stage's users
    (``share_of``)."""

    def __init__(self, run_user: Callable, stages: Iterable[StagePlan], *, index: int = 0,
                 count: int = 1,
                 on_stage: Callable[[StagePlan, int, int], None] | None = None,
                 on_stage_start: Callable[[StagePlan, int], None] | None = None) -> None:
        self.run_user = run_user
        self.stages = stages
        self.index, self.count = index, count
        self.on_stage, self.on_stage_start = on_stage, on_stage_start
        self.stage: int | None = None  # the stage users send in now (None: between stages)
        self.want = 0  # this process's users in the running stage
        # every user still alive: the running stage's, and retired ones whose last request is
        # still in flight (a cut of its stage must reach it too)
        self.users: list[ClosedUser] = []
        self.in_flight = 0  # requests sent and not yet ended (run_user keeps it)
        self.dropped_at_cap = 0  # (a closed loop never drops: the interface of the open one)
        self.stage_cut = False
        self.stopped = None
        self.active = None
        self._cut = None
        self.group = None

    def _events(self):
        import gevent.event

        if self.stopped is None:
            self.stopped = gevent.event.Event()
            self.active = gevent.event.Event()
            self._cut = gevent.event.Event()

    def end_stage(self) -> None:
        if self._cut is not None:
            self._cut.set()

    def stop(self) -> None:
        self._events()
        self.stopped.set()
        self.active.set()  # users waiting for a stage wake up and see the stop

    def cancel_stage(self, stage: int) -> None:
        """Cancel the requests in flight that were sent in ``stage`` (each records itself as
        cancelled); their users go, and the next stage starts new ones as it needs."""
        import gevent

        mine = [u for u in self.users if u.sending == stage and u.greenlet is not None]
        for u in mine:  # gone now: counted out at once (a kill lands later)
            u.retired = True
        gevent.killall([u.greenlet for u in mine], block=False)
        if self.stage is not None:  # a later stage runs already: its users are made up now
            self._staff()

    def _staff(self) -> None:
        """Bring the users to the running stage's ``want``: the retired and the ended are
        counted out, extra ones retire, missing ones start."""
        self.users = [u for u in self.users if not u.greenlet.dead]
        working = [u for u in self.users if not u.retired]
        for u in working[self.want:]:
            u.retired = True
        for _ in range(self.want - len(working)):
            u = ClosedUser()
            u.greenlet = self.group.spawn(self.run_user, u)
            self.users.append(u)

    def run(self) -> None:
        import gevent
        from gevent.pool import Group

        self._events()
        self.group = Group()
        mono, epoch = time.perf_counter_ns, time.time_ns
        offset = epoch() - mono()
        for st in self.stages:
            if self.stopped.is_set():
                break
            self._cut.clear()
            t_start = mono()
            if self.on_stage_start is not None:
                self.on_stage_start(st, t_start + offset)
            self.want = share_of(st.users or 0, self.index, self.count) or 0
            self._staff()
            self.stage = st.index
            self.active.set()
            end = time.monotonic() + st.duration_s
            # (every half second the users are made up again: one whose session ran out
            # ended, and the stage keeps its number of users)
            while (left := end - time.monotonic()) > 0 and not (
                    self._cut.is_set() or self.stopped.is_set()):
                gevent.wait([self.stopped, self._cut], timeout=min(left, 0.5), count=1)
                self._staff()
            self.active.clear()  # no user sends until the next stage
            self.stage = None
            self.stage_cut = self._cut.is_set() or self.stopped.is_set()
            if self.on_stage is not None:
                self.on_stage(st, t_start + offset, mono() + offset)
        for u in self.users:
            u.retired = True
        self.active.set()  # waiting users see they are retired and end

    def next_turn(self, u: "ClosedUser") -> int | None:
        """A user's next request may go: wait while no stage runs; the stage it is sent in
        (counted in flight until ``turn_done``), or None when the user is retired or the run
        stopped (the user ends)."""
        while self.stage is None and not (u.retired or self.stopped.is_set()):
            self.active.wait()
        if u.retired or self.stopped.is_set():
            return None
        u.sending = self.stage
        u.turns += 1
        self.in_flight += 1
        return u.sending

    def turn_done(self, u: "ClosedUser") -> None:
        self.in_flight -= 1
        u.turns -= 1
        if u.turns <= 0:  # (a user's sub-agents send several at once)
            u.sending = None


class ClosedUser:
    """One user of ``ClosedLoopStages``: its greenlet, whether it is retired, and the stage of
    the request it has in flight (None: none)."""

    __slots__ = ("greenlet", "retired", "sending", "turns")

    def __init__(self) -> None:
        self.greenlet = None
        self.retired = False
        self.sending: int | None = None
        self.turns = 0  # requests in flight
