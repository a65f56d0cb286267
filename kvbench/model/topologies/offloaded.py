"""Colocated replicas whose KV spills from HBM to CPU DRAM and disk (LMCache-style); the lower
tiers are no GPUs."""

from kvbench.model.topologies.base import BOTH, Layout, Pool, Topology, replicas, replicas_how

DEFAULT_REPLICAS = 1

TOPOLOGY = Topology(
    name="offloaded",
    description="replicas whose KV spills from HBM to CPU DRAM and disk",
    layout=lambda o: Layout((Pool(BOTH, replicas(o, DEFAULT_REPLICAS)),)),
    gpus_how=lambda o: replicas_how(o, DEFAULT_REPLICAS),
    offloads_kv=True,
)
