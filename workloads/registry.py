"""The workload kinds: each kind's module registers its spec, its generator and its request
class here, and a workload is built from its ``[workloads.<name>]`` table through this registry.

Built-in kinds are found by importing every module of ``kvbench.workloads`` once, on the first
lookup, so adding a kind is one new module that calls ``register``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Annotated, Callable, Mapping, Union

from pydantic import Field, TypeAdapter

from kvbench.core.errors import UserError
from kvbench.workloads.specs import KindSpec, Name
from kvbench.workloads.tokenizer import get_tokenizer


@dataclass(frozen=True)
class BuildContext:
    """What a kind's build function gets besides its name and spec."""

    tokenizer: object
    seed: int
    n_requests: int | None = None  # a mix asks its parts for this many requests
    part: Callable[[str, int], object] | None = None  # builds another table (for a mix)


@dataclass(frozen=True)
class Kind:
    """One registered workload kind."""

    kind: str
    spec: type[KindSpec]
    build: Callable[[str, KindSpec, BuildContext], object]
    request_class: str  # the class its requests carry ("mix": each its part's)


_KINDS: dict[str, Kind] = {}
_state = {"discovered": False, "adapter": None}


def register(*, spec: type[KindSpec], build: Callable[[str, KindSpec, BuildContext], object],
             request_class: str) -> Kind:
    """Registers a kind under the default of ``spec``'s ``kind`` field; registering the same
    spec again is a no-op, another spec under a taken kind is an error."""
    if not (isinstance(spec, type) and issubclass(spec, KindSpec)):
        raise TypeError(f"{spec!r} is not a KindSpec subclass")
    kind = spec.model_fields["kind"].default
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{spec.__name__} needs kind: Literal['<kind>'] = '<kind>'")
    old = _KINDS.get(kind)
    if old is not None:
        if old.spec is spec:
            return old
        raise ValueError(f"workload kind {kind!r} is registered twice ({old.spec.__name__} "
                         f"and {spec.__name__})")
    _KINDS[kind] = entry = Kind(kind, spec, build, request_class)
    _state["adapter"] = None
    return entry


def unregister(kind: str) -> None:
    """Removes a kind (tests that register their own)."""
    if _KINDS.pop(kind, None) is not None:
        _state["adapter"] = None


def _discover() -> None:
    if _state["discovered"]:
        return
    _state["discovered"] = True
    pkg = importlib.import_module("kvbench.workloads")
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")


def kinds() -> dict[str, Kind]:
    """Every registered kind by name, in registration order."""
    _discover()
    return dict(_KINDS)


def kind_of(spec: KindSpec) -> Kind:
    try:
        return kinds()[spec.kind]
    except KeyError:
        raise UserError(f"workload kind {spec.kind!r} is not registered; use one of "
                        f"{sorted(_KINDS)}") from None


def class_of(spec: KindSpec) -> str:
    """The class a table's requests carry: its own ``request_class`` where its kind lets a
    table name one (chat), else its kind's ("mix": each request its part's)."""
    return getattr(spec, "request_class", None) or kind_of(spec).request_class


def request_classes() -> tuple[str, ...]:
    """The request classes the registered kinds produce (a mix produces its parts')."""
    return tuple(dict.fromkeys(k.request_class for k in kinds().values()
                               if k.request_class != "mix"))


def tables_adapter() -> TypeAdapter:
    """Validates a ``{name: table}`` mapping into specs, each chosen by its ``kind`` among the
    kinds registered now (rebuilt after a registration)."""
    adapter = _state["adapter"]
    if adapter is None:
        specs = tuple(k.spec for k in kinds().values())
        one = Annotated[Union[specs], Field(discriminator="kind")] if len(specs) > 1 \
            else specs[0]
        adapter = _state["adapter"] = TypeAdapter(dict[Name, one])
    return adapter


def _build(name: str, spec: KindSpec, ctx: BuildContext):
    entry = kind_of(spec)
    problem = spec.working_set_problem(
        name, [k.kind for k in kinds().values() if k.spec.sizable])
    if problem:
        raise UserError(problem)
    return entry.build(name, spec, ctx)


def build_spec(name: str, spec: KindSpec, tokenizer, seed: int, n_requests: int | None = None):
    """A workload from a spec outside any config (tests, trace files given on the command
    line); a mix needs its config, use ``make_workload``."""
    return _build(name, spec, BuildContext(tokenizer, seed, n_requests))


def make_workload(name: str, cfg, tokenizer=None):
    """The workload of ``[workloads.<name>]`` in ``cfg`` (a ``kvbench.config.BenchConfig``).

    Tokenizer: ``get_tokenizer(cfg.suite.tokenizer)`` unless given; seed: the table's
    ``seed`` or ``suite.seed``.
    """
    tok = tokenizer if tokenizer is not None else get_tokenizer(cfg.suite.tokenizer)
    return make_from_specs(name, cfg.workloads, cfg.suite.seed, tok)


def make_from_specs(name: str, specs: Mapping[str, KindSpec], seed: int, tokenizer):
    """The workload ``name`` of ``specs`` (validated tables, a mix's parts among them), each
    seeded by its table's ``seed`` or ``seed``: what a config or a resolved job holds."""
    if name not in specs:
        raise UserError(f"workload {name!r} is not defined in the config; use one of "
                        f"{sorted(specs)}")

    def seed_of(s) -> int:
        return s.seed if s.seed is not None else seed

    def part(pname: str, n: int):
        pspec = specs[pname]
        return _build(pname, pspec, BuildContext(tokenizer, seed_of(pspec), n))

    spec = specs[name]
    return _build(name, spec, BuildContext(tokenizer, seed_of(spec), part=part))
