"""Replay a trace (Mooncake, Azure, LMCache agent) at its own arrival times.

    locust -f loadgen/trace.py --host http://127.0.0.1:8000 --headless -u 1 -t 10m \
        --kvbench-config bench.toml --kvbench-workload mytrace --kvbench-pacing trace
"""

from kvbench.loadgen.user import KVBenchUser


class TraceUser(KVBenchUser):
    workload = "trace"
