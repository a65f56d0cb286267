"""Prefill and decode on the same GPUs: replicas behind a cache-aware balancer."""

from kvbench.model.topologies.base import BOTH, Layout, Pool, Topology, replicas, replicas_how

# Two replicas: the GPUs of one prefill and one decode GPU, so it compares with the
# disaggregated default at equal GPUs.
DEFAULT_REPLICAS = 2

TOPOLOGY = Topology(
    name="colocated",
    description="replicas that prefill and decode on the same GPUs",
    layout=lambda o: Layout((Pool(BOTH, replicas(o, DEFAULT_REPLICAS)),)),
    gpus_how=lambda o: replicas_how(o, DEFAULT_REPLICAS),
    default=True,
)
