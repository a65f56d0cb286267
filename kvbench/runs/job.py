"""The resolved job: everything one Locust run needs (endpoint, model, tokenizer, workload spec,
stage plan, pacing, SLOs, where results go), resolved once from the config and options.

``kvbench run`` resolves each job of its matrix and hands the Locust child a job file
(``--kvbench-job``); a plain ``locust -f`` resolves the same ``Job`` from its options through
``resolve``. A job file holds no secret: the API key stays in the environment variable
``api_key_env`` names, and header values ``BenchConfig.public_dump`` masks travel to the child in
the environment variable ``KVBENCH_SECRET_HEADERS`` (JSON), never in the file.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from kvbench.core import redact
from kvbench.core.contract import SLO, EndpointEntry, SearchSpec, StagePlan, slo_map
from kvbench.core.errors import UserError
from kvbench.core.rows import new_run_id

SECRET_HEADERS_ENV = "KVBENCH_SECRET_HEADERS"
FOREVER_S = 3600.0 * 24  # a stage with no end: the run ends on Locust's --run-time
DRAIN_S = 30.0  # [profiles.*] drain_s's default, for a job without a profile
DEFAULT_MIX = [("chat", 4), ("rag", 3), ("agent", 2), ("longctx", 1)]


@dataclass
class JobEndpoint:
    """The target as run.json records it, plus what the load processes need to reach it."""

    name: str
    url: str
    topology: str = "unknown"
    kind: str = "openai"
    model: str | None = None
    gpus: int | None = None
    gpu_hour_cost: float | None = None
    api_key_env: str | None = None  # the key itself stays in the environment
    headers: dict = field(default_factory=dict)  # non-secret headers only
    max_context_tokens: int | None = None
    metrics_url: str | None = None
    options: dict = field(default_factory=dict)  # a built-in endpoint's settings (KV geometry)
    engine: str = "auto"

    def record(self) -> EndpointEntry:
        """run.json ``endpoints[]`` entry."""
        return EndpointEntry(name=self.name, topology=self.topology,
                             url=redact.redact_url(self.url), model=self.model, kind=self.kind,
                             gpus=self.gpus, gpu_hour_cost=self.gpu_hour_cost,
                             max_context_tokens=self.max_context_tokens,
                             metrics_url=redact.redact_url(self.metrics_url))


@dataclass
class Job:
    """One Locust run of one endpoint x workload (x closed-loop stage)."""

    endpoint: JobEndpoint
    workload: str  # [workloads.<name>], or module:factory
    workload_specs: dict = field(default_factory=dict)  # name -> spec (JSON), a mix's parts too
    tokenizer: str | None = "builtin"
    seed: int = 0
    pacing: str = "closed"
    stages: list[StagePlan] = field(default_factory=list)
    stage_index: int = 0  # the stage a closed-loop run drives
    max_requests: int | None = None  # the run ends after this many sent (--kvbench-requests)
    gamma_cv: float = 2.0
    max_in_flight: int = 512
    timeout_s: float = 600.0
    drain_s: float = DRAIN_S  # at a stage's end, how long requests in flight may finish
    warm_connections: bool = True
    ignore_eos: bool = False
    # closed-loop sessions (loadgen.plan.sessions): when each request goes ("think",
    # "timestamps", "api_scaled") and the factor on every recorded time
    replay: str = "think"
    time_scale: float = 1.0
    # the header every request of a session carries (its session id; "": none), and whether
    # the body's ``user`` field carries it too (routers pin sessions on either)
    session_header: str = "X-Session-ID"
    session_user: bool = False
    cache: str = "as-is"  # the prefix-cache state kvbench run starts the job from (runs.cache)
    slo: dict[str, SLO] = field(default_factory=dict)  # by request class
    run_id: str = ""
    results_dir: str = "results"
    profile: str | None = None
    suite: str = "locust"
    config: dict = field(default_factory=dict)  # BenchConfig.public_dump() for run.json
    search: SearchSpec | None = None  # pacing "search": its settings (durations scaled)
    secret_headers: dict = field(default_factory=dict, repr=False)  # never written to a file

    @property
    def run_dir(self) -> Path:
        return Path(self.results_dir) / self.run_id

    def headers(self) -> dict:
        """Every header a request carries (API key from its environment variable)."""
        from kvbench.runs.auth import auth_headers

        ep = self.endpoint
        return auth_headers({**ep.headers, **self.secret_headers}, ep.api_key_env,
                            f"endpoint {ep.name!r}")

    def label(self) -> str:
        """``test x mix (ladder: poisson at 5,15 req/s, 3 s)`` for progress lines."""
        head = f"{self.endpoint.name} x {self.workload}"
        if self.pacing == "search":
            start = (f"{self.search.start_users} users" if self.search.closed
                     else f"{self.search.start_rps:g} req/s")
            return (f"{head} ({self.profile}: capacity search from {start}, "
                    f"budget {self.search.budget_s:g} s)")
        if self.pacing == "closed":
            st = self.stages[self.stage_index]
            return (f"{head} ({self.profile} stage {self.stage_index + 1}/{len(self.stages)}: "
                    f"{st.users} users, {st.duration_s:g} s)")
        rates = ",".join(f"{s.rate_rps:g}" for s in self.stages if s.rate_rps is not None)
        return (f"{head} ({self.profile}: {self.pacing}"
                + (f" at {rates} req/s" if rates else "")
                + f", {sum(s.duration_s for s in self.stages):g} s)")

    def file_name(self) -> str:
        """``job-<endpoint>-<workload>-<stage|all>.json``: the job file's name in its run."""
        stage = self.stage_index if self.pacing == "closed" else "all"
        return "job-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in
                                f"{self.endpoint.name}-{self.workload}-{stage}") + ".json"

    def build_workload(self, tokenizer=None):
        """The workload generator from the job's own spec(s): no config is read."""
        if ":" in self.workload:
            return load_factory(self.workload)()
        from kvbench.workloads.registry import make_from_specs, tables_adapter
        from kvbench.workloads.tokenizer import get_tokenizer

        specs = tables_adapter().validate_python(self.workload_specs)
        tok = tokenizer if tokenizer is not None else get_tokenizer(self.tokenizer)
        return make_from_specs(self.workload, specs, self.seed, tok)

    # -- the job file
    def to_dict(self) -> dict:
        """The job file's JSON: stages, SLOs and the search as the contract serialises them."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "secret_headers"}
        d.update(endpoint=asdict(self.endpoint), stages=[s.to_dict() for s in self.stages],
                 slo={k: v.to_dict() for k, v in self.slo.items()},
                 search=self.search.to_dict() if self.search is not None else None)
        return redact.redact_obj(d)  # no URL password (the client never sends one) or secret

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        d = dict(d)
        d["endpoint"] = JobEndpoint(**d["endpoint"])
        d["stages"] = [StagePlan.from_dict(s) for s in d.get("stages", [])]
        d["slo"] = slo_map(d.get("slo"))
        search = d.pop("search", None)
        d["search"] = SearchSpec.from_dict(search) if search is not None else None
        d.pop("secret_headers", None)
        return cls(**d)

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # --processes workers race
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))
        os.replace(tmp, path)
        return path

    def secret_env(self) -> dict:
        """Environment for the child that loads this job's file (its secret header values)."""
        return {SECRET_HEADERS_ENV: json.dumps(self.secret_headers)} if self.secret_headers \
            else {}

    @classmethod
    def load(cls, path: Path | str, environ=os.environ) -> "Job":
        try:
            job = cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise UserError(f"--kvbench-job {path}: not a readable job file ({exc}); kvbench "
                            "run writes them, or pass --kvbench-config instead") from None
        secret = environ.get(SECRET_HEADERS_ENV)
        if secret:
            job.secret_headers = json.loads(secret)
        for v in job.secret_headers.values():  # this process writes text: know its secrets
            redact.add_header(v)
        if job.endpoint.api_key_env:
            redact.add(environ.get(job.endpoint.api_key_env))
        redact.add_url(job.endpoint.url)
        return job


# --------------------------------------------------------------------------- resolving

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


def first_model(url: str) -> str:
    """The first model the server's /v1/models lists."""
    try:
        from kvbench.runs.preflight import http_json  # bounded: a never-ending answer is cut

        data = http_json(url + "/v1/models", timeout=10)
        return data["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - any failure means: tell the user
        raise UserError(unreachable(url, exc) or f"{url}/v1/models did not name a model "
                        f"({exc}); pass --kvbench-model") from None


def unreachable(url: str, exc: BaseException) -> str | None:
    """The sentence for a target nobody answers at (refused, or a name that does not resolve),
    or None: the fix is the server or --host, never the model."""
    import socket

    why = getattr(exc, "reason", exc)  # urllib wraps the socket's error
    where = urlsplit(url)
    port = where.port or (443 if where.scheme == "https" else 80)
    if isinstance(why, ConnectionRefusedError) or "ConnectionRefusedError" in str(why):
        return (f"connection refused at {where.hostname}:{port}: is the server running? start "
                f"it, or fix --host ({redact.redact_url(url)})")
    if isinstance(why, socket.gaierror) or str(why).startswith("gaierror"):
        return (f"the host name {where.hostname!r} of {redact.redact_url(url)} does not resolve: "
                "fix --host")
    return None


def workload_specs(cfg, name: str) -> dict:
    """``{name: spec}`` as JSON, with a mix's component specs."""
    spec = cfg.workloads[name]
    out = {name: spec.model_dump(mode="json", by_alias=True)}
    for c in getattr(spec, "components", None) or ():
        out[c.workload] = cfg.workloads[c.workload].model_dump(mode="json", by_alias=True)
    return out


def _secret_headers(cfg, ep) -> dict:
    """The header values ``public_dump`` masks (the one rule of what looks like a credential)."""
    if not getattr(ep, "headers", None):
        return {}
    for pub in cfg.public_dump().get("endpoints", []):
        if pub.get("name") == ep.name:
            shown = pub.get("headers") or {}
            return {k: v for k, v in ep.headers.items() if shown.get(k) != v}
    return {}


def _profile(cfg, name: str | None, where: str):
    name = name or (cfg.suite.profile if cfg is not None else None)
    if cfg is None or not name:
        return None, None
    if name not in cfg.profiles:
        raise UserError(f"--kvbench-profile {name}: not a [profiles.*] table of {where}; use "
                        f"one of {sorted(cfg.profiles)}")
    return name, cfg.profiles[name]


def resolve(cfg, *, workload: str, endpoint: str | None = None, url: str | None = None,
            topology: str | None = None, model: str | None = None,
            api_key_env: str | None = None, max_context_tokens: int | None = None,
            profile: str | None = None, pacing: str | None = None,
            stages: list[StagePlan] | None = None, stage_index: int = 0,
            duration_scale: float = 1.0, gamma_cv: float | None = None,
            max_in_flight: int | None = None, timeout_s: float | None = None,
            cold_connections: bool = False, ignore_eos: bool = False, run_id: str = "",
            max_requests: int | None = None, replay: str | None = None,
            time_scale: float | None = None, session_header: str | None = None,
            session_user: bool = False,
            results_dir: str | Path = "results", lookup_model: bool = True,
            where: str = "the config") -> Job:
    """The job of ``workload`` on ``endpoint`` under ``profile`` of ``cfg`` (None: the
    locustfile defaults); explicit arguments win over the config. ``stages`` given replace the
    profile's; the profile's are scaled by ``duration_scale``."""
    ep = None
    if cfg is not None and endpoint:
        try:
            ep = cfg.endpoint(endpoint)
        except KeyError:
            raise UserError(f"--kvbench-endpoint {endpoint}: no such [[endpoints]] name in "
                            f"{where}") from None
    host = url or getattr(ep, "url", None)
    if not host:
        raise UserError("no target: pass --host http://HOST:PORT (or --kvbench-endpoint of "
                        "an openai endpoint with a url)")
    host = host.rstrip("/")
    redact.add_url(host)  # a password in --host is a secret too
    specs: dict = {}
    cfg_eff = cfg
    if ":" not in workload:
        cfg_eff = cfg or default_config(host, workload)
        if workload not in cfg_eff.workloads:
            raise UserError(f"--kvbench-workload {workload}: not a [workloads.*] table of "
                            f"{where}; use one of {sorted(cfg_eff.workloads)}")
        specs = workload_specs(cfg_eff, workload)
    prof_name, prof = _profile(cfg, profile, where)
    search = None
    if prof is not None and prof.pacing == "search":
        search = SearchSpec.from_dict(prof.search.model_dump(mode="json"))
        search = search.replace(**{k: getattr(search, k) * duration_scale
                                   for k in ("probe_s", "max_probe_s", "budget_s", "settle_s",
                                             "hold_s")})
        stages = stages or [
            StagePlan(0, search.budget_s, users=search.start_users)
            if search.closed else StagePlan(0, search.budget_s, search.start_rps)]
    if stages is None:
        stages = ([s.plan(i, duration_scale) for i, s in enumerate(prof.stages)]
                  if prof is not None else [StagePlan(0, FOREVER_S)])
    warm = (prof.warmup_connections if prof else True) and not cold_connections
    name = endpoint or urlsplit(host).netloc
    if not model:
        model = getattr(ep, "model", None) or (first_model(host) if lookup_model else None)
    job_ep = JobEndpoint(
        name=name, url=host, topology=topology or getattr(ep, "topology", None) or "unknown",
        kind=getattr(ep, "kind", "openai"), model=model, gpus=getattr(ep, "gpus", None),
        gpu_hour_cost=getattr(ep, "gpu_hour_cost", None),
        api_key_env=api_key_env or getattr(ep, "api_key_env", None),
        headers={}, max_context_tokens=max_context_tokens or getattr(
            ep, "max_context_tokens", None),
        metrics_url=getattr(ep, "metrics_url", None), options=dict(getattr(ep, "options", {})
                                                                   or {}),
        engine=getattr(ep, "engine", "auto"))
    secret = _secret_headers(cfg, ep) if ep is not None else {}
    job_ep.headers = {k: v for k, v in (getattr(ep, "headers", None) or {}).items()
                      if k not in secret}
    return Job(
        endpoint=job_ep, workload=workload, workload_specs=specs,
        tokenizer=cfg_eff.suite.tokenizer if cfg_eff is not None else None,
        seed=cfg.suite.seed if cfg is not None else 0,
        pacing=pacing or (prof.pacing if prof else "closed"), stages=list(stages),
        stage_index=stage_index, max_requests=max_requests, gamma_cv=gamma_cv or (prof.gamma_cv if prof else 2.0),
        max_in_flight=max_in_flight or (prof.max_in_flight if prof else 512),
        timeout_s=timeout_s or (prof.request_timeout_s if prof else 600.0),
        drain_s=prof.drain_s if prof is not None else DRAIN_S,
        warm_connections=warm, ignore_eos=ignore_eos,
        replay=replay or (prof.replay if prof else "think"),
        time_scale=time_scale or (prof.time_scale if prof else 1.0),
        session_header=(session_header if session_header is not None else
                        (prof.session_header if prof else "X-Session-ID")),
        session_user=session_user or (prof.session_user if prof else False),
        cache=(getattr(prof, "cache", None) or (cfg.suite.cache if cfg is not None else None)
               or "as-is"),
        slo=slo_map({k: v.model_dump(mode="json")
                     for k, v in (cfg_eff.slo if cfg_eff else {}).items()}),
        run_id=run_id or new_run_id(cfg.suite.name if cfg is not None else "locust"),
        results_dir=str(results_dir), profile=prof_name, search=search,
        suite=cfg_eff.suite.name if cfg_eff is not None else "locust",
        config=cfg_eff.public_dump() if cfg_eff is not None else {}, secret_headers=secret)
