"""bench.toml: the suite's schema, validated into typed objects before any load is sent.

Every error is one sentence naming the file, the field and the fix, raised as ``UserError``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import ConfigDict, Field, ValidationError, model_validator

from kvbench.core.errors import UserError
from kvbench.workloads.specs import (
    MixSpec,
    Strict,
    WorkloadSpec,
    max_output_upper,
    max_prompt_upper,
)

DEFAULT_CONTEXT_TOKENS = 131072


class BuiltinEndpoint(Strict):
    """A built-in reference endpoint that ``kvbench run`` starts on a free loopback port."""

    kind: Literal["builtin"] = "builtin"
    name: str
    topology: Literal["colocated", "disaggregated", "offloaded", "routed"]
    options: dict = Field(default_factory=dict)  # endpoints.config settings (see kvbench serve)
    max_context_tokens: int = Field(default=DEFAULT_CONTEXT_TOKENS, gt=0)
    model: str = "kvbench-llama-3-70b"
    gpu_hour_cost: float | None = Field(default=None, ge=0)
    gpus: int = Field(default=1, gt=0)


class OpenAIEndpoint(Strict):
    """Any OpenAI-compatible server the user runs (vLLM, SGLang, Dynamo, a vendor...)."""

    kind: Literal["openai"] = "openai"
    name: str
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first model /v1/models lists
    topology: Literal["colocated", "disaggregated", "offloaded", "routed", "unknown"] = "unknown"
    api_key_env: str | None = None  # name of the environment variable holding the key
    max_context_tokens: int | None = Field(default=None, gt=0)  # None: from /v1/models
    metrics_url: str | None = None  # engine /metrics to scrape; None: <url>/metrics
    headers: dict[str, str] = Field(default_factory=dict)
    gpu_hour_cost: float | None = Field(default=None, ge=0)
    gpus: int = Field(default=1, gt=0)

    @model_validator(mode="after")
    def _url(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r} must start with http:// or https://")
        return self


EndpointSpec = Annotated[Union[BuiltinEndpoint, OpenAIEndpoint], Field(discriminator="kind")]


class Stage(Strict):
    duration_s: float = Field(gt=0)
    rate_rps: float | None = Field(default=None, gt=0)  # open loop
    users: int | None = Field(default=None, gt=0)  # closed loop


class LoadProfile(Strict):
    """How requests are paced. ``closed``: Locust users, one per session, each waiting for its
    response. ``poisson``/``gamma``/``constant``: open loop at ``rate_rps`` per stage.
    ``trace``: the workload's own arrival times."""

    pacing: Literal["closed", "poisson", "gamma", "constant", "trace"] = "closed"
    stages: list[Stage] = Field(min_length=1)
    gamma_cv: float = Field(default=2.0, gt=0)  # coefficient of variation of gaps (burstiness)
    max_in_flight: int = Field(default=512, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)  # whole-request deadline
    warmup_connections: bool = True

    @model_validator(mode="after")
    def _stages(self):
        for i, st in enumerate(self.stages):
            if self.pacing == "closed" and st.users is None:
                raise ValueError(f"stages[{i}] needs users for closed-loop pacing; set users")
            if self.pacing in ("poisson", "gamma", "constant") and st.rate_rps is None:
                raise ValueError(f"stages[{i}] needs rate_rps for {self.pacing} pacing; "
                                 "set rate_rps")
        return self


class SLO(Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)


class GateRule(Strict):
    metric: str  # e.g. ttft_p99, tpot_p50, e2e_p95, goodput_rps, error_rate
    request_class: str = Field(default="*", alias="class")
    endpoint: str = "*"
    max_increase_pct: float | None = Field(default=None, ge=0)
    max_decrease_pct: float | None = Field(default=None, ge=0)
    max_value: float | None = None  # absolute ceiling, in the metric's own unit

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _one(self):
        given = [x for x in (self.max_increase_pct, self.max_decrease_pct, self.max_value)
                 if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of max_increase_pct, max_decrease_pct, max_value")
        return self


class GateConfig(Strict):
    rules: list[GateRule] = Field(default_factory=list)
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    bootstrap_resamples: int = Field(default=1000, ge=100)


class GpuRole(Strict):
    host: str = "*"
    gpus: list[int] = Field(default_factory=list)  # empty: all GPUs of that host
    role: Literal["prefill", "decode", "colocated", "cache"]


class CollectConfig(Strict):
    nvml: bool = True
    nvml_interval_s: float = Field(default=0.1, gt=0)
    scrape_interval_s: float = Field(default=1.0, gt=0)
    agents: list[str] = Field(default_factory=list)  # remote `kvbench collect` URLs
    agent_token_env: str | None = None
    roles: list[GpuRole] = Field(default_factory=list)


class SuiteConfig(Strict):
    name: str = "default"
    seed: int = 0
    tokenizer: str = "builtin"  # "builtin" or a path to tokenizer.json
    results_dir: str = "results"
    workloads: list[str] | None = None  # which [workloads.*] to run; None: all but mix parts
    profile: str | None = None  # which [profiles.*] to run; None: all


class BenchConfig(Strict):
    suite: SuiteConfig = SuiteConfig()
    endpoints: list[EndpointSpec] = Field(min_length=1)
    workloads: dict[str, WorkloadSpec] = Field(min_length=1)
    profiles: dict[str, LoadProfile] = Field(min_length=1)
    slo: dict[str, SLO] = Field(default_factory=dict)
    gate: GateConfig = GateConfig()
    collect: CollectConfig = CollectConfig()

    def public_dump(self) -> dict:
        """The resolved config for run.json and reports, with header values that look like
        credentials masked (keys belong in the environment, never in results)."""
        data = self.model_dump(mode="json", by_alias=True)
        for ep in data.get("endpoints", []):
            for k in list((ep.get("headers") or {})):
                if any(w in k.lower() for w in ("auth", "key", "token", "secret", "cookie")):
                    ep["headers"][k] = "***"
        return data

    def endpoint(self, name: str):
        for ep in self.endpoints:
            if ep.name == name:
                return ep
        raise KeyError(name)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("rag", "agent", "longctx", "chat", "hogwild", "mix", "trace",
                      "builtin", "openai") and out.count(".") >= 1:
            continue  # the discriminator tag pydantic adds; not a field the user wrote
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


_FIXES = {
    "extra_forbidden": "remove it or check its spelling",
    "missing": "add it",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value",
    "union_tag_invalid": "use one of the kinds listed",
    "union_tag_not_found": "add a kind field",
}


def _one_sentence(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    where = _loc(first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    fix = _FIXES.get(first["type"], "")
    more = len(err.errors()) - 1
    tail = f" ({more} more problem{'s' if more > 1 else ''} after this one)" if more else ""
    return f"{path}: field {where}: {msg}{'; ' + fix if fix else ''}{tail}."


def parse_config(data: dict, path: Path | str = "bench.toml") -> BenchConfig:
    path = Path(path)
    try:
        cfg = BenchConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_one_sentence(path, err)) from None
    _cross_checks(cfg, path)
    return cfg


def load_config(path: Path | str = "bench.toml") -> BenchConfig:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found; pass --config with the path of "
                        "your bench.toml") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid TOML ({exc}); fix the syntax at that place") from None
    # Trace paths in a config are relative to the config file, not to the current directory.
    for w in (data.get("workloads") or {}).values():
        if isinstance(w, dict) and w.get("kind") == "trace" and isinstance(w.get("path"), str) \
                and not Path(w["path"]).is_absolute():
            w["path"] = str(path.parent / w["path"])
    return parse_config(data, path)


def _cross_checks(cfg: BenchConfig, path: Path) -> None:
    names = [ep.name for ep in cfg.endpoints]
    for n in names:
        if names.count(n) > 1:
            raise UserError(f"{path}: field endpoints: the name {n!r} is used twice; "
                            "give each endpoint its own name.")
    for wname, spec in cfg.workloads.items():
        if isinstance(spec, MixSpec):
            for i, comp in enumerate(spec.components):
                if comp.workload not in cfg.workloads or comp.workload == wname:
                    raise UserError(
                        f"{path}: field workloads.{wname}.components[{i}].workload: "
                        f"{comp.workload!r} is not another [workloads.*] table; "
                        f"use one of {sorted(set(cfg.workloads) - {wname})}.")
                if isinstance(cfg.workloads[comp.workload], MixSpec):
                    raise UserError(f"{path}: field workloads.{wname}.components[{i}]: a mix "
                                    "cannot contain another mix; list its parts instead.")
    for wname in cfg.suite.workloads or []:
        if wname not in cfg.workloads:
            raise UserError(f"{path}: field suite.workloads: {wname!r} is not defined; add a "
                            f"[workloads.{wname}] table or remove it from the list.")
    if cfg.suite.profile is not None and cfg.suite.profile not in cfg.profiles:
        raise UserError(f"{path}: field suite.profile: {cfg.suite.profile!r} is not defined; "
                        f"use one of {sorted(cfg.profiles)}.")
    for ep in cfg.endpoints:
        ctx = ep.max_context_tokens
        if ctx is None:
            continue
        for wname, spec in cfg.workloads.items():
            out_max = max_output_upper(spec)
            if out_max != float("inf") and out_max >= ctx:
                raise UserError(
                    f"{path}: field workloads.{wname}: max_tokens can reach {int(out_max)}, not "
                    f"below the context of endpoint {ep.name!r} ({ctx} tokens); lower the "
                    "output_tokens max.")
            total = max_prompt_upper(spec) + (0 if out_max == float("inf") else out_max)
            if total != float("inf") and total > ctx:
                raise UserError(
                    f"{path}: field workloads.{wname}: prompts plus outputs can reach "
                    f"{int(total)} tokens, more than the context of endpoint {ep.name!r} "
                    f"({ctx} tokens); lower the token maxima or raise max_context_tokens.")
    if cfg.endpoints and any(ep.kind == "builtin" for ep in cfg.endpoints):
        _validate_builtin_options(cfg, path)


def _validate_builtin_options(cfg: BenchConfig, path: Path) -> None:
    try:
        from kvbench.endpoints.config import validate_options
    except ImportError:  # the emulator's settings are checked when it starts
        return
    for i, ep in enumerate(cfg.endpoints):
        if ep.kind == "builtin":
            try:
                validate_options(ep.topology, ep.options)
            except ValidationError as err:
                first = err.errors()[0]
                raise UserError(
                    f"{path}: field endpoints[{i}].options.{_loc(first['loc'])}: "
                    f"{first['msg'].removeprefix('Value error, ')}; "
                    f"{_FIXES.get(first['type'], 'see kvbench serve --help')}.") from None
