"""The whole bench.toml: composed of each concern's own spec (workload kinds from the workloads
registry, endpoints, load profiles and a twin's fit here, SLOs and gate rules from the
reports, collection from the collectors)."""

from __future__ import annotations

from pydantic import Field, SerializeAsAny, field_validator

from kvbench.collectors.spec import CollectConfig
from kvbench.config.endpoints import EndpointSpec
from kvbench.config.load import CacheMode, LoadProfile
from kvbench.config.storage import HistorySpec, StorageSpec
from kvbench.config.twin import TwinSpec
from kvbench.core import redact
from kvbench.reports.measures.spec import SLO, GateConfig
from kvbench.workloads import registry
from kvbench.workloads.specs import KindSpec, Name, Strict

MAX_TABLES = 1000  # endpoints, workloads or profiles in one suite: a matrix of a million jobs


class SuiteConfig(Strict):
    name: Name = "default"  # part of every run id and results folder
    seed: int = 0
    tokenizer: str = "builtin"  # "builtin" or a path to tokenizer.json
    results_dir: str = "results"
    # which [workloads.*] to run; None: all but mix parts
    workloads: list[Name] | None = Field(default=None, max_length=MAX_TABLES)
    profile: Name | None = None  # which [profiles.*] to run; None: all
    cache: CacheMode = "as-is"  # the cache state each run starts from; a profile's wins
    # "HOST:PORT" of a local OTLP/HTTP trace receiver kvbench run opens for the engines' spans
    # (vLLM --otlp-traces-endpoint http://HOST:PORT/v1/traces); None: no receiver
    otlp_listen: str | None = None
    # Run each endpoint's jobs in a thread of its own, the endpoints at once (one host; not
    # with --workers): a bake-off of N endpoints takes about 1/N of the time. The host then
    # carries N load processes (and N built-in endpoints): the loop-lag and lateness figures
    # say whether it kept up.
    parallel_endpoints: bool = False

    @field_validator("results_dir")
    @classmethod
    def _local(cls, v: str) -> str:
        from kvbench.core.paths import results_dir_problem

        why = results_dir_problem(v, remote_ok=True)
        if why:
            raise ValueError(why)
        return v

    @field_validator("otlp_listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        host, _, port = (v or "").rpartition(":")
        if v is not None and not (host and port.isdigit() and int(port) < 65536):
            raise ValueError(f"otlp_listen {v[:60]!r} is not HOST:PORT; write e.g. "
                             "\"127.0.0.1:4318\"")
        return v


class BenchConfig(Strict):
    suite: SuiteConfig = SuiteConfig()
    endpoints: list[EndpointSpec] = Field(min_length=1, max_length=MAX_TABLES)
    # each table validated as the spec of its kind among the kinds registered at validation
    workloads: dict[Name, SerializeAsAny[KindSpec]] = Field(min_length=1,
                                                            max_length=MAX_TABLES)
    profiles: dict[Name, LoadProfile] = Field(min_length=1, max_length=MAX_TABLES)
    # keys: request classes of the configured workloads (checked across sections at load)
    slo: dict[str, SLO] = Field(default_factory=dict)
    gate: GateConfig = GateConfig()
    collect: CollectConfig = CollectConfig()
    storage: StorageSpec = StorageSpec()  # an s3:// results_dir's store (config.storage)
    history: HistorySpec = HistorySpec()  # retention of the store's history (config.storage)
    # what kvbench calibrate fitted (config.twin): read by kvbench predict; None: no fit
    twin: TwinSpec | None = None

    @field_validator("workloads", mode="before")
    @classmethod
    def _kinds(cls, v):
        return registry.tables_adapter().validate_python(v)

    def public_dump(self) -> dict:
        """The resolved config for run.json and reports: every header value masked (names
        kept; any header may carry a credential) and every known secret and URL userinfo
        redacted (keys belong in the environment, never in results)."""
        return redact.public_config(self.model_dump(mode="json", by_alias=True))

    def endpoint(self, name: str):
        for ep in self.endpoints:
            if ep.name == name:
                return ep
        raise KeyError(name)
