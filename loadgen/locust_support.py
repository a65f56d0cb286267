"""Locust machinery behind the locustfiles: custom arguments, the User class, the run context
(client, record sink, pacing) and the event hooks. Imported by ``loadgen/<workload>.py``.

Hooks, never patches: ``init_command_line_parser`` (arguments with ``env_var``, so locust.conf,
``[tool.locust]`` and the environment work), ``test_start`` (the master hands its run id and
worker count to the workers through the synced custom arguments), ``test_stop`` and
``quitting`` (each load process closes its own shard; the master or single process then merges
the shards into ``requests.parquet`` and writes ``run.json``).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import logging
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import gevent
import gevent.lock
import orjson
from locust import User, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from kvbench.core.errors import UserError
from kvbench.core.store import worker_name
from kvbench.loadgen.client import ConnectionPool, Result, StreamingClient, Target
from kvbench.loadgen.openai import request_body, request_path
from kvbench.loadgen.pacing import PACINGS, OpenLoopDispatcher, StagePlan, cycle_requests, shard
from kvbench.loadgen.sink import COLUMNS, RecordSink, merge_proc_meta, read_proc_meta
from kvbench.workloads.tokenizer import get_tokenizer

log = logging.getLogger("kvbench.loadgen")

_ROW = ("run_id", "endpoint", "topology", "workload", "request_class", "stage", "request_id",
        "session_id", "turn", "worker", "prompt_tokens", "prompt_tokens_client",
        "shared_prefix_tokens", "max_tokens", "completion_tokens", "completion_tokens_client",
        "cached_tokens", "t_scheduled", "t_sent", "connect_ns", "ttft_ns", "chunk_offsets_ns",
        "chunk_tokens", "e2e_ns", "status", "http_status", "error", "server_queue_ns",
        "server_prefill_ns", "server_kv_transfer_ns", "server_first_decode_ns",
        "server_replica", "server_region")
assert _ROW == COLUMNS, "loadgen row order must follow kvbench.schema.REQUESTS"


# --------------------------------------------------------------------------- arguments

@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    g = parser  # (argument groups lose Locust's web-UI options)
    g.add_argument("--kvbench-config", env_var="KVBENCH_CONFIG", default="",
                   help="bench.toml to take the workload, endpoint and profile from")
    g.add_argument("--kvbench-workload", env_var="KVBENCH_WORKLOAD", default="",
                   help="[workloads.<name>] of the config, or module:factory; default: the "
                        "locustfile's own")
    g.add_argument("--kvbench-results", env_var="KVBENCH_RESULTS", default="results",
                   help="results directory (records go to <dir>/<run id>/)")
    g.add_argument("--kvbench-run-id", env_var="KVBENCH_RUN_ID", default="",
                   help="run id (default: a new one)")
    g.add_argument("--kvbench-endpoint", env_var="KVBENCH_ENDPOINT", default="",
                   help="name of an [[endpoints]] entry of the config (name, model, topology)")
    g.add_argument("--kvbench-topology", env_var="KVBENCH_TOPOLOGY", default="",
                   help="topology recorded for the target (default: config's or unknown)")
    g.add_argument("--kvbench-model", env_var="KVBENCH_MODEL", default="",
                   help="model name to request (default: config's, else first of /v1/models)")
    g.add_argument("--kvbench-api-key-env", env_var="KVBENCH_API_KEY_ENV", default="",
                   help="name of the environment variable holding the API key")
    g.add_argument("--kvbench-profile", env_var="KVBENCH_PROFILE", default="",
                   help="[profiles.<name>] of the config to take pacing and stages from")
    g.add_argument("--kvbench-pacing", env_var="KVBENCH_PACING", default="",
                   choices=("",) + PACINGS, help="closed (Locust users) or an open-loop pacing")
    g.add_argument("--kvbench-rates", env_var="KVBENCH_RATES", default="",
                   help="open-loop rates in requests/s, one per stage: 2,6,10")
    g.add_argument("--kvbench-stage-duration", env_var="KVBENCH_STAGE_DURATION", default="",
                   help="seconds per stage (one value, or one per stage)")
    g.add_argument("--kvbench-gamma-cv", env_var="KVBENCH_GAMMA_CV", type=float, default=0.0,
                   help="coefficient of variation of gamma gaps (burstiness)")
    g.add_argument("--kvbench-max-in-flight", env_var="KVBENCH_MAX_IN_FLIGHT", type=int,
                   default=0, help="open-loop cap on requests in flight (arrivals over it are "
                                   "dropped and counted)")
    g.add_argument("--kvbench-timeout", env_var="KVBENCH_TIMEOUT", type=float, default=0.0,
                   help="whole-request deadline in seconds")
    g.add_argument("--kvbench-cold-connections", env_var="KVBENCH_COLD_CONNECTIONS",
                   action="store_true", default=False,
                   help="a new connection per request (its setup recorded in connect_ns)")
    g.add_argument("--kvbench-ignore-eos", env_var="KVBENCH_IGNORE_EOS", action="store_true",
                   default=False, help="send ignore_eos (vLLM/SGLang) to get max_tokens exactly")
    g.add_argument("--kvbench-stage-index", env_var="KVBENCH_STAGE_INDEX", type=int, default=0,
                   help="stage index recorded for a closed-loop run", include_in_web_ui=False)
    g.add_argument("--kvbench-no-finalize", env_var="KVBENCH_NO_FINALIZE", action="store_true",
                   default=False, include_in_web_ui=False,
                   help="leave shards for kvbench run to compact (no run.json here)")
    g.add_argument("--kvbench-workers", type=int, default=0, include_in_web_ui=False,
                   help=argparse.SUPPRESS)


# --------------------------------------------------------------------------- config

DEFAULT_MIX = [("chat", 4), ("rag", 3), ("agent", 2), ("longctx", 1)]


def default_config(host: str, workload: str):
    """A config for a plain ``locust -f loadgen/<kind>.py`` run: the kind's default spec."""
    from kvbench.config import parse_config

    if workload == "trace":
        raise UserError("the trace locustfile needs a trace: pass --kvbench-config with a "
                        "[workloads.<name>] table of kind = \"trace\" and its path")
    workloads = {workload: {"kind": workload}}
    if workload == "mix":
        workloads = {name: {"kind": name} for name, _ in DEFAULT_MIX}
        workloads["mix"] = {"kind": "mix", "components": [
            {"workload": n, "weight": w} for n, w in DEFAULT_MIX]}
    data = {"endpoints": [{"name": "target", "kind": "openai", "url": host or "http://localhost"}],
            "workloads": workloads,
            "profiles": {"default": {"pacing": "closed", "stages": [{"users": 1,
                                                                    "duration_s": 60}]}}}
    return parse_config(data, "(locustfile defaults)")


def load_factory(spec: str):
    mod, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"--kvbench-workload {spec}: cannot import it ({exc}); give a "
                        "[workloads.<name>] of the config or module:factory") from None


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--kvbench-{what} {text!r}: give numbers separated by commas, "
                        "e.g. 2,6,10") from None


# --------------------------------------------------------------------------- run context

class LoadContext:
    """Everything one load process shares: target, records, workload, pacing."""

    _instance: "LoadContext | None" = None

    def __init__(self, environment, user_cls) -> None:
        o = environment.parsed_options
        self.environment = environment
        self.opts = o
        self.worker = worker_name()
        self.cfg = None
        self.cfg_effective = None
        if o.kvbench_config:
            from kvbench.config import load_config

            self.cfg = load_config(o.kvbench_config)
        ep = None
        if self.cfg is not None and o.kvbench_endpoint:
            try:
                ep = self.cfg.endpoint(o.kvbench_endpoint)
            except KeyError:
                raise UserError(f"--kvbench-endpoint {o.kvbench_endpoint}: no such "
                                f"[[endpoints]] name in {o.kvbench_config}") from None
        host = environment.host or user_cls.host or getattr(ep, "url", None)
        if not host:
            raise UserError("no target: pass --host http://HOST:PORT (or --kvbench-endpoint of "
                            "an openai endpoint with a url)")
        self.url = host.rstrip("/")
        self.target = Target.parse(self.url)
        self.endpoint = o.kvbench_endpoint or urlsplit(self.url).netloc
        self.topology = o.kvbench_topology or getattr(ep, "topology", None) or "unknown"
        self.ep = ep
        wl_name = o.kvbench_workload or user_cls.workload
        self.workload = self._workload(wl_name, user_cls)
        self.workload_name = getattr(self.workload, "name", wl_name)
        profile = self._profile()
        self.pacing = o.kvbench_pacing or (profile.pacing if profile else "closed")
        self.stages = self._stages(profile)
        self.cv = o.kvbench_gamma_cv or (profile.gamma_cv if profile else 2.0)
        self.max_in_flight = o.kvbench_max_in_flight or (profile.max_in_flight if profile
                                                         else 512)
        self.timeout_s = o.kvbench_timeout or (profile.request_timeout_s if profile else 600.0)
        self.warm = (profile.warmup_connections if profile else True) and \
            not o.kvbench_cold_connections
        self.model = o.kvbench_model or getattr(ep, "model", None) or self._first_model()
        from kvbench.loadgen.openai import auth_headers

        self.headers = auth_headers(getattr(ep, "headers", None),
                                    o.kvbench_api_key_env or getattr(ep, "api_key_env", None),
                                    f"endpoint {self.endpoint!r}")
        self.run_id = o.kvbench_run_id or _new_run_id(self.cfg)
        self.run_dir = Path(o.kvbench_results) / self.run_id
        self.sink = RecordSink(self.run_dir)
        self.sink.start()
        runner = environment.runner
        self.index = runner.worker_index if isinstance(runner, WorkerRunner) else 0
        self.count = max(1, o.kvbench_workers or 1) if isinstance(runner, WorkerRunner) else 1
        self.index = max(0, self.index) % self.count
        self._sessions = self._session_iter()
        self.dispatcher: OpenLoopDispatcher | None = None
        self.t_start_ns = time.time_ns()
        self.ignore_eos = o.kvbench_ignore_eos
        cfg = self.cfg or self.cfg_effective  # the workload's tokenizer sizes multi-token chunks
        self.tokenizer = get_tokenizer(cfg.suite.tokenizer if cfg is not None else None)

    _lock = gevent.lock.RLock()  # users start concurrently; the context is built once

    _error: UserError | None = None

    @classmethod
    def get(cls, environment, user_cls) -> "LoadContext":
        with cls._lock:
            if cls._error is not None:
                raise cls._error
            if cls._instance is None:
                try:
                    cls._instance = cls(environment, user_cls)
                except UserError as exc:
                    cls._error = exc
                    raise
        return cls._instance

    # -- setup helpers
    def _workload(self, name: str, user_cls):
        if ":" in name:
            return load_factory(name)()
        cfg = self.cfg or default_config(self.environment.host or "", name)
        self.cfg_effective = cfg
        if name not in cfg.workloads:
            raise UserError(f"--kvbench-workload {name}: not a [workloads.*] table of "
                            f"{self.opts.kvbench_config or 'the config'}; use one of "
                            f"{sorted(cfg.workloads)}")
        from kvbench.workloads.registry import make_workload

        return make_workload(name, cfg)

    def _profile(self):
        if self.cfg is None:
            return None
        name = self.opts.kvbench_profile or self.cfg.suite.profile
        if not name:
            return None
        if name not in self.cfg.profiles:
            raise UserError(f"--kvbench-profile {name}: not a [profiles.*] table; use one of "
                            f"{sorted(self.cfg.profiles)}")
        return self.cfg.profiles[name]

    def _stages(self, profile) -> list[StagePlan]:
        o = self.opts
        rates = _floats(o.kvbench_rates, "rates")
        durs = _floats(o.kvbench_stage_duration, "stage-duration")
        if rates or durs:
            n = max(len(rates), len(durs), 1)
            rates = rates or [None] * n
            durs = durs or [3600.0 * 24]
            return [StagePlan(i, durs[min(i, len(durs) - 1)], rates[min(i, len(rates) - 1)])
                    for i in range(n)]
        if profile is not None:
            return [StagePlan(i, s.duration_s, s.rate_rps, s.users)
                    for i, s in enumerate(profile.stages)]
        return [StagePlan(0, 3600.0 * 24, None)]

    def _first_model(self) -> str:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
                data = orjson.loads(r.read())
            return data["data"][0]["id"]
        except Exception as exc:  # noqa: BLE001 - any failure means: tell the user
            raise UserError(f"{self.url}/v1/models did not name a model ({exc}); pass "
                            "--kvbench-model") from None

    def _session_iter(self):
        """This worker's share of the sessions, cycled; later passes get ``#pass`` ids."""
        for n in itertools.count():
            empty = True
            for s in shard(self.workload.sessions(), self.index, self.count):
                empty = False
                yield s if n == 0 else _Renamed(s, n)
            if empty:
                return

    def next_session(self):
        return next(self._sessions, None)

    def new_client(self, pool: ConnectionPool | None = None) -> StreamingClient:
        pool = pool or ConnectionPool(self.target, read_timeout_s=self.timeout_s,
                                      cold=not self.warm)
        return StreamingClient(pool, headers=self.headers, deadline_s=self.timeout_s,
                               tokenizer=self.tokenizer)

    # -- the request
    def send(self, client: StreamingClient, req, t_scheduled_ns: int | None, stage: int,
             keep_text: bool = False) -> Result:
        """Send ``req``, record it whatever happens (cancelled included), report to Locust."""
        body = request_body(req, self.model, ignore_eos=self.ignore_eos)
        res = Result()
        self.sink.begin()
        try:
            client.post_stream(request_path(req), body, keep_text=keep_text, res=res)
        finally:
            if res.t_sent_ns == 0:
                res.t_sent_ns = time.time_ns()
            self.record(req, res, t_scheduled_ns, stage)
        self.report(req, res)
        return res

    def record(self, req, res: Result, t_scheduled_ns: int | None, stage: int) -> None:
        self.sink.append((
            self.run_id, self.endpoint, self.topology, self.workload_name, req.request_class,
            stage, req.request_id, req.session_id, req.turn, self.worker,
            res.prompt_tokens, req.prompt_tokens, req.shared_prefix_tokens, req.max_tokens,
            res.completion_tokens, res.completion_tokens_client, res.cached_tokens,
            t_scheduled_ns if t_scheduled_ns is not None else res.t_sent_ns, res.t_sent_ns,
            res.connect_ns, res.ttft_ns, res.offsets_ns, res.tokens, res.e2e_ns, res.status,
            res.http_status, res.error, res.server_queue_ns, res.server_prefill_ns,
            res.server_kv_transfer_ns, res.server_first_decode_ns, res.server_replica,
            res.server_region))

    def report(self, req, res: Result) -> None:
        """Locust's live stats: one event per metric per request (never per token)."""
        fire = self.environment.events.request.fire
        cls = req.request_class
        n = res.completion_tokens or 0
        if res.status != "ok":
            fire(request_type="LLM", name=f"e2e {cls}", response_time=(res.e2e_ns or 0) / 1e6,
                 response_length=n, exception=RuntimeError(f"{res.status}: {res.error}"),
                 context={})
            return
        fire(request_type="LLM", name=f"e2e {cls}", response_time=res.e2e_ns / 1e6,
             response_length=n, exception=None, context={})
        if res.ttft_ns is not None:
            fire(request_type="LLM", name=f"ttft {cls}", response_time=res.ttft_ns / 1e6,
                 response_length=0, exception=None, context={})
        if n > 1 and res.ttft_ns is not None:
            fire(request_type="LLM", name=f"tpot {cls}",
                 response_time=(res.e2e_ns - res.ttft_ns) / (n - 1) / 1e6,
                 response_length=0, exception=None, context={})

    # -- open loop
    def run_dispatcher(self) -> None:
        requests = (iter(self.workload.requests()) if self.pacing == "trace" else
                    cycle_requests(self.workload.requests, self.index, self.count))
        if self.pacing == "trace" and self.count > 1:
            requests = shard(requests, self.index, self.count)
        pool = ConnectionPool(self.target, read_timeout_s=self.timeout_s, cold=not self.warm)
        client = self.new_client(pool)
        if self.warm:
            peak = max((s.rate_rps or 0) for s in self.stages) / self.count
            pool.warm(min(self.max_in_flight, 64, max(2, int(peak * 2))))

        def send(req, t_sched, stage):
            self.send(client, req, t_sched, stage)

        def on_stage(st: StagePlan, t0: int, t1: int) -> None:
            self.add_stage(st, t0, t1)

        seed = (self.cfg.suite.seed if self.cfg else 0) * 1000 + self.index
        stages = self.stages
        if self.pacing == "trace" and stages[0].duration_s >= 3600 * 24 and not \
                self.opts.run_time:
            stages = [replace(stages[0], duration_s=3600.0 * 24)]
        self.dispatcher = d = OpenLoopDispatcher(
            send, requests, stages, pacing=self.pacing, cv=self.cv,
            max_in_flight=self.max_in_flight, seed=seed, share=1.0 / self.count,
            on_stage=on_stage)
        d.run()
        d.wait_idle(self.timeout_s)
        pool.close()

    def add_stage(self, st: StagePlan, t0_ns: int, t1_ns: int) -> None:
        self.sink.meta["stages"].append({
            "endpoint": self.endpoint, "workload": self.workload_name, "profile":
            self.opts.kvbench_profile or (self.cfg.suite.profile if self.cfg else None),
            "index": st.index, "pacing": self.pacing, "rate_rps": st.rate_rps,
            "users": st.users, "duration_s": st.duration_s, "t_start_ns": t0_ns,
            "t_end_ns": t1_ns})

    def endpoint_info(self) -> dict:
        ep = self.ep
        return {"name": self.endpoint, "topology": self.topology, "url": self.url,
                "model": self.model, "kind": getattr(ep, "kind", "openai"),
                "gpus": getattr(ep, "gpus", None), "gpu_hour_cost": getattr(ep, "gpu_hour_cost",
                                                                            None)}

    def close(self) -> None:
        """Cancel what is still running (each request records itself), then close the shard."""
        runner = self.environment.runner
        if runner is not None and not isinstance(runner, MasterRunner):
            try:
                runner.stop()  # SIGTERM path: users may still be running
            except Exception:  # noqa: BLE001 - stopping twice is harmless
                pass
        d = self.dispatcher
        if d is not None:
            d.cancel()
        if runner is not None:
            runner.user_greenlets.join(timeout=5)
        self.sink.meta["endpoint"] = self.endpoint_info()
        self.sink.meta["workload"] = self.workload_name
        if d is not None:
            self.sink.meta["counts"]["dropped_at_cap"] = d.dropped_at_cap
            if d.dropped_at_cap:
                self.sink.meta["incomplete"].append({
                    "what": f"{d.dropped_at_cap} arrivals on {self.endpoint}/{self.workload_name}",
                    "why": f"dropped at the cap of {self.max_in_flight} requests in flight"})
        elif self.pacing == "closed":
            i = self.opts.kvbench_stage_index
            planned = self.stages[i].users if i < len(self.stages) else None
            users = planned or getattr(self.opts, "num_users", None)  # all processes together
            self.add_stage(StagePlan(i, 0.0, None, users),
                           self.t_start_ns, time.time_ns())
            st = self.sink.meta["stages"][-1]
            st["duration_s"] = (st["t_end_ns"] - st["t_start_ns"]) / 1e9
        self.sink.close()


class _Renamed:
    """A later pass over a session: same turns, ids suffixed ``#pass``."""

    def __init__(self, session, n: int) -> None:
        self._s, self._n = session, n
        self.session_id = f"{session.session_id}#{n}"

    def next_request(self):
        req = self._s.next_request()
        if req is None:
            return None
        return replace(req, request_id=f"{req.request_id}#{self._n}",
                       session_id=self.session_id)

    def feed_response(self, text: str) -> None:
        self._s.feed_response(text)


def _new_run_id(cfg) -> str:
    from kvbench.core.store import new_run_id

    return new_run_id(cfg.suite.name if cfg else "locust")


# --------------------------------------------------------------------------- the User

class KVBenchUser(User):
    """Closed loop: each user runs one session at a time (think times between turns, turn k+1
    built from turn k's response). Open loop: the process's first user runs the dispatcher;
    more users add nothing (use one user per process)."""

    abstract = True
    workload = "chat"  # [workloads.<name>] of the config, or the kind with its defaults

    def wait_time(self):
        return 0

    def on_start(self) -> None:
        try:
            self.ctx = LoadContext.get(self.environment, type(self))
        except UserError as exc:
            if not getattr(self.environment, "_kvbench_error", None):
                self.environment._kvbench_error = str(exc)
                log.error("kvbench: error: %s", exc)
                self.environment.process_exit_code = 2
                _quit_soon(self.environment)
            raise StopUser() from None
        self.stage = self.ctx.opts.kvbench_stage_index
        if self.ctx.pacing == "closed":
            self.llm = self.ctx.new_client()
            if self.ctx.warm:
                self.llm.pool.warm(1)

    @task
    def drive(self) -> None:
        ctx = self.ctx
        if ctx.pacing != "closed":
            if ctx.dispatcher is None:
                ctx.run_dispatcher()
                _quit_soon(self.environment)
            gevent.sleep(3600)
            return
        session = ctx.next_session()
        if session is None:
            gevent.sleep(1.0)
            return
        while True:
            req = session.next_request()
            if req is None:
                return
            if req.think_time_s > 0 and req.turn > 0:
                gevent.sleep(req.think_time_s)
            res = ctx.send(self.llm, req, None, self.stage, keep_text=True)
            if res.status != "ok":
                return  # a broken session cannot build its next turn on a failed response
            session.feed_response(res.text)


def _quit_soon(environment) -> None:
    """The ladder is over: stop this process (a worker's quit ends the master's run once all
    workers are done), from a separate greenlet so no user kills itself."""
    runner = environment.runner
    if runner is not None and not isinstance(runner, MasterRunner):
        gevent.spawn_later(0.05, runner.quit)


# --------------------------------------------------------------------------- hooks

@events.init.add_listener
def _on_init(environment, **kw) -> None:
    """A single process builds its context now, so workload generation is not charged to the
    run time (workers wait for the master's run id and worker count: see test_start)."""
    runner = environment.runner
    o = environment.parsed_options
    if o is None or not hasattr(o, "kvbench_run_id") or runner is None or \
            isinstance(runner, (MasterRunner, WorkerRunner)):
        return
    classes = [c for c in environment.user_classes if issubclass(c, KVBenchUser)]
    if not classes:
        return
    if not o.kvbench_run_id:
        _on_test_start(environment)
    try:
        LoadContext.get(environment, classes[0])
    except UserError as exc:
        log.error("kvbench: error: %s", exc)
        environment._kvbench_error = str(exc)
        environment.process_exit_code = 2
        gevent.spawn_later(0.1, runner.quit)
    # The build blocked the loop: refresh libev's cached clock, or Locust's --run-time timer
    # (armed next) would count the build and end the run early.
    gevent.get_hub().loop.update_now()


@events.test_start.add_listener
def _on_test_start(environment, **kw) -> None:
    o = environment.parsed_options
    if o is None or not hasattr(o, "kvbench_run_id"):
        return
    if not o.kvbench_run_id:
        cfg = None
        if o.kvbench_config:
            from kvbench.config import load_config

            cfg = load_config(o.kvbench_config)
        o.kvbench_run_id = _new_run_id(cfg)
    if isinstance(environment.runner, MasterRunner):
        # synced to the workers with the spawn message (custom arguments travel)
        o.kvbench_workers = max(1, environment.runner.worker_count)
    _State.started_ns = _State.started_ns or time.time_ns()


@events.test_stop.add_listener
def _on_test_stop(environment, **kw) -> None:
    ctx = LoadContext._instance
    if ctx is not None:
        ctx.sink.flush()


@events.quitting.add_listener
def _on_quitting(environment, **kw) -> None:
    runner = environment.runner
    ctx = LoadContext._instance
    if ctx is not None:
        ctx.close()
    o = environment.parsed_options
    if o is None or isinstance(runner, WorkerRunner) or getattr(o, "kvbench_no_finalize", True):
        return
    run_id = o.kvbench_run_id
    if not run_id:
        return
    run_dir = Path(o.kvbench_results) / run_id
    expected = o.kvbench_workers if isinstance(runner, MasterRunner) else 1
    finalize(run_dir, environment, expected_procs=max(1, expected or 1),
             ctx=ctx, wait_s=15.0 if isinstance(runner, MasterRunner) else 0.0)


class _State:
    started_ns = 0


def finalize(run_dir: Path, environment, expected_procs: int, ctx, wait_s: float) -> None:
    """Wait for every process's sidecar, compact the shards, write run.json."""
    from kvbench.core import store

    deadline = time.monotonic() + wait_s
    while len(list(run_dir.glob("proc-*.json"))) < expected_procs and time.monotonic() < deadline:
        gevent.sleep(0.1)
    metas = read_proc_meta(run_dir)
    merged = merge_proc_meta(metas)
    incomplete = list(merged["incomplete"])
    if len(metas) < expected_procs:
        incomplete.append({"what": f"{expected_procs - len(metas)} load process(es)",
                           "why": "did not close their record shard in time"})
    rows = store.compact(run_dir, "requests")
    o = environment.parsed_options
    cfg = getattr(ctx, "cfg", None) or getattr(ctx, "cfg_effective", None)
    if cfg is None and o.kvbench_config:
        from kvbench.config import load_config

        cfg = load_config(o.kvbench_config)
    meta = {
        "run_id": o.kvbench_run_id,
        "suite": cfg.suite.name if cfg else "locust",
        "started_ns": _State.started_ns or (ctx.t_start_ns if ctx else None),
        "ended_ns": time.time_ns(),
        "config": cfg.public_dump() if cfg else {},
        "versions": store.versions(),
        "git_commit": store.git_commit(Path(__file__).resolve().parent.parent),
        "hosts": sorted({m.get("host") for m in metas if m.get("host")}),
        "endpoints": _endpoints(metas),
        "stages": merged["stages"],
        "clock_offsets_ns": {},
        "telemetry": {"collectors": "not started by a plain locust run (kvbench run starts them)"},
        "incomplete": incomplete,
        "counts": merged["counts"],
        "workloads": {},
    }
    names = {m.get("workload") for m in metas if m.get("workload")}
    built = {}
    for name in sorted(names):
        try:
            from kvbench.workloads.describe import describe

            if ctx is not None and ctx.workload_name == name:
                wl = ctx.workload
            elif ":" in name or cfg is None or name not in cfg.workloads:
                continue
            else:
                from kvbench.workloads.registry import make_workload

                wl = make_workload(name, cfg)
            built[name] = wl
            meta["workloads"][name] = describe(wl)
        except Exception as exc:  # noqa: BLE001 - the records matter more than the summary
            meta["incomplete"].append({"what": f"workload summary of {name}",
                                       "why": f"describe failed: {exc}"[:200]})
    # what each endpoint was actually sent (the reports compare hit ratios with this)
    try:
        from kvbench.runs.finalize import describe_sent_requests

        meta["workloads_sent"] = describe_sent_requests(
            run_dir, built, cfg.endpoints if cfg is not None else ())
    except Exception as exc:  # noqa: BLE001 - the records matter more than the summary
        meta["incomplete"].append({"what": "summary of the requests sent",
                                   "why": f"describe failed: {exc}"[:200]})
    if rows != merged["counts"]["records_written"] and metas:
        meta["incomplete"].append({"what": "records", "why": f"{rows} rows compacted, "
                                   f"{merged['counts']['records_written']} written"})
    store.write_run_json(run_dir, store.RunMeta.from_dict(meta))
    log.info("kvbench: %d records in %s", rows, run_dir)


def _endpoints(metas: list[dict]) -> list[dict]:
    out: dict[str, dict] = {}
    for m in metas:
        ep = m.get("endpoint")
        if ep and ep.get("name") not in out:
            out[ep["name"]] = ep
    return list(out.values())
