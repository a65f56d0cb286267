"""``[[endpoints]]``: the built-in reference endpoints and any OpenAI-compatible server."""

from __future__ import annotations

import os
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from kvbench import engines
from kvbench.core import redact
from kvbench.model import topologies
from kvbench.workloads.specs import MAX_TOKENS, Name, Strict

DEFAULT_CONTEXT_TOKENS = 131072
MAX_GPUS = 100_000  # GPUs behind one endpoint: the largest clusters built
MAX_GPU_HOUR_COST = 10_000.0  # dollars per GPU-hour: a hundred times any cloud list price


class BuiltinEndpoint(Strict):
    """A built-in reference endpoint that ``kvbench run`` starts on a free loopback port."""

    kind: Literal["builtin"] = "builtin"
    name: Name
    topology: str  # a registered topology (kvbench.model.topologies)
    options: dict = Field(default_factory=dict)  # endpoints.config settings (see kvbench serve)
    max_context_tokens: int = Field(default=DEFAULT_CONTEXT_TOKENS, gt=0, le=MAX_TOKENS)
    model: str = "kvbench-llama-3-70b"
    gpu_hour_cost: float | None = Field(default=None, ge=0, le=MAX_GPU_HOUR_COST,
                                         strict=True)  # a number: false is no price
    # Derived from the topology and its options (``endpoints.config.gpu_count``); a value
    # written in bench.toml must agree with it (it documents, never overrides, the topology).
    gpus: int | None = Field(default=None, gt=0, le=MAX_GPUS, validate_default=True)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: int | None, info) -> int:
        from pydantic import ValidationError

        from kvbench.endpoints.config import gpu_count, validate_options

        topology, options = info.data.get("topology"), info.data.get("options")
        if topology is None or options is None:  # reported as their own errors
            return v or 1
        try:
            n, how = gpu_count(validate_options(topology, options))
        except ValidationError:  # bad options: the config's cross-check names them
            return v or 1
        if v is not None and v != n:
            raise ValueError(f"gpus = {v} but this {topology} endpoint runs {n} GPU"
                             f"{'s' * (n != 1)}: {how}; remove gpus (the built-in endpoints "
                             "derive it from their topology) or change those options")
        return n

    @field_validator("topology", mode="before")
    @classmethod
    def _topology(cls, v):
        return topologies.accept(v)


class OpenAIEndpoint(Strict):
    """Any OpenAI-compatible server the user runs (vLLM, SGLang, Dynamo, a vendor...)."""

    kind: Literal["openai"] = "openai"
    name: Name
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first model /v1/models lists
    # A label for the reports: a registered topology's name or "unknown"; nothing is emulated.
    topology: str = "unknown"
    api_key_env: str | None = None  # name of the environment variable holding the key
    max_context_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKENS)  # None: /v1/models
    metrics_url: str | None = None  # engine /metrics to scrape; None: <url>/metrics
    headers: dict[str, str] = Field(default_factory=dict, max_length=100)
    gpu_hour_cost: float | None = Field(default=None, ge=0, le=MAX_GPU_HOUR_COST,
                                         strict=True)  # a number: false is no price
    gpus: int = Field(default=1, gt=0, le=MAX_GPUS)
    engine: str = "auto"  # engine family (kvbench.engines); "auto": detected from /metrics

    @model_validator(mode="after")
    def _url(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url[:60]!r} must start with http:// or https://")
        return self

    @model_validator(mode="after")
    def _secrets(self):
        """Register this endpoint's secrets (header values, URL password, the key in
        ``api_key_env``) so whatever this process writes has them redacted."""
        for v in self.headers.values():
            redact.add_header(v)
        redact.add_url(self.url)
        redact.add_url(self.metrics_url)
        if self.api_key_env:
            redact.add(os.environ.get(self.api_key_env))
        return self

    @field_validator("topology", mode="before")
    @classmethod
    def _topology(cls, v):
        return topologies.accept(v, labels=("unknown",))

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        names = sorted(a.name for a in engines.adapters())
        if v != "auto" and v not in names:
            raise ValueError(f"engine {v[:40]!r} is not a known engine family; use \"auto\" or one "
                             f"of {', '.join(names)}")
        return v


EndpointSpec = Annotated[Union[BuiltinEndpoint, OpenAIEndpoint], Field(discriminator="kind")]
ENDPOINT_KINDS = ("builtin", "openai")
