"""``[profiles.<name>]``: how requests are paced, stage by stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvbench.workloads.specs import MAX_SECONDS, Strict

# The prefix-cache state a run starts from (``runs.cache``): "reset" empties the engine's cache
# through its own API (fresh prefixes where it has none), "warm" resets then sends each shared
# prefix once, unrecorded, "as-is" touches nothing (whatever earlier traffic left).
CacheMode = Literal["reset", "warm", "as-is"]


class Stage(Strict):
    duration_s: float = Field(gt=0, le=MAX_SECONDS)  # a week: longer soaks are several runs
    # open loop; a million req/s is past any one load host (Locust sends thousands per core)
    rate_rps: float | None = Field(default=None, gt=0, le=1e6)
    # closed loop; 100,000 users is already a large distributed Locust swarm
    users: int | None = Field(default=None, gt=0, le=100_000)


class LoadProfile(Strict):
    """How requests are paced. ``closed``: Locust users, one per session, each waiting for its
    response. ``poisson``/``gamma``/``constant``: open loop at ``rate_rps`` per stage.
    ``trace``: the workload's own arrival times."""

    pacing: Literal["closed", "poisson", "gamma", "constant", "trace"] = "closed"
    stages: list[Stage] = Field(min_length=1, max_length=1000)
    # coefficient of variation of gaps (burstiness); real traces measure below 10
    gamma_cv: float = Field(default=2.0, gt=0, le=100)
    max_in_flight: int = Field(default=512, gt=0, le=1_000_000)  # sockets one host can open
    request_timeout_s: float = Field(default=600.0, gt=0, le=86400)  # whole-request deadline
    warmup_connections: bool = True
    # At the end of each stage (closed loop) or of the last stage (open loop), how long requests
    # in flight may finish before they are cancelled; cancelled ones are recorded as
    # ``cancelled`` and kept out of error rate and latency.
    drain_s: float = Field(default=30.0, ge=0, le=3600)
    cache: CacheMode | None = None  # None: suite.cache

    @model_validator(mode="after")
    def _stages(self):
        for i, st in enumerate(self.stages):
            if self.pacing == "closed" and st.users is None:
                raise ValueError(f"stages[{i}] needs users for closed-loop pacing; set users")
            if self.pacing in ("poisson", "gamma", "constant") and st.rate_rps is None:
                raise ValueError(f"stages[{i}] needs rate_rps for {self.pacing} pacing; "
                                 "set rate_rps")
        return self
