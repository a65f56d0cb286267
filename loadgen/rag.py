"""Retrieval-augmented questions: popular document chunks shared across requests.

    locust -f loadgen/rag.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 60s
"""

from kvbench.loadgen.user import KVBenchUser


class RagUser(KVBenchUser):
    workload = "rag"
