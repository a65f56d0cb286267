"""A prefill pool and a decode pool, each prompt's KV moved over the link between them."""

from kvbench.model.topologies.base import DECODE, PREFILL, Layout, Pool, Topology

TOPOLOGY = Topology(
    name="disaggregated",
    description="a prefill pool and a decode pool, KV moved between them",
    layout=lambda o: Layout((Pool(PREFILL, o.prefill_gpus, "p"),
                             Pool(DECODE, o.decode_gpus, "d", entry=False))),
    gpus_how=lambda o: (f"{o.prefill_gpus} prefill + {o.decode_gpus} decode "
                        "(options.prefill_gpus, options.decode_gpus)"),
    splits_prefill_decode=True,
)
