"""Regions of colocated replicas behind the configured router (round-robin or cache-aware)."""

from kvbench.model.topologies.base import BOTH, Layout, Pool, Topology

TOPOLOGY = Topology(
    name="routed",
    description="regions of replicas behind a router",
    layout=lambda o: Layout(tuple(Pool(BOTH, o.replicas_per_region, "{region}/r", region=r)
                                  for r in range(o.regions)), router=o.router),
    gpus_how=lambda o: (f"{o.regions} regions x {o.replicas_per_region} replicas "
                        "(options.regions, options.replicas_per_region)"),
    routes=True,
)
