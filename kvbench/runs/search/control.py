"""The control file between kvbench run and the load process of a capacity search
(``search-<endpoint>-<workload>.json`` in the run directory): the probes asked for, with their
roles and verdicts as they settle, the probes to cut or end, and whether the search is done.
The driver writes it whole at each change (``write_control``); the child's feed reads it
between stages and the run's finalize reads it back into run.json's stage notes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kvbench.core.contract import Count, Entry, Num


def control_path(run_dir: Path | str, endpoint: str, workload: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{endpoint}-{workload}")
    return Path(run_dir) / f"search-{safe}.json"


@dataclass(frozen=True)
class Probe:
    """One probe as planned: a stage of ``rate_rps`` (open loop) or ``users`` (closed)."""

    index: int
    rate_rps: float | None  # open loop (None: a closed-loop probe)
    duration_s: float
    role: str = "ramp"  # warmup | ramp | refine | bisect | confirm
    users: int | None = None  # closed loop: the users the probe runs

    @property
    def level(self) -> float:
        """What the search varies: the offered rate, or the number of users."""
        return self.users if self.users is not None else self.rate_rps

    def text(self) -> str:
        return (f"{self.users} users" if self.users is not None
                else f"{self.rate_rps:g} req/s")


@dataclass
class ProbeEntry(Entry):
    """A probe in the control file: what the child runs, and its account once judged."""

    index: Count = 0
    rate_rps: Num | None = None
    users: Count | None = None
    duration_s: Num = 0.0
    role: str | None = None  # a voided probe's role ends in " (void)"
    target: Num | None = None  # the attainment and confidence it is judged against
    confidence: Num | None = None
    verdict: str | None = None  # pass | fail | straddle; None: not judged (yet)
    why: str | None = None
    estimate: bool | None = None  # a straddle decided on its pooled estimate
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, probe: Probe, **account) -> "ProbeEntry":
        return cls(index=probe.index, rate_rps=probe.rate_rps, users=probe.users,
                   duration_s=probe.duration_s, role=probe.role, **account)

    def probe(self) -> Probe:
        return Probe(int(self.index), None if self.rate_rps is None else float(self.rate_rps),
                     float(self.duration_s), self.role or "ramp",
                     None if self.users is None else int(self.users))


@dataclass
class Note(Entry):
    """How the search ended, when not by its plan."""

    stop: str | None = None  # "budget": the next probe would not fit in what was left
    after_s: Num | None = None  # when, s into the search
    extra: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Control(Entry):
    """The whole control file."""

    probes: list[ProbeEntry] = field(default_factory=list)  # in order: probes[i].index == i
    cut: list[int] = field(default_factory=list)  # its arrivals end, its requests cancelled
    end: list[int] = field(default_factory=list)  # its arrivals end, its requests finish
    done: bool = False  # the search ended: the child ends too
    notes: list[Note] = field(default_factory=list)
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    _nested: ClassVar = {"probes": ("list", ProbeEntry), "notes": ("list", Note)}

    @property
    def stop(self) -> str | None:
        return next((n.stop for n in self.notes if isinstance(n, Note) and n.stop), None)


def read_control(path: Path) -> Control | None:
    """The control file at ``path``; None while it is missing or half written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return Control.from_dict(data) if isinstance(data, dict) else None


def write_control(path: Path, control: Control) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(control.to_dict(), indent=1))
    os.replace(tmp, path)
