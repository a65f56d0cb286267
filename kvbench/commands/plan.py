"""``kvbench plan``: the cost model's comparisons (seed 000): routers, offload configs,
colocated vs disaggregated across prompt lengths, and the Hogwild! coordination sweep."""

from __future__ import annotations

import orjson


def add_parser(p) -> None:
    p.add_argument("--output-tokens", type=int, default=256,
                   help="output length for the colocated vs disaggregated table (default 256)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def compute(output_tokens: int = 256) -> dict:
    from kvbench.model import costmodel as cm
    from kvbench.model import profiles as pf

    routers = [cm.simulate_routing(s) for s in cm.ROUTER_STRATEGIES]
    hbm_tokens = cm.GPU_MEMORY_UTILIZATION * pf.HARDWARE["h200"].hbm_bytes
    hbm_tokens = (hbm_tokens - cm.WEIGHT_BYTES_REF) / pf.KV_BYTES_PER_TOKEN_70B_FP8
    prompt, reused = 4096, 4032
    offload = []
    for mode in cm.OFFLOAD_CONFIGS:
        low = cm.offload_ttft_ms(mode, prompt, reused, 0.2 * hbm_tokens, hbm_tokens)
        high = cm.offload_ttft_ms(mode, prompt, reused, 4.0 * hbm_tokens, hbm_tokens)
        offload.append({"config": mode, "ttft_ms_low_pressure": low,
                        "ttft_ms_working_set_4x_hbm": high})
    base = offload[0]
    for row in offload:
        row["overhead_low_pressure_pct"] = 100 * (row["ttft_ms_low_pressure"]
                                                  / base["ttft_ms_low_pressure"] - 1)
        row["speedup_4x_hbm"] = base["ttft_ms_working_set_4x_hbm"] / \
            row["ttft_ms_working_set_4x_hbm"]
    pd = []
    for p in (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768):
        c = cm.ms_colocated(p, output_tokens)
        pd.append({"prompt_tokens": p, "colocated_ms": c,
                   "disaggregated_rdma_ms": cm.ms_disaggregated(p, output_tokens, True),
                   "disaggregated_tcp_ms": cm.ms_disaggregated(p, output_tokens, False)})
    crossover = {o: {"rdma": cm.pd_crossover_prompt_tokens(o, True),
                     "tcp": cm.pd_crossover_prompt_tokens(o, False)} for o in (50, 200, 500)}
    hog = []
    for cw in (0.0, 0.2, 0.5, 0.8, 1.0):
        r1 = cm.run_hogwild(1, 400, 100, cw)
        r2 = cm.run_hogwild(2, 400, 100, cw)
        r4 = cm.run_hogwild(4, 400, 100, cw)
        hog.append({"coordination_weight": cw,
                    "speedup_2": r1["time_steps"] / r2["time_steps"],
                    "speedup_4": r1["time_steps"] / r4["time_steps"],
                    "duplicate_rate_4": r4["duplicate_rate"]})
    return {
        "routers": routers,
        "router_ttft_ms": {"hit": cm.ttft_hit_ms(), "miss": cm.ttft_miss_ms(),
                           "cross_region_hit": cm.ttft_cross_region_ms(True)},
        "offload": offload,
        "offload_break_even": {t: cm.offload_break_even(prompt, t) for t in ("dram", "disk")},
        "pd": pd, "pd_output_tokens": output_tokens, "pd_crossover_prompt_tokens": crossover,
        "kv_transfer_4k_ms": {"rdma": cm.kv_transfer_ms(4096, True),
                              "tcp": cm.kv_transfer_ms(4096, False)},
        "hogwild_expected_speedup": cm.expected_speedup(cm.HOGWILD_T_SERIAL, 0.7,
                                                        cm.HOGWILD_COORDINATION_STEPS, 4, 50),
        "hogwild_sweep": hog,
    }


def run(args) -> int:
    d = compute(args.output_tokens)
    if args.json:
        print(orjson.dumps(d, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())
        return 0
    from kvbench.model import costmodel as cm

    print("Routers (RAG stream over 3 regions x 4 replicas; TTFT hit "
          f"{d['router_ttft_ms']['hit']:.0f} ms, miss {d['router_ttft_ms']['miss']:.0f} ms, "
          f"+{cm.CROSS_REGION_RTT_MS:.0f} ms across regions)")
    print(f"  {'strategy':<12} {'hit rate':>9} {'mean TTFT ms':>13} {'cross-region':>13}")
    for r in d["routers"]:
        print(f"  {r['strategy']:<12} {r['hit_rate']:>9.1%} {r['mean_ttft_ms']:>13.0f} "
              f"{r['cross_region_share']:>13.1%}")
    print("\nKV offloading (4,096-token prompt reusing 4,032 tokens; TTFT ms)")
    print(f"  {'config':<12} {'low pressure':>13} {'overhead':>9} {'KV = 4x HBM':>12} "
          f"{'speedup':>8}")
    for r in d["offload"]:
        print(f"  {r['config']:<12} {r['ttft_ms_low_pressure']:>13.1f} "
              f"{r['overhead_low_pressure_pct']:>8.1f}% {r['ttft_ms_working_set_4x_hbm']:>12.1f} "
              f"{r['speedup_4x_hbm']:>7.2f}x")
    for t, be in d["offload_break_even"].items():
        print(f"  reload from {t}: {be['load_ms']:.1f} ms vs recompute {be['recompute_ms']:.1f} ms")
    print(f"\nColocated vs disaggregated ({d['pd_output_tokens']} output tokens, 2 requests per "
          "GPU; request ms)")
    print(f"  {'prompt':>7}  colocated {'disagg RDMA':>12} {'disagg TCP':>11}")
    for r in d["pd"]:
        print(f"  {r['prompt_tokens']:>7} {r['colocated_ms']:>10.0f} "
              f"{r['disaggregated_rdma_ms']:>12.0f} {r['disaggregated_tcp_ms']:>11.0f}")
    for o, c in d["pd_crossover_prompt_tokens"].items():
        print(f"  crossover for {o} output tokens: RDMA {c['rdma']} prompt tokens, TCP {c['tcp']}")
    print(f"  KV transfer of 4K tokens (70B FP8): RDMA {d['kv_transfer_4k_ms']['rdma']:.1f} ms, "
          f"TCP {d['kv_transfer_4k_ms']['tcp']:.1f} ms")
    print(f"\nHogwild! expected_speedup(T={cm.HOGWILD_T_SERIAL}, p=0.7, "
          f"c={cm.HOGWILD_COORDINATION_STEPS}, N=4) = {d['hogwild_expected_speedup']:.2f}x")
    print(f"  {'cw':>4} {'2 workers':>10} {'4 workers':>10} {'dup rate (4)':>13}")
    for r in d["hogwild_sweep"]:
        print(f"  {r['coordination_weight']:>4.1f} {r['speedup_2']:>9.2f}x {r['speedup_4']:>9.2f}x "
              f"{r['duplicate_rate_4']:>13.1%}")
    return 0
