"""Long-contract Q&A: a few long documents, many questions on each (prefix reuse at scale).

    locust -f loadgen/longctx.py --host http://127.0.0.1:8000 --headless -u 4 -r 4 -t 60s
"""

from kvbench.loadgen.user import KVBenchUser


class LongContractUser(KVBenchUser):
    workload = "longctx"  # [workloads.longctx] of --kvbench-config, or the defaults
