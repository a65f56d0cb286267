"""Agent sessions: a long system prompt and tool schema, then turns that grow on the previous
response, with think time between turns (closed loop: one user per session).

    locust -f loadgen/agent.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 60s
"""

from kvbench.loadgen.user import KVBenchUser


class AgentUser(KVBenchUser):
    workload = "agent"
