"""The topologies: serving designs the emulator builds, the config accepts and the reports
reason about. Each is one module of this package holding ``TOPOLOGY`` (a ``base.Topology``),
found on the first lookup, so adding a topology is adding a module.

A real endpoint's topology (``kind = "openai"``) is a label naming one of these, or "unknown";
it ties that endpoint to nothing here."""

from __future__ import annotations

import importlib
import pkgutil

from kvbench.model.topologies.base import Topology

_TOPOLOGIES: dict[str, Topology] = {}
_state = {"discovered": False}


def register(topology: Topology) -> Topology:
    """Adds a topology; the same one again is a no-op, another under a taken name an error."""
    old = _TOPOLOGIES.get(topology.name)
    if old is not None and old != topology:
        raise ValueError(f"topology {topology.name!r} is registered twice")
    _TOPOLOGIES[topology.name] = topology
    return topology


def unregister(name: str) -> None:
    """Removes a topology (tests that register their own)."""
    _TOPOLOGIES.pop(name, None)


def _discover() -> None:
    if _state["discovered"]:
        return
    _state["discovered"] = True
    for m in pkgutil.iter_modules(__path__):
        found = getattr(importlib.import_module(f"{__name__}.{m.name}"), "TOPOLOGY", None)
        if isinstance(found, Topology):
            register(found)


def topologies() -> dict[str, Topology]:
    """Every registered topology by name, in module order (then registration order)."""
    _discover()
    return dict(_TOPOLOGIES)


def names() -> tuple[str, ...]:
    return tuple(topologies())


def get(name: str) -> Topology:
    """The topology ``name``; KeyError when none is registered under it."""
    return topologies()[name]


def default() -> Topology:
    return next(t for t in topologies().values() if t.default)


def where(**traits: bool) -> tuple[str, ...]:
    """Names of the topologies whose traits have these values, e.g.
    ``where(splits_prefill_decode=True)``."""
    return tuple(t.name for t in topologies().values()
                 if all(getattr(t, k) == v for k, v in traits.items()))


def accept(value, labels: tuple[str, ...] = ()):
    """``value`` when it names a registered topology or one of ``labels`` (a pydantic
    before-validator); else the error, and its wording, of a pydantic ``Literal`` field."""
    from pydantic_core import PydanticCustomError

    choices = names() + labels
    if value in choices:
        return value
    expected = ", ".join(map(repr, choices[:-1])) + " or " * (len(choices) > 1) + repr(choices[-1])
    raise PydanticCustomError("literal_error", "Input should be {expected}",
                              {"expected": expected})
