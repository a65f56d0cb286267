"""Requests generated per second per workload class (and for the real traces when present).

Target: at least 10x what one load process sends (~1,000 req/s), so generation is never the
load generator's bottleneck. Run: ``python bench/workloads_rate.py [--seconds 2]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvbench.workloads.registry import build_spec
from kvbench.workloads.agent import AgentSpec
from kvbench.workloads.chat import ChatSpec
from kvbench.workloads.hogwild import HogwildSpec
from kvbench.workloads.longctx import LongctxSpec
from kvbench.workloads.rag import RagSpec
from kvbench.workloads.tokenizer import get_tokenizer
from kvbench.workloads.traces import TraceSpec, traces_dir

SPECS = {  # the specs' defaults, with enough requests to time
    "chat": ChatSpec(requests=200_000),
    "rag": RagSpec(requests=200_000),
    "agent": AgentSpec(sessions=20_000),
    "hogwild": HogwildSpec(tasks=5_000),
    "longctx": LongctxSpec(contracts=64, questions_per_contract=64),
}


def measure(wl, seconds: float) -> tuple[int, int, float]:
    """(requests, prompt tokens, seconds) drawing ``wl.requests()`` for about ``seconds``."""
    n = tokens = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    for r in wl.requests():
        n += 1
        tokens += r.prompt_tokens
        if (n & 63) == 0 and time.perf_counter() >= deadline:
            break
    return n, tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    tok = get_tokenizer()
    rows = []
    for name, spec in SPECS.items():
        for api in ("chat", "completions"):
            wl = build_spec(name, spec.model_copy(update={"api": api}), tok, 0)
            rows.append((f"{name} ({api})", *measure(wl, args.seconds)))
    d = traces_dir()
    traces = [("mooncake conversation", "mooncake", d / "mooncake/conversation_trace.jsonl"),
              ("azure conv", "azure", d / "azure2023/AzureLLMInferenceTrace_conv.csv"),
              ("lmcache miniswe", "lmcache_agent", d / "lmcache-agent/miniswe")]
    for label, fmt, path in traces:
        if not Path(path).exists():
            print(f"{label}: skipped, {path} not found")
            continue
        t0 = time.perf_counter()
        wl = build_spec(label, TraceSpec(format=fmt, path=str(path)), tok, 0)
        load_s = time.perf_counter() - t0
        n, tokens, dt = measure(wl, args.seconds)
        rows.append((f"{label} (read {load_s:.2f} s)", n, tokens, dt))
    print(f"{'workload':42} {'requests':>9} {'req/s':>10} {'prompt tok/s':>14} {'tok/req':>8}")
    for label, n, tokens, dt in rows:
        print(f"{label:42} {n:9,} {n / dt:10,.0f} {tokens / dt:14,.0f} {tokens / max(n, 1):8,.0f}")


if __name__ == "__main__":
    main()
