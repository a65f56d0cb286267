"""Chat: short single-turn prompts with ShareGPT-like lengths (the commonest serving traffic).

    locust -f loadgen/chat.py --host http://127.0.0.1:8000 --headless -u 32 -r 32 -t 60s
"""

from kvbench.loadgen.user import KVBenchUser


class ChatUser(KVBenchUser):
    workload = "chat"  # [workloads.chat] of --kvbench-config, or the defaults
