"""The weighted mix of chat, RAG, agent and long-contract traffic, open loop at Poisson rates.

    locust -f loadgen/mix.py --host http://127.0.0.1:8000 --headless -u 1 -t 30s \
        --kvbench-pacing poisson --kvbench-rates 2,6 --kvbench-stage-duration 15
"""

from kvbench.loadgen.user import KVBenchUser


class MixUser(KVBenchUser):
    workload = "mix"
