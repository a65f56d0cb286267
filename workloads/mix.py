"""A weighted mix of other workloads in one stream, each request tagged with its own class.

``requests`` slots are drawn by weight (seeded), giving each component its number of
requests; each component is built from its own ``[workloads.<name>]`` table, asked for that
many requests (more sessions, contracts' questions or tasks as its kind needs), and its
requests fill its slots in order. ``sessions()`` yields a component's session when the slot of
its first request comes up. A request keeps its component's ``workload`` name.
"""

from __future__ import annotations

from typing import Callable, Iterator, Literal, Mapping

import numpy as np
from pydantic import Field

from kvbench.workloads.base import Request, Session
from kvbench.workloads.common import flatten, rng_for
from kvbench.core.errors import UserError
from kvbench.workloads.registry import BuildContext, register
from kvbench.workloads.specs import MAX_REQUESTS, KindSpec, Name, Strict


class MixComponent(Strict):
    workload: Name  # name of another [workloads.<name>] table
    weight: float = Field(gt=0, le=1e9)


class MixSpec(KindSpec):
    kind: Literal["mix"] = "mix"
    requests: int = Field(default=300, gt=0, le=MAX_REQUESTS)
    components: list[MixComponent] = Field(min_length=1, max_length=100)

    def planned_requests(self) -> int:
        return self.requests

    def parts(self) -> list[str]:
        return [c.workload for c in self.components]

    def check_tables(self, name: str, tables: Mapping[str, KindSpec]) -> tuple[str, str] | None:
        for i, comp in enumerate(self.components):
            if comp.workload not in tables or comp.workload == name:
                return (f"workloads.{name}.components[{i}].workload",
                        f"{comp.workload!r} is not another [workloads.*] table; use one of "
                        f"{sorted(set(tables) - {name})}")
            if isinstance(tables[comp.workload], MixSpec):
                return (f"workloads.{name}.components[{i}]",
                        "a mix cannot contain another mix; list its parts instead")
        return None

    def working_set_problem(self, name: str, sizable_kinds: list[str]) -> str | None:
        if self.working_set is None:
            return None
        return (f"workloads.{name}.working_set: set working_set on the mix's parts, not on "
                "the mix; remove it")


class _Capped:
    """A session cut after ``turns`` turns (a mix's last session of a component)."""

    def __init__(self, inner: Session, turns: int):
        self.inner = inner
        self.session_id = inner.session_id
        self.left = turns

    def next_request(self) -> Request | None:
        if self.left <= 0:
            return None
        self.left -= 1
        return self.inner.next_request()

    def feed_response(self, text: str) -> None:
        self.inner.feed_response(text)


def _turns_of(session) -> int | None:
    for attr in ("turns", "questions", "steps"):
        v = getattr(session, attr, None)
        if isinstance(v, int):
            return v
    return 1 if hasattr(session, "request") else None


class MixWorkload:
    request_class = "mix"
    has_arrivals = False

    def __init__(self, name: str, spec: MixSpec, seed: int,
                 build: Callable[[str, int], object]):
        self.name = name
        self.spec = spec
        self.seed = seed
        w = np.array([c.weight for c in spec.components], dtype=float)
        rng = rng_for(seed, name, "mix")
        self.slots = rng.choice(len(w), size=spec.requests, p=w / w.sum())
        counts = np.bincount(self.slots, minlength=len(w))
        self.counts = {c.workload: int(n) for c, n in zip(spec.components, counts)}
        self.components = {c.workload: build(c.workload, int(n))
                           for c, n in zip(spec.components, counts) if n > 0}
        first = next(iter(self.components.values()), None)
        self.tokenizer = getattr(first, "tokenizer", None)
        self.flatten_order = "sequential"

    def _component_sessions(self, cname: str) -> Iterator[Session]:
        """The component's sessions holding exactly its share of requests."""
        left = self.counts[cname]
        for s in self.components[cname].sessions():
            if left <= 0:
                return
            turns = _turns_of(s)
            if turns is None or turns > left:
                s = _Capped(s, left)
                turns = min(turns or left, left)
            left -= turns
            yield s

    def sessions(self) -> Iterator[Session]:
        """Sessions in the order of their first request's slot."""
        streams = {c: self._component_sessions(c) for c in self.components}
        owed = {c: 0 for c in self.components}  # turns of yielded sessions not yet slotted
        names = [c.workload for c in self.spec.components]
        for slot in self.slots.tolist():
            c = names[slot]
            if owed[c] == 0:
                s = next(streams[c], None)
                if s is None:
                    continue
                owed[c] = _turns_of(s.inner if isinstance(s, _Capped) else s) or 1
                if isinstance(s, _Capped):
                    owed[c] = s.left
                yield s
            owed[c] -= 1

    def requests(self) -> Iterator[Request]:
        names = [c.workload for c in self.spec.components]
        streams = {}
        for c, wl in self.components.items():
            streams[c] = flatten(self._component_sessions(c), wl.flatten_order,
                                 wl.synthetic_response, getattr(wl, "window", None))
        for slot in self.slots.tolist():
            req = next(streams[names[slot]], None)
            if req is not None:
                yield req

    def __repr__(self) -> str:
        return f"<MixWorkload {self.name!r} {self.counts}>"


def _build(name: str, spec: MixSpec, ctx: BuildContext) -> MixWorkload:
    if ctx.part is None:
        raise UserError(f"workloads.{name}: a mix needs the config that defines its parts")
    return MixWorkload(name, spec, ctx.seed, ctx.part)


register(spec=MixSpec, build=_build, request_class=MixWorkload.request_class)
