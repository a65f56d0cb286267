"""The load context: what one Locust process shares (target, record sink, workload, pacing),
built from a resolved ``Job`` and kept on Locust's environment as ``environment.kvbench``, so
users, hooks and the dispatcher work on any ``Environment``, in process or not.
(Over 400 lines, kept whole: one object whose sending, recording, stages and close share the
sink, the stage in progress and the stop.)"""

from __future__ import annotations

import gc
import itertools
import logging
import sys
import time
from dataclasses import replace
from urllib.parse import urlsplit

import gevent
import gevent.event
import gevent.lock
from locust.runners import MasterRunner, WorkerRunner

from kvbench.core import redact
from kvbench.core.contract import Incomplete, StageEntry
from kvbench.core.errors import UserError
from kvbench.core.rows import START_COLUMNS, worker_name
from kvbench.loadgen.liveview import live
from kvbench.loadgen.timing.client import ConnectionPool, Result, StreamingClient, Target
from kvbench.loadgen.timing.looplag import LoopLag
from kvbench.loadgen.wiring.prefetch import Prefetch
from kvbench.loadgen.timing.openai import request_body, request_path
from kvbench.loadgen.plan.options import STOP_AFTER_FAILURES, job_from_options
from kvbench.loadgen.wiring import unservable
from kvbench.loadgen.plan.pacing import (ClosedLoopStages, ClosedUser, OpenLoopDispatcher,
                                    StagePlan, cycle_requests, shard, shard_sessions, share_of)
from kvbench.loadgen.plan.sessions import SessionDriver
from kvbench.loadgen.timing.sink import COLUMNS, RecordSink
from kvbench.loadgen.timing.tokcheck import for_environment as token_check
from kvbench.runs.job import FOREVER_S, Job
from kvbench.workloads.base import Spawn
from kvbench.workloads.tokenizer import get_tokenizer

log = logging.getLogger("kvbench.loadgen")

_ROW = ("run_id", "endpoint", "topology", "workload", "request_class", "stage", "request_id",
        "session_id", "turn", "worker", "prompt_tokens", "prompt_tokens_client",
        "shared_prefix_tokens", "max_tokens", "completion_tokens", "completion_tokens_client",
        "cached_tokens", "t_scheduled", "t_sent", "connect_ns", "ttft_ns", "chunk_offsets_ns",
        "chunk_tokens", "e2e_ns", "status", "http_status", "error", "server_queue_ns",
        "server_prefill_ns", "server_kv_transfer_ns", "server_first_decode_ns",
        "server_replica", "server_region", "retry_after_s", "server_request_id", "streamed",
        "parent_session_id", "subagent_index")
assert _ROW == COLUMNS, "loadgen row order must follow kvbench.schema.REQUESTS"
_START = ("run_id", "endpoint", "topology", "workload", "request_class", "stage", "request_id",
          "session_id", "turn", "worker", "prompt_tokens_client", "shared_prefix_tokens",
          "max_tokens", "t_scheduled", "t_sent")
assert _START == START_COLUMNS, "loadgen start order must follow kvbench.core.rows.START_COLUMNS"
CANCELLED_AT_STOP = "cancelled at the stop"  # the error text of a request a stop cut


class LoadContext:
    """Everything one load process shares: target, records, workload, pacing."""

    def __init__(self, environment, job: Job, workload=None) -> None:
        self.environment = environment
        self.job = job
        self.worker = worker_name()
        ep = job.endpoint
        self.url = ep.url.rstrip("/")
        self.target = Target.parse(self.url)
        self.endpoint = ep.name or urlsplit(self.url).netloc
        self.topology = ep.topology
        self.model = ep.model
        self.headers = job.headers()
        self.tokenizer = get_tokenizer(job.tokenizer)  # sizes multi-token chunks too
        self.tokcheck = token_check(environment, self.tokenizer.name)  # plain locust runs
        self.workload = workload if workload is not None else job.build_workload(self.tokenizer)
        self.workload_name = getattr(self.workload, "name", job.workload)
        # a capacity search's probes: Poisson arrivals, or closed-loop users (search.loop)
        self.search_loop = (job.search.loop if job.search is not None else "open") \
            if job.pacing == "search" else None
        self.pacing = {None: job.pacing, "open": "poisson"}.get(self.search_loop,
                                                               "search-closed")
        # what the stages say they were: a closed-loop probe is a closed-loop stage
        self.stage_pacing = "closed" if self.search_loop == "closed" else self.pacing
        self.stages = list(job.stages)
        self.stage_index = job.stage_index
        self.cv = job.gamma_cv
        self.max_in_flight = job.max_in_flight
        self.timeout_s = job.timeout_s
        self.warm = job.warm_connections
        self.ignore_eos = job.ignore_eos
        self.session_header = job.session_header  # "" : none sent
        self.session_user = job.session_user  # the body's user field too
        self.run_id = job.run_id
        self.run_dir = job.run_dir
        self.sink = RecordSink(self.run_dir)
        self.sink.start()
        self.looplag = LoopLag().start()  # the largest event-loop pause per stage, in run.json
        # The record sink converts and writes batches on a native thread; with Python's default
        # 5 ms switch interval that thread held the GIL for up to 5 ms at a time while the
        # loop waited to read chunks. 0.5 ms bounds each wait (handoffs cost ~us).
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self.live = live.attach(self)  # the web UI's kvbench tab, kvbench run's progress
        self.stopping = gevent.event.Event()  # set when the stage ends: start nothing new
        self.dispatched = gevent.event.Event()  # open loop: the dispatcher is done
        self.interrupted: str | None = None  # set by the quitting hook: which signal
        self.stopped_ns: int | None = None  # when the stage's end (or a stop) came
        if not job_file_given(environment):  # a plain locust run: its job file for recovery
            path = self.run_dir / job.file_name()
            if not path.exists():
                job.save(path)
        runner = environment.runner
        o = environment.parsed_options
        workers = getattr(o, "kvbench_workers", 0) or 1
        self.index = runner.worker_index if isinstance(runner, WorkerRunner) else 0
        self.count = max(1, workers) if isinstance(runner, WorkerRunner) else 1
        self.index = max(0, self.index) % self.count
        # this process's share of the stages' and the run's request counts (None: no limit)
        self.stages = [replace(s, requests=share_of(s.requests, self.index, self.count))
                       for s in self.stages]
        self.max_requests = share_of(job.max_requests, self.index, self.count)
        # failures load cannot cause, in a row: past the limit the run stops (unservable)
        self.failures = unservable.FailureRun(getattr(o, "kvbench_stop_after_failures",
                                                      STOP_AFTER_FAILURES))
        self._sessions = None  # built ahead in idle time: see next_session
        self._warm_pool: ConnectionPool | None = None  # closed loop: see prewarm
        self.dispatcher: OpenLoopDispatcher | None = None
        self.t_start_ns = time.time_ns()
        if self.pacing == "closed":
            i = self.stage_index
            planned = self.stages[i] if i < len(self.stages) else StagePlan(i, 0.0)
            users = planned.users or getattr(environment.parsed_options, "num_users", None)
            limits = [n for n in (planned.requests, self.max_requests) if n is not None]
            self._left = min(limits) if limits else None  # closed loop: requests still to send
        if self.pacing == "closed":  # every user takes its first session at once: build now
            self._sessions = self._built_ahead(prefill=True)
        settle_heap()
        if self.pacing == "closed":
            self.open_stage(StagePlan(i, planned.duration_s, None, users), self.t_start_ns)

    @property
    def drain_s(self) -> float:
        """How long requests in flight may finish after the stage's end: Locust's
        --stop-timeout when given (kvbench run gives the profile's drain_s), else the job's."""
        given = getattr(self.environment, "stop_timeout", None)
        return min(self.timeout_s, given if given else self.job.drain_s)

    def _session_iter(self):
        """This worker's share of the sessions, cycled; later passes get ``#pass`` ids."""
        for n in itertools.count():
            empty = True
            for s in shard(self.workload.sessions(), self.index, self.count):
                empty = False
                yield s if n == 0 else _Renamed(s, n)
            if empty:
                return

    def claim(self) -> bool:
        """Closed loop: may a user send one more request? False once this process's share
        of the stage's ``requests`` or of ``--kvbench-requests`` was sent; the last claim ends
        the stage (nothing new starts, what is in flight finishes) and with it the run."""
        left = getattr(self, "_left", None)
        if left is None:
            return True
        if left <= 0:
            return False
        self._left = left - 1
        if self._left == 0:
            self.stop_starting()
            quit_soon(self.environment)
        return True

    def next_session(self):
        if self._sessions is None:
            self._sessions = self._built_ahead(prefill=False)
        return next(self._sessions, None)

    def _users(self) -> int:
        """Closed loop: the most users a stage of this process runs (a closed-loop search:
        its ``max_users``, at most 64 sessions built ahead)."""
        if self.search_loop == "closed":
            return min(64, int(self.job.search.max_users or 64))
        return max((s.users or 0) for s in self.stages) or getattr(
            getattr(self.environment, "parsed_options", None), "num_users", None) or 1

    def _built_ahead(self, prefill: bool) -> Prefetch:
        """Closed loop: sessions built ahead in idle time, one per user (up to 256)."""
        return Prefetch(self._session_iter(), min(256, self._users()), prefill=prefill)

    def prewarm(self) -> int:
        """Closed loop: open one keep-alive connection per user (up to 1,024) before the
        stage's loop-lag clock starts, all at once; ``adopt_warm`` hands them to the users.
        Locust starts every user together, and each opening its own connection beside the
        others' first requests was a 10-15 ms pause of the loop at the stage's start (256
        users, kernel time on loopback; issue 13). Returns how many opened."""
        if self.pacing != "closed" or not self.warm or self._warm_pool is not None:
            return 0
        self._warm_pool = ConnectionPool(self.target, read_timeout_s=self.timeout_s)
        return self._warm_pool.warm(min(1024, self._users()))

    def adopt_warm(self, pool: ConnectionPool) -> bool:
        """Move one pre-opened connection into a user's ``pool``; False when none is left
        (the user then opens its own)."""
        spare = self._warm_pool.idle if self._warm_pool is not None else None
        if not spare:
            return False
        pool.idle.append(spare.pop())
        return True

    def new_client(self, pool: ConnectionPool | None = None) -> StreamingClient:
        pool = pool or ConnectionPool(self.target, read_timeout_s=self.timeout_s,
                                      cold=not self.warm)
        return StreamingClient(pool, headers=self.headers, deadline_s=self.timeout_s,
                               tokenizer=self.tokenizer)

    # -- the request
    def send(self, client: StreamingClient, req, t_scheduled_ns: int | None, stage: int,
             keep_text: bool = False) -> Result:
        """Send ``req``, record it whatever happens (cancelled included), report to Locust."""
        sid = req.session_id
        body = request_body(req, self.model, ignore_eos=self.ignore_eos,
                            user=sid if self.session_user and sid else None)
        res = Result()
        now = time.time_ns()
        self.sink.begin((
            self.run_id, self.endpoint, self.topology, self.workload_name, req.request_class,
            stage, req.request_id, req.session_id, req.turn, self.worker, req.prompt_tokens,
            req.shared_prefix_tokens, req.max_tokens,
            t_scheduled_ns if t_scheduled_ns is not None else now, now))
        try:
            client.post_stream(request_path(req), body, keep_text=keep_text, res=res,
                               request_id=req.request_id, max_tokens=req.max_tokens,
                               stream=req.stream, headers=self.session_headers(sid))
        finally:
            if res.t_sent_ns == 0:
                res.t_sent_ns = time.time_ns()
            if res.status == "cancelled":  # a stop cut it: the end of a stage, or a signal
                res.error = CANCELLED_AT_STOP
            self.record(req, res, t_scheduled_ns, stage)
        if self.failures.observe(res):  # the records stay; nothing new starts
            self.stop_starting()
            fail(self.environment, UserError(unservable.sentence(
                self, res, request_path(req), self.failures.count)))
        # Back to the loop before the rest (Locust's events, the caller's next request): answers
        # that end together (a closed loop's users start together, so their answers stay in
        # step) otherwise ran all their bookkeeping in one pass of the loop, every other
        # stream's chunks waiting behind it (the largest loop pauses of a 256-stream run, 10-16
        # ms at the first answers and at the stop; about 5 ms after). gevent runs what was put
        # off in slices of the switch interval, reading sockets between them.
        gevent.sleep(0)
        self.report(req, res)
        if self.tokcheck is not None and res.status == "ok":
            err = self.tokcheck.observe(req.prompt_tokens, res.prompt_tokens)
            if err is not None:
                fail(self.environment, err)
        return res

    def session_headers(self, session_id: str) -> dict | None:
        """The session id header every request of a session carries (routers pin on it);
        none when the header is switched off or the id cannot be a header value."""
        if self.session_header and session_id and session_id.isascii() \
                and session_id.isprintable():
            return {self.session_header: session_id}
        return None

    def record(self, req, res: Result, t_scheduled_ns: int | None, stage: int) -> None:
        self.sink.append((
            self.run_id, self.endpoint, self.topology, self.workload_name, req.request_class,
            stage, req.request_id, req.session_id, req.turn, self.worker,
            res.prompt_tokens, req.prompt_tokens, req.shared_prefix_tokens, req.max_tokens,
            res.completion_tokens, res.completion_tokens_client, res.cached_tokens,
            t_scheduled_ns if t_scheduled_ns is not None else res.t_sent_ns, res.t_sent_ns,
            res.connect_ns, res.ttft_ns, res.offsets_ns, res.tokens, res.e2e_ns, res.status,
            res.http_status, redact.redact(res.error), res.server_queue_ns, res.server_prefill_ns,
            res.server_kv_transfer_ns, res.server_first_decode_ns, res.server_replica,
            res.server_region, res.retry_after_s, res.server_request_id, res.streamed,
            req.parent_session_id, req.subagent_index))

    def report(self, req, res: Result) -> None:
        """Locust's live stats: ONE request event per LLM request (``e2e <class>``, its
        response time the E2E), so Locust's totals, RPS and failures count requests; TTFT and
        TPOT go to their own rows of Locust's table (``ttft <class>``, ``tpot <class>``)
        without an event, outside Locust's "Aggregated" total (and in the event's context)."""
        cls = req.request_class
        n = res.completion_tokens or 0
        ttft_ms = res.ttft_ns / 1e6 if res.ttft_ns is not None else None
        tpot_ms = ((res.e2e_ns - res.ttft_ns) / (n - 1) / 1e6
                   if res.status == "ok" and n > 1 and res.ttft_ns is not None else None)
        exc = None if res.status == "ok" else RuntimeError(
            redact.redact(f"{res.status}: {res.error}"))
        self.environment.events.request.fire(
            request_type="LLM", name=f"e2e {cls}", response_time=(res.e2e_ns or 0) / 1e6,
            response_length=n, exception=exc, context={"ttft_ms": ttft_ms, "tpot_ms": tpot_ms})
        stats = getattr(self.environment, "stats", None)
        if stats is None or exc is not None:
            return
        if ttft_ms is not None:
            stats.get(f"ttft {cls}", "LLM").log(ttft_ms, 0)
        if tpot_ms is not None:
            stats.get(f"tpot {cls}", "LLM").log(tpot_ms, 0)

    # -- open loop (and a closed-loop capacity search, whose users the feed sets)
    def run_dispatcher(self) -> None:
        if self.search_loop == "closed":
            return self._run_closed_search()
        requests = (iter(self.workload.requests()) if self.pacing == "trace" else
                    cycle_requests(self.workload.requests, self.index, self.count))
        if self.pacing == "trace" and self.count > 1:
            requests = shard_sessions(requests, self.index, self.count)  # sessions whole
        pool = ConnectionPool(self.target, read_timeout_s=self.timeout_s, cold=not self.warm)
        client = self.new_client(pool)
        peak = max((s.rate_rps or 0) for s in self.stages) / self.count
        # about a quarter second of arrivals built ahead in idle time (4 to 64)
        requests = self._prefetch = Prefetch(requests, min(64, max(4, int(peak / 4))),
                                             prefill=True)
        if self.warm:
            pool.warm(min(self.max_in_flight, 64, max(2, int(peak * 2))))

        def send(req, t_sched, stage):
            self.send(client, req, t_sched, stage)

        def on_stage(st: StagePlan, t0: int, t1: int) -> None:
            self.add_stage(st, t0, t1, cut=self.stopping.is_set() or self.dispatcher.stage_cut)

        seed = self.job.seed * 1000 + self.index
        stages = self.stages
        run_time = getattr(self.environment.parsed_options, "run_time", None)
        if self.pacing == "trace" and stages[0].duration_s >= FOREVER_S and not run_time:
            stages = [replace(stages[0], duration_s=FOREVER_S)]
        self.dispatcher = d = OpenLoopDispatcher(
            send, requests, stages, pacing=self.pacing, cv=self.cv,
            max_in_flight=self.max_in_flight, seed=seed, share=1.0 / self.count,
            max_requests=self.max_requests,
            on_stage=on_stage, on_stage_start=self.open_stage)
        if self.job.search is not None:  # capacity search: kvbench run feeds the probes
            from kvbench.runs.search import ProbeFeed

            feed = ProbeFeed(self.run_dir, self.endpoint, self.workload_name)
            d.stages = (StagePlan(p.index, p.duration_s, p.rate_rps, exact_count=True)
                        for p in feed.probes(d))
        if self.stopping.is_set():
            d.stop()
        d.run()
        self._prefetch.close()
        d.wait_idle(self.drain_s)  # then what is still in flight is cancelled at the stop
        d.cancel()
        pool.close()

    def _run_closed_search(self) -> None:
        """The closed-loop capacity search: kvbench run feeds the probes (``ProbeFeed``), each
        a stage of its number of users (``ClosedLoopStages``); this process runs its share."""
        from kvbench.runs.search import ProbeFeed

        def on_stage(st: StagePlan, t0: int, t1: int) -> None:
            self.add_stage(st, t0, t1, cut=self.stopping.is_set() or self.dispatcher.stage_cut)

        feed = ProbeFeed(self.run_dir, self.endpoint, self.workload_name)
        self._sessions = self._built_ahead(prefill=True)
        self.dispatcher = d = ClosedLoopStages(
            lambda u: self._closed_user(d, u), (), index=self.index, count=self.count,
            on_stage=on_stage, on_stage_start=self.open_stage)
        d.stages = (StagePlan(p.index, p.duration_s, None, p.users) for p in feed.probes(d))
        if self.stopping.is_set():
            d.stop()
        d.run()
        d.wait_idle(self.drain_s)  # then what is still in flight is cancelled at the stop
        d.cancel()

    def _closed_user(self, d: ClosedLoopStages, u: ClosedUser) -> None:
        """One user of a closed-loop search: one session at a time (think times between turns,
        turn k+1 built from turn k's answer, sub-agents concurrently: ``plan.sessions``), each
        request tagged with the stage it was sent in; it waits while no stage runs and ends
        once retired."""
        client = self.new_client()
        if self.warm:
            client.pool.warm(1)

        def send(req, t_scheduled_ns):
            stage = d.next_turn(u)
            if stage is None:
                return None
            try:
                return self.send(client, req, t_scheduled_ns, stage, keep_text=True)
            finally:
                d.turn_done(u)

        driver = self.session_driver(send, d.stopped)
        try:
            while not u.retired and not d.stopped.is_set():
                session = self.next_session()
                if session is None:
                    return
                if not driver.run(session) and driver.refused:
                    return
        finally:
            client.pool.close()

    def session_driver(self, send, stopped) -> SessionDriver:
        """A user's session driver (``plan.sessions``) with the job's replay strategy."""
        return SessionDriver(send, stopped, replay=self.job.replay,
                             time_scale=self.job.time_scale)

    def stop_starting(self) -> None:
        """The stage (or run) ends: users and the dispatcher start no new request."""
        if not self.stopping.is_set():
            self.stopped_ns = time.time_ns()
        self.stopping.set()
        if self.dispatcher is not None:
            self.dispatcher.stop()

    def open_stage(self, st: StagePlan, t0_ns: int) -> None:
        """The stage running now, in the live sidecar (a killed run's partial stage)."""
        self.sink.meta.open_stage = self._entry(st, t0_ns)
        self.looplag.reset()

    def _entry(self, st: StagePlan, t0_ns: int) -> StageEntry:
        """The entry of a stage of this process's plan begun at ``t0_ns``: its request count
        the one configured (all processes), not this process's share."""
        planned = next((s for s in self.job.stages if s.index == st.index), None)
        return StageEntry.of(st, endpoint=self.endpoint, workload=self.workload_name,
                             profile=self.job.profile, pacing=self.stage_pacing,
                             t_start_ns=t0_ns, requests=planned and planned.requests)

    def add_stage(self, st: StagePlan, t0_ns: int, t1_ns: int, cut: bool = False) -> None:
        self._end_stage(self._entry(st, t0_ns), t1_ns, cut)

    def _end_stage(self, entry: StageEntry, t1_ns: int, cut: bool = False) -> None:
        """The stage ended at ``t1_ns`` (``cut``: before its planned end), with the loop's
        pauses in it."""
        entry = entry.replace(t_end_ns=t1_ns, **self.looplag.take())
        self.sink.meta.stages.append(entry.cut(t1_ns) if cut else entry)
        self.sink.meta.open_stage = None

    def close(self, interrupted: str | None = None) -> None:
        """Stop what is still running (each request records itself: cancelled at the stop),
        then close the shard. ``interrupted``: a signal cut the run; nothing drains."""
        if interrupted:
            self.interrupted = self.interrupted or interrupted
        runner = self.environment.runner
        t_stop = time.time_ns()
        if self.interrupted:
            self.environment.stop_timeout = 0  # an interrupt stops at once: no drain
        self.stop_starting()
        if runner is not None and not isinstance(runner, MasterRunner):
            try:
                runner.stop()  # SIGTERM path: users may still be running
            except Exception:  # noqa: BLE001 - stopping twice is harmless
                pass
        d = self.dispatcher
        if d is not None:
            d.cancel()
        for built_ahead in (self._sessions, getattr(self, "_prefetch", None)):
            if built_ahead is not None:
                built_ahead.close()
        if runner is not None:
            runner.user_greenlets.join(timeout=5)
        meta = self.sink.meta
        meta.endpoint = self.job.endpoint.record()
        meta.workload = self.workload_name
        if d is not None:
            meta.counts["dropped_at_cap"] = d.dropped_at_cap
            if d.dropped_at_cap:
                meta.incomplete.append(Incomplete(
                    f"{d.dropped_at_cap} arrivals on {self.endpoint}/{self.workload_name}",
                    f"dropped at the cap of {self.max_in_flight} requests in flight"))
        st = meta.open_stage
        if st is not None:  # closed loop: its one stage; open loop: one a stop cut
            t_end = self.stopped_ns or t_stop
            if self.pacing == "closed" and not self.interrupted:  # it ran what it ran
                self._end_stage(st.replace(duration_s=(t_end - st.t_start_ns) / 1e9), t_end)
            else:
                self._end_stage(st, t_end, cut=True)
        if self.interrupted:
            meta.interrupted = self.interrupted
        if self._warm_pool is not None:  # connections no user took
            self._warm_pool.close()
        self.sink.close()


def settle_heap() -> None:
    """Collect once, then move every object alive now (workload, tokenizer, modules, Locust)
    to the collector's permanent generation: a full collection during load then walks only
    what the load itself made. Without it a full collection walked the whole heap in the
    middle of a stage (84-127 ms, every stream read late together; issue 13)."""
    gc.collect()
    gc.freeze()


class _Renamed:
    """A later pass over a session: same turns, ids suffixed ``#pass``."""

    def __init__(self, session, n: int) -> None:
        self._s, self._n = session, n
        self.session_id = f"{session.session_id}#{n}"

    def next_request(self):
        req = self._s.next_request()
        if req is None:
            return None
        if isinstance(req, Spawn):  # its sub-agents are renamed alike
            return Spawn(tuple(_Renamed(s, self._n) for s in req.sessions), req.think_time_s)
        parent = req.parent_session_id and f"{req.parent_session_id}#{self._n}"
        return replace(req, request_id=f"{req.request_id}#{self._n}",
                       session_id=self.session_id, parent_session_id=parent)

    def feed_response(self, text: str) -> None:
        self._s.feed_response(text)


# --------------------------------------------------------------------------- on the environment

def job_file_given(environment) -> bool:
    o = getattr(environment, "parsed_options", None)
    return bool(getattr(o, "kvbench_job", ""))


def get_context(environment, user_cls=None) -> LoadContext:
    """``environment.kvbench``, built once from the environment's options (users start
    concurrently: the first builds it, the others wait; a failure is kept and raised again)."""
    ctx = getattr(environment, "kvbench", None)
    if ctx is not None:
        return ctx
    lock = environment.__dict__.setdefault("kvbench_lock", gevent.lock.RLock())
    with lock:
        err = getattr(environment, "kvbench_error", None)
        if err is not None:
            raise err
        if getattr(environment, "kvbench", None) is None:
            try:
                host = environment.host or getattr(user_cls, "host", None)
                job = job_from_options(environment.parsed_options, host,
                                       getattr(user_cls, "workload", ""))
                if job.pacing == "search" and not job_file_given(environment):
                    # nothing would feed its probes: the run would end with no record
                    o = environment.parsed_options
                    raise UserError(
                        f"--kvbench-profile {job.profile}: a capacity search (pacing = "
                        "\"search\") runs only under kvbench run, which plans its probes; run "
                        f"kvbench run --config {o.kvbench_config or 'bench.toml'} --profile "
                        f"{job.profile}, or pick a profile with stages")
                environment.kvbench = LoadContext(environment, job)
            except UserError as exc:
                environment.kvbench_error = exc
                raise
    return environment.kvbench


def fail(environment, exc: UserError) -> None:
    """Report a kvbench error once, set the exit code and end this process soon."""
    if getattr(environment, "kvbench_reported", False):
        return
    environment.kvbench_reported = True
    log.error("kvbench: error: %s", exc)
    environment.process_exit_code = 2
    quit_soon(environment, 0.1)


def quit_soon(environment, delay_s: float = 0.05) -> None:
    """The ladder is over: stop this process (a worker's quit ends the master's run once all
    workers are done), from a separate greenlet so no user kills itself."""
    runner = environment.runner
    if runner is not None and not isinstance(runner, MasterRunner):
        gevent.spawn_later(delay_s, runner.quit)
