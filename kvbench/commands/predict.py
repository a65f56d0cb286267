"""``kvbench predict``: capacity at SLO and latency against offered rate of each built-in
endpoint (a calibrated twin) in virtual time, no load sent (``kvbench.runs.predict``);
``--save RUN_DIR`` also writes it into a run folder, where ``kvbench report`` sets it beside
that run's measurement."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from kvbench.core.errors import UserError


def add_parser(p) -> None:
    p.add_argument("--config", default="bench.toml",
                   help="a twin (kvbench calibrate -o twin.toml) or any config with built-in "
                        "endpoints (default bench.toml)")
    p.add_argument("--workload", default=None,
                   help="the [workloads.*] table (default: the suite's first, else mix)")
    p.add_argument("--topology", default=None,
                   help="what-if: run each endpoint's options as this topology on the same "
                        "GPUs (disaggregated, offloaded, routed)")
    p.add_argument("--options", nargs="*", default=[], metavar="K=V",
                   help="emulator options over the endpoints' own (TOML values: "
                        "rdma_gb_s=50 link=\"tcp\"), e.g. the link or tier of a what-if")
    p.add_argument("--endpoint", default=None, help="only this built-in endpoint")
    p.add_argument("--slo-config", default=None, metavar="BENCH_TOML",
                   help="the suite whose workloads and SLOs to predict under, filling in what "
                        "--config lacks (its [slo] tables win)")
    p.add_argument("--format", choices=("text", "json", "md"), default="text")
    p.add_argument("--save", default=None, metavar="RUN_DIR",
                   help="also write the prediction into this run folder (prediction.json), "
                        "where kvbench report sets it beside the run's measurement; without "
                        "--workload, the run's workload where it measured one")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--seeds", type=int, default=1, help="seeds seed..seed+N-1 (median)")
    p.add_argument("--seconds", type=float, default=120.0,
                   help="virtual seconds judged per rate, after the warm-up (default 120)")
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--precision", type=float, default=0.05,
                   help="bisect the capacity until hi/lo - 1 <= this (default 0.05)")
    p.add_argument("--target", type=float, default=0.95,
                   help="SLO attainment every class with an SLO must keep (default 0.95)")
    p.add_argument("--guess", type=float, default=None,
                   help="start rate of the bisection (default: a coarse grid's estimate)")
    p.add_argument("--loads", default="0.5,0.8,1,1.25",
                   help="latency at these fractions of the capacity (default 0.5,0.8,1,1.25)")
    p.add_argument("--cold", action="store_true",
                   help="do not prime shared prefixes (default: as the config's suite.cache)")


def options(pairs: list[str]) -> dict:
    """``K=V`` pairs, each V a TOML value (a bare word is a string)."""
    out = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--options {pair[:60]}: not KEY=VALUE; write e.g. rdma_gb_s=50")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        out[key.strip()] = value
    return out


def _lacks_workloads(path: Path) -> bool:
    try:
        return "workloads" not in tomllib.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def _fractions(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--loads {text[:60]}: not a list of numbers; write e.g. "
                        "0.5,0.8,1,1.25") from None
    if not out or any(not 0 < x <= 10 for x in out):
        raise UserError(f"--loads {text[:60]}: give fractions of the capacity above 0 and at "
                        "most 10, e.g. 0.5,0.8,1,1.25")
    return out


def run(args) -> int:
    import logging

    from kvbench.config import load_config
    from kvbench.runs import predict as pr

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    if args.seeds < 1 or args.seconds <= 0 or args.warmup_s < 0 or not 0 < args.precision \
            or not 0 < args.target < 1:
        raise UserError("--seeds must be at least 1, --seconds and --precision above 0, "
                        "--warmup-s at least 0 and --target between 0 and 1; fix the one "
                        "out of range")
    path = Path(args.config)
    try:
        cfg = load_config(path, under=args.slo_config)
    except UserError:
        if args.slo_config is None and _lacks_workloads(path):
            raise UserError(f"{path}: no [workloads.*] tables to predict under (a twin file "
                            "holds its endpoint only); pass --slo-config bench.toml, the "
                            "suite whose workloads and SLOs to use") from None
        raise
    workload = args.workload
    if args.save is not None:
        _, wls = pr.run_workloads(args.save)
        if workload is None and len(wls) == 1 and wls[0] in cfg.workloads:
            workload = wls[0]
    settings = pr.Settings(workload=workload, topology=args.topology,
                           options=options(args.options), endpoint=args.endpoint,
                           seed=args.seed, seeds=args.seeds, seconds=args.seconds,
                           warmup_s=args.warmup_s, target=args.target,
                           precision=args.precision, guess=args.guess,
                           loads=_fractions(args.loads), warm=False if args.cold else None)
    measured = pr.measured_as(cfg, [ep.name for ep in pr.endpoints(cfg, path, settings)],
                              args.save) if args.save is not None else None
    say = (lambda line: print(f"  {line}", file=sys.stderr, flush=True)) \
        if args.format == "text" and sys.stderr.isatty() else (lambda line: None)
    res = pr.predict(cfg, path, settings, say)
    if args.save is not None:
        saved = pr.save(res, cfg, args.save, measured)
        print(f"kvbench predict: saved to {saved} (kvbench report {args.save} sets it beside "
              "the measurement)", file=sys.stderr)
    if args.format == "json":
        import json

        print(json.dumps(pr.finite(res), indent=1, default=str, allow_nan=False))
    else:
        print(render(res, markdown=args.format == "md"))
    return 0


def _num(x, fmt: str = ".3g") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _value(v) -> str:
    return "derived" if v is None else str(v)


def render(res: dict, markdown: bool = False) -> str:
    """The prediction as text (or Markdown): per endpoint its capacity, classes, latency
    against offered rate, and the parameters fitted and assumed."""
    h = (lambda t: f"### {t}") if markdown else (lambda t: t)
    bullet = "- " if markdown else "  "
    lines = [h(f"kvbench predict: {res['workload']} on {res['config']} (PREDICTED)"),
             f"{bullet}{res['note'][0].upper()}{res['note'][1:]}.",
             f"{bullet}capacity at SLO: every class with an SLO keeps {res['target']:.0%} of "
             f"its requests; {res['seconds']:g} s judged per rate after {res['warmup_s']:g} s; "
             f"bisected to {res['precision']:g}; seeds {res['seeds']}; "
             f"{'warm' if res['warm'] else 'cold'} cache"]
    if res["skipped"]:
        lines.append(f"{bullet}not predicted (not built-in; kvbench calibrate fits a twin of "
                     f"one): {', '.join(res['skipped'])}")
    for e in res["endpoints"]:
        c = e["capacity"]
        title = e["endpoint"] + (f" as {e['topology']} (what-if)" if e["what_if"] else
                                 f" ({e['topology']})")
        lines += ["", h(title), f"{bullet}GPUs: {e['gpus']} ({e['gpus_how']})"]
        if e["what_if_layout"]:
            lines.append(f"{bullet}what-if layout: {e['what_if_layout']}")
        if c["median"] is None:
            lines.append(f"{bullet}predicted capacity: none found ({e['start']['from']})")
        else:
            bf = c["breaks_first"]
            lines.append(f"{bullet}predicted capacity: {c['median']:.3f} req/s, "
                         f"{c['median_per_gpu']:.3f} per GPU (min {c['min']:.3f}, max "
                         f"{c['max']:.3f}); breaks first: {bf['class']} ({bf['slo']})")
        if e["classes"]:
            lines += ["", "| class | share | predicted req/s at capacity | attainment there |"
                      " passes at | fails at |", "|---|---|---|---|---|---|"]
            for cls, x in e["classes"].items():
                own = x["own_limit"]
                lines.append(f"| {cls} | {x['share']:.1%} | {x['rate_at_capacity']:.3f} | "
                             f"{x['attainment_at_capacity']:.3f} | {_num(own['passes_at'])} | "
                             f"{_num(own['fails_at'])} |")
        if e["latency"]:
            lines += ["", "predicted latency against offered rate (ms):", "",
                      "| req/s | load | class | attainment | TTFT p50 | TTFT p99 | TPOT p50 |"
                      " TPOT p99 | prefix hit ratio |", "|---|---|---|---|---|---|---|---|---|"]
            for p in e["latency"]:
                for cls, x in p["classes"].items():
                    lines.append(f"| {p['rate']:.3f} | {p['load']:g}x | {cls} | {x['att']:.3f} | "
                                 f"{_num(x['ttft_p50_ms'], '.0f')} | "
                                 f"{_num(x['ttft_p99_ms'], '.0f')} | "
                                 f"{_num(x['tpot_p50_ms'], '.1f')} | "
                                 f"{_num(x['tpot_p99_ms'], '.1f')} | "
                                 f"{_num(x.get('hit_ratio'), '.3f')} |")
        lines.append("")
        if e["fitted"]:
            lines.append(f"{bullet}fitted ([twin]): " + ", ".join(
                f"{f['option']}={f['value']}" + (f" +/- {f['stderr']:.3g}" if f["stderr"] else "")
                + (f" ({f['status']})" if f["status"] != "fit" else "") for f in e["fitted"]))
        else:
            lines.append(f"{bullet}fitted: none (no [twin] table for this endpoint): every "
                         "parameter below is assumed")
        hidden = [a for a in e["assumed"] if a["unobserved"]]
        if hidden:
            lines.append(f"{bullet}ASSUMED, not observable on {e['measured_topology']}: "
                         + ", ".join(f"{a['option']}={_value(a['value'])} ({a['source']})"
                                     for a in hidden))
        rest = [a for a in e["assumed"] if not a["unobserved"]]
        for src in ("--options", "what-if layout", "given", "default"):
            some = [a for a in rest if a["source"] == src]
            if some:
                lines.append(f"{bullet}assumed ({src}): " + ", ".join(
                    f"{a['option']}={_value(a['value'])}" for a in some))
    lines += ["", f"{res['wall_s']:.1f} s wall, {res['cpu_s']:.1f} CPU s"]
    return "\n".join(lines)
