"""kvbench's Locust arguments (with ``env_var``, so locust.conf, ``[tool.locust]`` and the
environment work) and the job they resolve to: ``--kvbench-job`` as written by ``kvbench run``,
else ``kvbench.runs.job.resolve`` over ``--kvbench-config`` and the other options."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from locust import events

from kvbench.core.errors import UserError
from kvbench.core.rows import new_run_id
from kvbench.loadgen.plan.pacing import PACINGS
from kvbench.loadgen.plan.sessions import REPLAYS
from kvbench.core.contract import StagePlan
from kvbench.runs.job import FOREVER_S, Job, resolve


STOP_AFTER_FAILURES = 20  # --kvbench-stop-after-failures's default
HERE_CONFIG = "bench.toml"  # read from the current directory when --kvbench-config is not given
NO_CONFIG = "none"  # --kvbench-config none: the locustfile's defaults even beside a bench.toml

log = logging.getLogger("kvbench.loadgen")


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    g = parser  # (argument groups lose Locust's web-UI options)
    g.add_argument("--kvbench-job", env_var="KVBENCH_JOB", default="",
                   help="a resolved job file (written by kvbench run); the options below are "
                        "then ignored")
    g.add_argument("--kvbench-config", env_var="KVBENCH_CONFIG", default="",
                   help="bench.toml to take the workload, endpoint, SLOs and profile from "
                        "(default: ./bench.toml when there is one; 'none': no config)")
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
    g.add_argument("--kvbench-requests", env_var="KVBENCH_REQUESTS", type=int, default=0,
                   help="end the run after this many requests were sent (all processes "
                        "together; in flight ones finish): a run of exactly N requests")
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
    g.add_argument("--kvbench-replay", env_var="KVBENCH_REPLAY", default="",
                   choices=("",) + REPLAYS,
                   help="closed loop: when a session's next request goes: think (recorded "
                        "think time after the answer), timestamps (recorded send times), "
                        "api_scaled (recorded server time plus think time from the last send)")
    g.add_argument("--kvbench-time-scale", env_var="KVBENCH_TIME_SCALE", type=float,
                   default=0.0, help="factor on every recorded time of a replay (0.1: ten "
                                     "times faster; default 1)")
    g.add_argument("--kvbench-session-header", env_var="KVBENCH_SESSION_HEADER", default=None,
                   help="header carrying each request's session id (default X-Session-ID; "
                        "'' sends none)")
    g.add_argument("--kvbench-session-user", env_var="KVBENCH_SESSION_USER",
                   action="store_true", default=False,
                   help="also send the session id as the body's user field")
    g.add_argument("--kvbench-stop-after-failures", env_var="KVBENCH_STOP_AFTER_FAILURES",
                   type=int, default=STOP_AFTER_FAILURES,
                   help="stop the run after this many requests in a row failed in a way load "
                        "cannot cause (HTTP 404, 401, 403, connection refused, unknown host); "
                        "never on 429, 503 or timeouts; 0: never stop")
    g.add_argument("--kvbench-stage-index", env_var="KVBENCH_STAGE_INDEX", type=int, default=0,
                   help="stage index recorded for a closed-loop run", include_in_web_ui=False)
    g.add_argument("--kvbench-no-finalize", env_var="KVBENCH_NO_FINALIZE", action="store_true",
                   default=False, include_in_web_ui=False,
                   help="leave shards for kvbench run to compact (no run.json here)")
    g.add_argument("--kvbench-workers", type=int, default=0, include_in_web_ui=False,
                   help=argparse.SUPPRESS)


def has_kvbench_options(o) -> bool:
    return o is not None and hasattr(o, "kvbench_run_id")


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--kvbench-{what} {text!r}: give numbers separated by commas, "
                        "e.g. 2,6,10") from None


def _stages(o) -> list[StagePlan] | None:
    """The stage plan the options give (None: the profile's)."""
    rates = _floats(o.kvbench_rates, "rates")
    durs = _floats(o.kvbench_stage_duration, "stage-duration")
    if not (rates or durs):
        return None
    n = max(len(rates), len(durs), 1)
    rates = rates or [None] * n
    durs = durs or [FOREVER_S]
    return [StagePlan(i, durs[min(i, len(durs) - 1)], rates[min(i, len(rates) - 1)])
            for i in range(n)]


def _count(n: int) -> int | None:
    if n < 0:
        raise UserError(f"--kvbench-requests {n}: give a positive count of requests (0: no "
                        "limit)")
    return n or None


def _scale(x: float) -> float | None:
    if x < 0 or x > 1000:
        raise UserError(f"--kvbench-time-scale {x:g}: give a factor above 0 and at most 1000 "
                        "(0.1 replays ten times faster)")
    return x or None


def _header_name(name: str | None) -> str | None:
    if name and not all(c.isalnum() or c in "!#$%&'*+.^_`|~-" for c in name):
        raise UserError(f"--kvbench-session-header {name!r}: not a header name; use letters, "
                        "digits and dashes (e.g. X-Session-ID), or '' for none")
    return name


def config_path(o) -> str:
    """The bench.toml this run reads: ``--kvbench-config``, else ``./bench.toml`` when the
    current directory has one (as ``kvbench run`` does), else none ("")."""
    given = o.kvbench_config
    if given:
        return "" if given == NO_CONFIG else given
    return HERE_CONFIG if Path(HERE_CONFIG).is_file() else ""


_SAID: set[str] = set()


def _say_config(o, path: str) -> None:
    """One line, once a process: which config this plain locust run uses."""
    if path in _SAID:
        return
    _SAID.add(path)
    if not path:
        log.info("kvbench: no config (no ./bench.toml, no --kvbench-config): the locustfile's "
                 "workload defaults and built-in SLOs")
    elif o.kvbench_config:
        log.info("kvbench: config %s (--kvbench-config)", path)
    else:
        log.info("kvbench: config %s (found in the current directory; --kvbench-config none "
                 "to ignore it)", Path(path).resolve())


def _config(o):
    path = config_path(o)
    _say_config(o, path)
    if not path:
        return None
    from kvbench.config import load_config

    return load_config(path)


def _endpoint_for(cfg, host: str | None) -> str | None:
    """The [[endpoints]] entry of ``cfg`` whose url is ``host`` (its model, topology, API key
    and headers then apply), or None."""
    if cfg is None or not host:
        return None
    want = host.rstrip("/")
    for ep in cfg.endpoints:
        url = getattr(ep, "url", None)
        if url and url.rstrip("/") == want:
            return ep.name
    return None


def _with_kind_default(cfg, host: str | None, workload: str):
    """``cfg`` with the locustfile's own workload (its kind's defaults) added when the config
    has no [workloads.<name>] of that name: its SLOs, tokenizer and seed still apply."""
    if cfg is None or ":" in workload or workload in cfg.workloads:
        return cfg
    from kvbench.runs.job import default_config

    try:
        dflt = default_config(host, workload)
    except UserError:
        return cfg  # resolve names the problem
    return cfg.model_copy(update={"workloads": {**dflt.workloads, **cfg.workloads}})


def run_id(o) -> str:
    """The run id the options name, else a new one (the master's is synced to its workers)."""
    if o.kvbench_run_id:
        check_places(o)
        return o.kvbench_run_id
    if o.kvbench_job:
        return Job.load(o.kvbench_job).run_id
    try:
        cfg = _config(o)
    except UserError:
        cfg = None  # the load context reports it in one sentence, before any load
    return new_run_id(cfg.suite.name if cfg is not None else "locust")


def run_dir(o) -> Path:
    """The run directory the options name: the job file's, else ``--kvbench-results`` /
    ``--kvbench-run-id`` (the master, which builds no load context, and its workers alike)."""
    if o.kvbench_job:
        return Job.load(o.kvbench_job).run_dir
    return Path(o.kvbench_results) / o.kvbench_run_id


def check_places(o) -> None:
    """``--kvbench-run-id`` names one plain folder of the results folder, and
    ``--kvbench-results`` is a local folder, as ``kvbench run`` requires of its own."""
    from kvbench.core.paths import results_dir_problem, run_id_problem

    why = o.kvbench_run_id and run_id_problem(o.kvbench_run_id)
    if why:
        raise UserError(f"--kvbench-run-id: {why}")
    why = o.kvbench_results and results_dir_problem(str(o.kvbench_results))
    if why:
        raise UserError(f"--kvbench-results: {why}")


def job_from_options(o, host: str | None, default_workload: str, *,
                     lookup_model: bool = True) -> Job:
    """The job of this Locust run: the job file when given, else resolved from the options."""
    if o.kvbench_job:
        return Job.load(o.kvbench_job)
    check_places(o)
    workload = o.kvbench_workload or default_workload
    if not workload:
        raise UserError("this locustfile runs a job: pass --kvbench-job FILE (kvbench run "
                        "writes one) or --kvbench-workload NAME")
    cfg = _config(o)
    implicit = cfg is not None and not o.kvbench_config
    if not o.kvbench_workload:
        cfg = _with_kind_default(cfg, host, workload)
    profile = o.kvbench_profile or None
    if implicit and profile is None:
        # a bench.toml found beside the run lends its SLOs, endpoints and workloads; the load's
        # shape stays Locust's (-u, -t) unless --kvbench-profile names one of its profiles
        cfg = cfg.model_copy(update={"suite": cfg.suite.model_copy(update={"profile": None})})
    return resolve(
        cfg, workload=workload,
        endpoint=o.kvbench_endpoint or _endpoint_for(cfg, host), url=host, topology=o.kvbench_topology or None,
        model=o.kvbench_model or None, api_key_env=o.kvbench_api_key_env or None,
        profile=profile, pacing=o.kvbench_pacing or None,
        stages=_stages(o), stage_index=o.kvbench_stage_index,
        gamma_cv=o.kvbench_gamma_cv or None, max_in_flight=o.kvbench_max_in_flight or None,
        timeout_s=o.kvbench_timeout or None, cold_connections=o.kvbench_cold_connections,
        ignore_eos=o.kvbench_ignore_eos, run_id=o.kvbench_run_id,
        max_requests=_count(o.kvbench_requests), replay=o.kvbench_replay or None,
        time_scale=_scale(o.kvbench_time_scale),
        session_header=_header_name(o.kvbench_session_header),
        session_user=o.kvbench_session_user,
        results_dir=o.kvbench_results, lookup_model=lookup_model,
        where=config_path(o) or "the config")
