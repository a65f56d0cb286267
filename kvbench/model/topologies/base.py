"""What a topology is: one serving design, as data. Its name, what it does that a report asks
about (its traits), the engines it wires (its layout) and how its GPU count adds up.

Pure data and pure functions of the emulator's settings, so the config, ``kvbench serve``, the
emulator and the reports all read the same entry; the emulator interprets a ``Layout``, it is
not handed one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

# The part a GPU plays in serving: the emulator's engine roles, and the gpu table's ``role``
# column (``[[collect.roles]]``); "colocated" prefills and decodes on the same GPU, "cache"
# holds offloaded KV for others.
ROLES = ("prefill", "decode", "colocated", "cache")
PREFILL, DECODE, BOTH, CACHE = ROLES


class Options(Protocol):
    """The emulator settings a layout reads (``endpoints.config.EmulatorConfig``)."""

    replicas: int | None
    prefill_gpus: int
    decode_gpus: int
    regions: int
    replicas_per_region: int
    router: str


@dataclass(frozen=True)
class Pool:
    """``count`` engines (one GPU each) of one role in one region."""

    role: str
    count: int
    prefix: str = "r"  # engine names: prefix + index, "{region}" standing for the region's name
    region: int = 0  # index into the endpoint's regions
    # True: the router sends new requests here; False: requests come prefilled, over the P/D
    # link, from the pool's prefill engines.
    entry: bool = True


@dataclass(frozen=True)
class Layout:
    """The engines of one endpoint, pool by pool, in the order their GPUs are numbered."""

    pools: tuple[Pool, ...]
    router: str = "REGIONAL"  # the router's strategy over the entry pools

    @property
    def gpus(self) -> int:
        return sum(p.count for p in self.pools)


@dataclass(frozen=True)
class Topology:
    """One registered topology (a module of this package holding ``TOPOLOGY``)."""

    name: str
    description: str  # one line, for help texts
    layout: Callable[[Options], Layout]
    gpus_how: Callable[[Options], str]  # how the GPU count adds up, naming the options
    splits_prefill_decode: bool = False  # prefill and decode on separate GPUs, KV moved between
    offloads_kv: bool = False  # KV spills from HBM to DRAM and disk (every engine)
    routes: bool = False  # several regions behind a router
    default: bool = False  # what ``kvbench serve`` and the emulator settings start from

    def gpus(self, opts: Options) -> tuple[int, str]:
        """The GPUs it runs (one per engine of its layout) and how they add up."""
        return self.layout(opts).gpus, self.gpus_how(opts)


def replicas(opts: Options, default: int) -> int:
    """Engines of a set of replicas: ``options.replicas``, else the topology's default."""
    return opts.replicas if opts.replicas is not None else default


def replicas_how(opts: Options, default: int) -> str:
    n = replicas(opts, default)
    return f"{n} replica{'s' * (n != 1)} (options.replicas)"
