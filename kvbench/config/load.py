"""``[profiles.<name>]``: how requests are paced, stage by stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvbench.core.contract import StagePlan
from kvbench.workloads.specs import MAX_REQUESTS, MAX_SECONDS, Name, Strict

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
    # the stage ends once this many requests were sent (all processes together), or at
    # duration_s, whichever comes first: a run of exactly N requests is reproducible
    requests: int | None = Field(default=None, gt=0, le=MAX_REQUESTS)
    # closed loop only: the [workloads.<name>] this stage sends instead of the suite's (a
    # designed experiment such as [profiles.calibrate]: each stage one request shape); given
    # on one stage, given on all, and the profile runs once per endpoint, not per workload
    workload: Name | None = None

    def plan(self, index: int, duration_scale: float = 1.0) -> StagePlan:
        """This stage as the job plans it: ``index`` in its profile, the duration scaled."""
        return StagePlan(index, self.duration_s * duration_scale, self.rate_rps, self.users,
                         self.requests)


class SearchSpec(Strict):
    """``[profiles.<name>] pacing = "search"``: the capacity search (``kvbench.runs.search``).
    Open loop: Poisson probes from ``start_rps``, times ``growth`` to the first failing probe,
    then geometric bisection until the bracket is within ``precision``; a probe whose bootstrap
    interval straddles ``target`` is run again ``refine`` times (its requests pooled); with
    ``confirm``, the capacity's rate is probed again before it is claimed. ``loop = "closed"``
    searches the number of users instead (``start_users`` to ``max_users``)."""

    start_rps: float = Field(default=1.0, gt=0, le=1e6)
    growth: float = Field(default=2.0, gt=1, le=100)
    target: float = Field(default=0.95, gt=0, lt=1)  # SLO attainment every class must reach
    confidence: float = Field(default=0.95, gt=0.5, lt=1)  # of the bootstrap interval
    probe_s: float = Field(default=10.0, gt=0, le=3600)  # a probe's shortest load
    min_requests: int = Field(default=30, ge=1, le=1_000_000)  # probe long enough for these
    max_probe_s: float = Field(default=120.0, gt=0, le=3600)
    min_class_requests: int = Field(default=5, ge=1, le=100_000)  # fewer: a class cannot pass
    refine: int = Field(default=1, ge=0, le=10)
    # Before claiming its capacity, probe the highest passing rate once more (requests pooled)
    # when it passed on one probe: misses come in queue bursts, and one short probe can fall
    # between two bursts and pass a rate the endpoint does not sustain (bench/search_truth.py).
    confirm: bool = True
    precision: float = Field(default=0.1, gt=0, le=10)  # stop when fail / pass - 1 <= this
    budget_s: float = Field(default=300.0, gt=0, le=MAX_SECONDS)  # per endpoint x workload
    max_rps: float = Field(default=10_000.0, gt=0, le=1e6)
    min_rps: float = Field(default=0.05, gt=0, le=1e6)
    settle_s: float = Field(default=30.0, ge=0, le=3600)  # most to wait for a probe's stragglers
    # A probe lasts at least this many mean response times of the last passing rate (and the
    # records' lag), so its second half shows whether its backlog settled; 0: no such floor
    steady_residences: float = Field(default=3.0, ge=0, le=100)
    # Load at start_rps for this long before the first judged probe (a stage of role
    # "warmup", never judged): caches, batches and queues reach the state the probes measure
    warmup_s: float = Field(default=0.0, ge=0, le=3600)
    # The hold: once the bracket is within ``precision``, the capacity it points to (the
    # crossing) is held for at least ``hold_s`` and three mean response times before it is
    # claimed: it holds when no backlog grows over its second half and its attainment
    # estimate meets the target; a hold that fails is tried again ``hold_step`` times lower.
    # A short probe sees a rate's first seconds: an endpoint with free KV memory keeps its
    # first tokens fast for tens of seconds above what it sustains. 0: no hold (the
    # highest pass is confirmed by one more probe instead)
    hold_s: float = Field(default=0.0, ge=0, le=3600)
    hold_step: float = Field(default=0.85, gt=0, lt=1)
    # the holds bisect between the highest held and the lowest failed until within this
    hold_precision: float = Field(default=0.1, gt=0, le=10)
    # "closed": the highest number of users at SLO instead of the highest rate. Each user runs
    # one session at a time and waits for every answer (think times as the workload says);
    # probes of start_users, times growth (one more at least) to the first failure, then
    # bisection to one user or ``precision``; a probe never outruns the endpoint, so the
    # saturation cuts of the open loop do not apply (its SLO verdict still cuts a failure)
    loop: Literal["open", "closed"] = "open"
    start_users: int = Field(default=1, ge=1, le=100_000)
    max_users: int = Field(default=1024, ge=1, le=100_000)

    @model_validator(mode="after")
    def _loop(self):
        given = self.model_fields_set
        wrong = (("start_rps", "max_rps", "min_rps") if self.loop == "closed"
                 else ("start_users", "max_users"))
        for name in wrong:
            if name in given:
                other = "start_users/max_users" if self.loop == "closed" else \
                    "loop = \"closed\""
                raise ValueError(f"search.{name} does not apply to a search with loop = "
                                 f"\"{self.loop}\"; remove it, or use {other}")
        if self.loop == "closed" and self.start_users > self.max_users:
            raise ValueError(f"search.start_users ({self.start_users}) is above max_users "
                             f"({self.max_users}); lower start_users or raise max_users")
        return self


class LoadProfile(Strict):
    """How requests are paced. ``closed``: Locust users, one per session, each waiting for its
    response. ``poisson``/``gamma``/``constant``: open loop at ``rate_rps`` per stage.
    ``trace``: the workload's own arrival times."""

    pacing: Literal["closed", "poisson", "gamma", "constant", "trace", "search"] = "closed"
    stages: list[Stage] = Field(default_factory=list, max_length=1000)  # search: none
    search: SearchSpec | None = None  # pacing = "search": its settings (defaults if absent)
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
    # Closed-loop sessions (issue 36): when each request of a session goes. "think": the
    # recorded think time after the previous answer; "timestamps": at the session's start plus
    # the recorded send time (late ones at once, their lateness recorded); "api_scaled": the
    # recorded gap (the previous answer's server time plus the think time) from the previous
    # send. ``time_scale`` multiplies every recorded time (0.1: ten times faster).
    replay: Literal["think", "timestamps", "api_scaled"] = "think"
    time_scale: float = Field(default=1.0, gt=0, le=1000)
    # Session affinity: the header carrying each request's session id ("": none sent), and
    # whether the body's ``user`` field carries it too (what real routers pin on)
    session_header: str = Field(default="X-Session-ID", max_length=128,
                                pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]*$")
    session_user: bool = False

    @model_validator(mode="after")
    def _stages(self):
        if self.pacing == "search":
            if self.stages:
                raise ValueError("a search profile plans its own probes; remove stages")
            if self.search is None:
                self.search = SearchSpec()
            return self
        if self.search is not None:
            raise ValueError("search settings need pacing = \"search\"; remove search")
        if not self.stages:
            raise ValueError("stages needs at least one stage; add stages = [...]")
        named = [st.workload is not None for st in self.stages]
        if any(named) and self.pacing != "closed":
            raise ValueError("stages name workloads only with pacing = \"closed\" (each "
                             "stage its own run); remove workload or use closed pacing")
        if any(named) and not all(named):
            raise ValueError("some stages name a workload and some do not; give every stage "
                             "its workload, or none")
        for i, st in enumerate(self.stages):
            if self.pacing == "closed" and st.users is None:
                raise ValueError(f"stages[{i}] needs users for closed-loop pacing; set users")
            if self.pacing in ("poisson", "gamma", "constant") and st.rate_rps is None:
                raise ValueError(f"stages[{i}] needs rate_rps for {self.pacing} pacing; "
                                 "set rate_rps")
        return self

    def stage_workloads(self) -> list[str]:
        """The workloads the stages name, in stage order (empty: the suite's workloads)."""
        return [st.workload for st in self.stages if st.workload is not None]
