"""The run contract: every piece of a run's metadata as one typed class, written and read as such.
(Above 400 lines: one class per piece of a run's metadata and the strict check generated from
them, kept in one file so that a field is added in one place.)

A stage, an endpoint, a search probe's note, a job's cache state, an SLO, a load process's
sidecar and run.json itself are each one class here. Every writer fills these classes (the
load process, the collectors, the search, ``runs.finalize``), every reader takes them (the
report, the gate, the search, the live view); the job file, the sidecar and run.json are these
classes serialised (``to_dict``) and parsed back (``from_dict``). A field added to a stage is
added to ``StageEntry`` and nowhere else.

Plain dataclasses, so a load process writes its sidecar without importing pydantic; a reader of
a finished run checks a run.json's types first (``check``: pydantic in strict mode, from models
generated from these same classes, so "7" is not an int and true is not a number). Keys this
version does not know (written by another version of the same schema) are kept in ``extra``
and written back as they were.
"""

from __future__ import annotations

import dataclasses as dc
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

# Field kinds, named for the strict check (``check``): to Python they are int and float.
Ns = int  # a time in ns within int64 (epoch or offset), >= 0
Num = float  # a finite number
Count = int  # a whole number >= 0

E = TypeVar("E", bound="Entry")

# endpoint, workload and run names: one plain folder or file name each (the config's
# ``Name``; the load process checks a run id against it without importing pydantic)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class Entry:
    """What every class of the contract shares: ``from_dict``/``to_dict``, nested entries
    typed (``_nested``: field -> (shape, class); shape "one", "list" or "map"), unknown keys
    kept in ``extra``."""

    _nested: ClassVar[dict[str, tuple[str, type]]] = {}
    # fields the strict check refuses as null (others may be null: absent, or not measured)
    _not_null: ClassVar[tuple[str, ...]] = ()
    # what the strict check reads a plain field as, where more than its Python type: a type
    # (``dict[str, int]``) or (shape, class) as in ``_nested``
    _check_as: ClassVar[dict[str, Any]] = {}
    # fields written only when set (``to_dict``), as run.json has always had them
    _only_when_set: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls: type[E], data: dict | None) -> E:
        """The entry of a JSON object (already checked, or written by this version); a field
        given as null takes its default."""
        data = dict(data or {})
        names = {f.name for f in dc.fields(cls)} - {"extra"}
        kw: dict[str, Any] = {}
        for name in names & data.keys():
            value = data[name]
            if value is None:
                continue
            shape, sub = cls._nested.get(name, ("", None))
            if shape == "one" and isinstance(value, dict):
                value = sub.from_dict(value)
            elif shape == "list" and isinstance(value, list):
                value = [sub.from_dict(v) if isinstance(v, dict) else v for v in value]
            elif shape == "map" and isinstance(value, dict):
                value = {k: sub.from_dict(v) if isinstance(v, dict) else v
                         for k, v in value.items()}
            kw[name] = value
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**kw, extra=extra)

    def to_dict(self) -> dict:
        """The JSON object (extra keys first, then the fields; nested entries as objects).
        Every field is written, null where not set, except those of ``_only_when_set``, which
        run.json has only had where they apply (a stage's ``search`` note, a cut stage's
        ``planned_duration_s``): a script reading ``stage.get("planned_duration_s",
        stage["duration_s"])`` reads them as it always did."""
        out = dict(self.extra)
        for f in dc.fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and not (value is None and f.name in self._only_when_set):
                out[f.name] = _plain(value)
        return out

    def replace(self: E, **changes) -> E:
        """A copy with ``changes`` (nested entries shared, ``extra`` copied)."""
        return dc.replace(self, **changes, extra=dict(self.extra))


def _plain(value):
    if isinstance(value, Entry):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- the pieces


@dataclass
class SLO(Entry):
    """One request class's service-level objectives (``[slo.<class>]``), in ms; None: no
    limit on that metric."""

    ttft_ms: Num | None = None
    tpot_ms: Num | None = None
    e2e_ms: Num | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    LIMITS: ClassVar[tuple[str, ...]] = ("ttft_ms", "tpot_ms", "e2e_ms")

    @property
    def judged(self) -> bool:
        """Whether the class has an SLO at all (a limit on at least one metric)."""
        return any(getattr(self, k) is not None for k in self.LIMITS)

    def limits(self) -> dict[str, float]:
        """{metric: limit in ms} of the metrics it limits."""
        return {k: float(v) for k in self.LIMITS if (v := getattr(self, k)) is not None}


def slo_map(data) -> dict[str, SLO]:
    """``{class: SLO}`` from the config's ``[slo.*]`` tables (objects or ``SLO``s)."""
    return {str(k): v if isinstance(v, SLO) else SLO.from_dict(v)
            for k, v in (data or {}).items() if isinstance(v, (dict, SLO))}


@dataclass
class SearchNote(Entry):
    """A capacity search's account of one probe (``runs.search``)."""

    role: str | None = None  # warmup | ramp | refine | bisect | confirm
    verdict: str | None = None  # pass | fail | straddle (None: cut by a stop)
    why: str | None = None
    stop: str | None = None  # "budget": the search ended after this probe
    estimate: bool | None = None  # a straddle decided on its pooled estimate
    target: Num | None = None  # the attainment and confidence it was judged against
    confidence: Num | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _only_when_set: ClassVar = ("stop", "estimate", "target", "confidence")


@dataclass
class SearchSpec(Entry):
    """A capacity search's settings as the job carries them (``Job.search``) to kvbench run's
    driver and the load process's probe feed: the config's ``SearchSpec`` (``config.load``,
    which validates bench.toml and says what each setting means) with its durations scaled, as
    a plain class the load process reads without pydantic. The defaults are the config's."""

    start_rps: Num = 1.0
    growth: Num = 2.0
    target: Num = 0.95
    confidence: Num = 0.95
    probe_s: Num = 10.0
    min_requests: Count = 30
    max_probe_s: Num = 120.0
    min_class_requests: Count = 5
    refine: Count = 1
    confirm: bool = True
    precision: Num = 0.1
    budget_s: Num = 300.0
    max_rps: Num = 10_000.0
    min_rps: Num = 0.05
    settle_s: Num = 30.0
    steady_residences: Num = 3.0
    warmup_s: Num = 0.0
    hold_s: Num = 0.0
    hold_step: Num = 0.85
    hold_precision: Num = 0.1
    loop: str = "open"  # open | closed
    start_users: Count = 1
    max_users: Count = 1024
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def closed(self) -> bool:
        """A closed-loop search: its levels are numbers of users (integers)."""
        return self.loop == "closed"


@dataclass
class StagePlan(Entry):
    """One load stage as planned: open loop at ``rate_rps`` (all processes together) or closed
    loop of ``users``, for ``duration_s`` (already scaled), ended early after ``requests`` sent
    when given. The job carries these, the job file holds them serialised, the pacing runs
    them (a process's own plan carries its share of ``requests``); ``StageEntry.of`` makes
    what ran of one, copying every field the two share by name (so a planned field run.json
    shows is added here and to ``StageEntry``, nowhere else)."""

    index: Count = 0
    duration_s: Num = 0.0
    rate_rps: Num | None = None
    users: Count | None = None
    requests: Count | None = None
    # open loop: exactly rate x duration arrivals, at sorted uniform times (a Poisson process
    # conditioned on its count: its gaps stay random, the count does not wander +-10% over a
    # short stage, as a capacity search's probe needs)
    exact_count: bool = False
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _not_null: ClassVar = ("index", "duration_s")


@dataclass
class StageEntry(Entry):
    """One load stage as it ran: open loop at ``rate_rps``, or closed loop of ``users``."""

    endpoint: str | None = None
    workload: str | None = None
    profile: str | None = None
    index: Count = 0
    pacing: str | None = None
    rate_rps: Num | None = None
    users: Count | None = None
    duration_s: Num | None = None
    t_start_ns: Ns | None = None
    t_end_ns: Ns | None = None  # None: still running (a sidecar's open stage)
    requests: Count | None = None  # the stage's request count as configured, when it has one
    planned_duration_s: Num | None = None  # set with ``partial``: what was planned
    partial: bool | None = None  # a stop cut it before its planned end
    # the load process's largest event-loop pause in the stage (the largest of its
    # processes), and how many pauses were over 5 ms (summed): client lateness per request
    # cannot show a stall that made every stream late together
    loop_pause_max_ms: Num | None = None
    loop_pause_max_offcpu_ms: Num | None = None  # of it, the process not running
    loop_pauses_over_5ms: Count | None = None
    search: SearchNote | None = None  # a capacity search's probe
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _nested: ClassVar = {"search": ("one", SearchNote)}
    _not_null: ClassVar = ("index",)
    _only_when_set: ClassVar = ("requests", "planned_duration_s", "partial", "search",
                                "loop_pause_max_ms", "loop_pause_max_offcpu_ms",
                                "loop_pauses_over_5ms")

    @classmethod
    def of(cls, plan: StagePlan, **ran) -> "StageEntry":
        """The entry of a stage run from ``plan``; ``ran``: what the plan does not say (the
        endpoint, workload, pacing, times, loop pauses), and any of its fields to set apart
        (a process's plan holds its share of ``requests``, the entry the whole count)."""
        names = {f.name for f in dc.fields(cls)} - {"extra"}
        planned = {f.name: getattr(plan, f.name) for f in dc.fields(plan) if f.name in names}
        return cls(**{**planned, **ran})

    @property
    def key(self) -> tuple:
        """(endpoint, workload, index): a stage of a run is one of these."""
        return (self.endpoint, self.workload, self.index)

    def cut(self, t_end_ns: int) -> "StageEntry":
        """This stage stopped at ``t_end_ns`` before its planned end: ``duration_s`` is what
        ran, ``planned_duration_s`` what was planned, ``partial`` set."""
        t_end = max(int(t_end_ns), int(self.t_start_ns or 0))
        planned = (self.planned_duration_s if self.planned_duration_s is not None
                   else self.duration_s)
        return self.replace(t_end_ns=t_end, planned_duration_s=planned, partial=True,
                            duration_s=(t_end - int(self.t_start_ns or 0)) / 1e9)


@dataclass
class EndpointEntry(Entry):
    """An endpoint as run.json records it (no secret: the URL's userinfo redacted)."""

    name: str = ""
    topology: str | None = None
    url: str | None = None
    model: str | None = None
    kind: str | None = None
    gpus: Count | None = None
    gpu_hour_cost: Num | None = None
    max_context_tokens: Count | None = None
    metrics_url: str | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _not_null: ClassVar = ("name",)


@dataclass
class Incomplete(Entry):
    """Something that did not happen as asked, and why."""

    what: str = ""
    why: str = ""
    extra: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class CacheTheory(Entry):
    """The hit ratio a job's requests could reach from the prefixes they share."""

    requests: Count | None = None
    unmatched: Count | None = None
    prompt_tokens: Count | None = None
    hit_ratio_unbounded: Num | None = None
    hit_ratio_lru: Num | None = None
    block_tokens: Count | None = None
    capacity_tokens: Count | None = None  # HBM KV per replica
    after_priming: Count | None = None
    # offload tiers below HBM (DRAM, disk), modelled with it: their KV per replica, or
    # ``tiers_unbounded`` where the engine served hits from tiers whose size it does not publish
    tier_tokens: Count | None = None
    tiers_unbounded: bool | None = None
    # the ratio over only the requests that finished (those whose records hold cached tokens),
    # the cache simulated over every request the engine prefilled
    hit_ratio_finished: Num | None = None
    requests_finished: Count | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _only_when_set: ClassVar = ("tier_tokens", "tiers_unbounded", "hit_ratio_finished",
                                "requests_finished")


@dataclass
class CacheState(Entry):
    """The prefix-cache state one job started from, and the engine's counters around it
    (``runs.cache``)."""

    endpoint: str | None = None
    workload: str | None = None
    profile: str | None = None
    stage: int | None = None  # the closed-loop stage a job drove; None: all of them
    mode: str | None = None  # as-is | reset | warm
    engine: str | None = None  # the engine adapter's family
    reset: dict | None = None  # {done, how | why}
    primed_prefixes: Count = 0
    primed_tokens: Count = 0
    seed: int | None = None
    fresh_seed: bool | None = None  # no reset: the job ran on a seed no earlier run used
    notes: list = field(default_factory=list)
    started_from: str | None = None
    counters_before: dict | None = None  # {hits, queries, prompt, ...}: the engine's own
    counters_after: dict | None = None
    theoretical: CacheTheory | None = None
    t_start_ns: Ns | None = None
    t_end_ns: Ns | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _nested: ClassVar = {"theoretical": ("one", CacheTheory)}


@dataclass
class ProcMeta(Entry):
    """A load process's sidecar, ``proc-<host>-<pid>.json``: what it ran and counted, written
    whole as it goes (a killed process leaves its last one)."""

    counts: dict = field(default_factory=dict)  # {requests_started, records_written, ...}
    stages: list[StageEntry] = field(default_factory=list)
    incomplete: list[Incomplete] = field(default_factory=list)
    open_stage: StageEntry | None = None  # the stage running now
    endpoint: EndpointEntry | None = None
    workload: str | None = None
    worker: str | None = None  # host:pid, the name its records carry
    host: str | None = None
    opened_ns: Ns | None = None
    updated_ns: Ns | None = None
    closed_ns: Ns | None = None
    closed: bool = True  # False: the process has not closed its records (yet, or killed)
    interrupted: str | None = None  # how a signal cut it
    transport: dict | None = None  # a worker's: the master's account of what it sent
    lost: dict | None = None  # a worker the master lost: {missing, why}
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _nested: ClassVar = {"stages": ("list", StageEntry), "incomplete": ("list", Incomplete),
                         "open_stage": ("one", StageEntry), "endpoint": ("one", EndpointEntry)}

    def count(self, name: str) -> int:
        return int(self.counts.get(name, 0) or 0)


@dataclass
class Described(Entry):
    """The keys of a workload's description (``workloads.describe``) that reports read."""

    requests: Count | None = None
    block_tokens: Count | None = None
    capacity_tokens: Count | None = None
    theoretical_hit_ratio_lru: Num | None = None
    theoretical_hit_ratio_unbounded: Num | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class RunConfig(Entry):
    """The parts of run.json's ``config`` (the resolved bench.toml) that readers rely on;
    checked, not kept (``RunMeta.config`` stays the config as resolved)."""

    slo: dict | None = None
    gate: dict | None = None
    suite: dict | None = None
    workloads: dict | None = None
    endpoints: list | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _check_as: ClassVar = {"slo": ("map", SLO), "endpoints": list[dict]}


SCHEMA_VERSION = 1  # of the records and run.json together (kvbench.core.schema)


@dataclass
class RunMeta(Entry):
    """run.json: the whole run's metadata (``runs.finalize`` is its one writer)."""

    run_id: str = ""
    suite: str = "default"
    started_ns: Ns | None = None
    ended_ns: Ns | None = None
    config: dict = field(default_factory=dict)  # the resolved bench.toml (no secret)
    versions: dict = field(default_factory=dict)
    git_commit: str | None = None
    hosts: list = field(default_factory=list)
    endpoints: list[EndpointEntry] = field(default_factory=list)
    stages: list[StageEntry] = field(default_factory=list)
    clock_offsets_ns: dict = field(default_factory=dict)
    telemetry: dict = field(default_factory=dict)  # {source: "ok" | why it is missing}
    incomplete: list[Incomplete] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    workloads: dict = field(default_factory=dict)  # {name: describe()}
    workloads_sent: dict | None = None  # {endpoint: {workload: describe()}}; None: not kept
    workers: dict = field(default_factory=dict)  # distributed: what each worker sent
    worker_clock_offsets_ns: dict = field(default_factory=dict)  # distributed: per worker
    interrupted: bool = False  # a signal or a kill cut the run before its planned end
    interruption: str | None = None  # how, e.g. "SIGTERM to kvbench run"
    cache_states: list[CacheState] = field(default_factory=list)  # per job
    schema_version: int = SCHEMA_VERSION
    # how the tables lie on disk (``kvbench.core.layout``): 2 the requests a Hive-partitioned
    # dataset; 1 (run.json without it) one requests.parquet
    layout: int = 1
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _nested: ClassVar = {"endpoints": ("list", EndpointEntry), "stages": ("list", StageEntry),
                         "incomplete": ("list", Incomplete),
                         "cache_states": ("list", CacheState)}
    _check_as: ClassVar = {"config": ("one", RunConfig), "workloads_sent": ("mapmap", Described),
                           "workers": dict[str, dict], "worker_clock_offsets_ns":
                           dict[str, int], "versions": dict[str, Any]}

    @property
    def slo(self) -> dict[str, SLO]:
        """The resolved config's ``[slo.*]`` tables, by request class."""
        return slo_map((self.config or {}).get("slo"))

    def endpoint(self, name: str) -> EndpointEntry | None:
        return next((e for e in self.endpoints if e.name == name), None)


# --------------------------------------------------------------------------- the strict check


_MODELS: dict[type, Any] = {}


def strict_model(cls: type[Entry]):
    """The pydantic model (strict, extra keys allowed) of one class of the contract, generated
    from its fields: every field may be null but those in ``_not_null``."""
    if cls in _MODELS:
        return _MODELS[cls]
    from typing import Annotated, Optional

    from pydantic import BaseModel, ConfigDict, Field, create_model

    class _Loose(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")

    kinds = {"Ns": Annotated[int, Field(ge=0, lt=2**63)],
             "Num": Annotated[float, Field(allow_inf_nan=False)],
             "Count": Annotated[int, Field(ge=0)],
             "int": int, "float": float, "str": str, "bool": bool, "dict": dict[str, Any],
             "list": list[Any], "Any": Any}
    fields_ = {}
    for f in dc.fields(cls):
        if f.name == "extra":
            continue
        how = cls._check_as.get(f.name) or cls._nested.get(f.name)
        if how is not None and not isinstance(how, tuple):
            typ = how  # a type, as given
        elif how is not None:
            shape, sub = how
            inner = strict_model(sub)
            typ = {"one": inner, "list": list[inner], "map": dict[str, inner],
                   "mapmap": dict[str, dict[str, inner]]}[shape]
        else:
            head = str(f.type).split("|")[0].strip()
            typ = kinds.get(head, Any)
        if f.name in cls._not_null:
            default = f.default if f.default is not dc.MISSING else ...
            fields_[f.name] = (typ, default)
        else:
            fields_[f.name] = (Optional[typ], None)
    model = create_model(f"{cls.__name__}Check", __base__=_Loose, **fields_)
    _MODELS[cls] = model
    return model


def check(cls: type[Entry], data: dict) -> None:
    """Validate ``data`` against ``cls``'s strict model (``pydantic.ValidationError`` when a
    field's type is wrong)."""
    strict_model(cls).model_validate(data)
