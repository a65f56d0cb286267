"""``kvbench workloads describe|generate``: what a workload or trace would send."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from kvbench.core.errors import UserError


def add_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    d = sub.add_parser("describe", help="request count, token percentiles, unique tokens and "
                       "the theoretical prefix-cache hit ratio",
                       description="Summarise a [workloads.*] table of the config, or a trace "
                       "file/directory, without sending anything.")
    d.add_argument("target", nargs="*", metavar="WORKLOAD|TRACE",
                   help="workload names from the config, or trace paths (default: every "
                   "workload of the config)")
    _common(d)
    d.add_argument("--capacity-tokens", type=int, default=None, metavar="N",
                   help="KV capacity for the LRU hit ratio (default: the workload's "
                   "working_set.kv_capacity_tokens, else none)")
    d.add_argument("--block-tokens", type=int, default=None, metavar="N",
                   help="KV block size in tokens (default 16; Mooncake traces always use "
                   "their 512-token hash_ids blocks)")
    d.add_argument("--json", action="store_true", help="print the summaries as JSON")
    g = sub.add_parser("generate", help="write a workload's requests as JSON lines",
                       description="Write every request of a workload (sessions answered "
                       "with synthetic responses) to a JSONL file.")
    g.add_argument("target", metavar="WORKLOAD|TRACE")
    _common(g)
    g.add_argument("--out", required=True, metavar="FILE.jsonl", help="output file ('-' for "
                   "stdout)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="bench.toml", metavar="FILE",
                   help="the suite config (default: ./bench.toml)")
    p.add_argument("--format", choices=("mooncake", "azure", "lmcache_agent", "agentic"),
                   default=None,
                   help="trace format (default: guessed from the path)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only the first N requests")
    p.add_argument("--speedup", type=float, default=1.0, help="trace replay speed-up")
    p.add_argument("--jitter-s", type=float, default=0.0,
                   help="seeded uniform jitter added to trace arrivals, in trace seconds")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed trace lines (and count them) instead of failing")
    p.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="for traces: send chat messages or a completions prompt")
    p.add_argument("--shared-prefix", default=None, metavar="shared|per_conversation|F",
                   help="agentic traces: the tool/system prefix shared by every conversation "
                   "(default), each conversation's own, or a fraction F of it shared")


def _is_path(target: str) -> bool:
    return "/" in target or target.endswith((".jsonl", ".csv", ".json")) or \
        Path(target).exists()


def _workload(target: str, args, cfg_cache: dict):
    """(workload, default capacity) for a config name or a trace path."""
    from kvbench.workloads.tokenizer import get_tokenizer

    if _is_path(target):
        from pydantic import ValidationError

        from kvbench.workloads.registry import build_spec
        from kvbench.workloads.traces import TraceSpec, guess_format

        path = Path(target)
        if not path.exists():
            raise UserError(f"{path}: no such trace file or directory; check the path")
        fmt = args.format or guess_format(path)
        extra = {}
        if args.shared_prefix is not None:
            extra["shared_prefix"] = _shared_prefix(args.shared_prefix)
        try:
            spec = TraceSpec(format=fmt, path=str(path), limit=args.limit,
                             speedup=args.speedup, jitter_s=args.jitter_s,
                             skip_bad_lines=args.skip_bad_lines, api=args.api, **extra)
        except ValidationError as err:
            first = err.errors()[0]
            raise UserError(f"option --{first['loc'][0]}: {first['msg']}; fix the value") \
                from None
        tok_spec = None
        if Path(args.config).exists():
            tok_spec = _config(args, cfg_cache).suite.tokenizer
        return build_spec(path.name, spec, get_tokenizer(tok_spec), 0), None
    from kvbench.workloads.registry import make_workload

    cfg = _config(args, cfg_cache)
    wl = make_workload(target, cfg)
    ws = getattr(cfg.workloads[target], "working_set", None)
    return wl, ws.kv_capacity_tokens if ws is not None else None


def _shared_prefix(text: str):
    if text in ("shared", "per_conversation"):
        return text
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not 0 <= x <= 1:
        raise UserError(f"option --shared-prefix {text!r} is not shared, per_conversation or a "
                        "fraction from 0 to 1; fix the value")
    return x


def _config(args, cache: dict):
    if "cfg" not in cache:
        from kvbench.config import load_config
        cache["cfg"] = load_config(args.config)
    return cache["cfg"]


def run(args) -> int:
    if args.action is None:
        raise UserError("kvbench workloads needs an action: describe or generate "
                        "(see kvbench workloads --help)")
    if args.limit is not None and args.limit <= 0:
        raise UserError("option --limit must be a positive number of requests")
    if args.action == "generate":
        return _generate(args)
    return _describe(args)


def _describe(args) -> int:
    import orjson

    from kvbench.workloads.describe import describe

    cache: dict = {}
    targets = list(args.target)
    traces: set = set()  # the config's trace workloads, when every workload is described
    if not targets:
        cfg = _config(args, cache)
        targets = list(cfg.workloads)
        traces = {n for n, w in cfg.workloads.items() if getattr(w, "kind", None) == "trace"}
    if args.block_tokens is not None and args.block_tokens <= 0:
        raise UserError("option --block-tokens must be a positive number of tokens")
    if args.capacity_tokens is not None and args.capacity_tokens <= 0:
        raise UserError("option --capacity-tokens must be a positive number of tokens")
    out = {}
    for target in targets:
        try:
            wl, default_cap = _workload(target, args, cache)
        except UserError as err:
            # describing the whole config: a trace whose files are not on this machine (a
            # checkout without ../shared/traces) is said and passed over; named, it fails
            if target not in traces:
                raise
            print(f"kvbench: workload {target} skipped: {err}", file=sys.stderr)
            continue
        cap = args.capacity_tokens if args.capacity_tokens is not None else default_cap
        out[target] = describe(wl, block_tokens=args.block_tokens or 16,
                               capacity_tokens=cap, limit=args.limit,
                               progress=sys.stderr.isatty() or not args.json)
    if args.json:
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(format_table(out))
    return 0


def _fmt_tokens(x) -> str:
    if x is None:
        return "-"
    x = float(x)
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def _fmt_ratio(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(summaries: dict) -> str:
    """A plain-text table, one row per workload, then notes."""
    head = ["workload", "requests", "classes", "prompt p50/p90/p99/max", "output p50/p99",
            "unique tok", "total tok", "hit unbounded", "hit LRU (cap)", "block"]
    rows = []
    notes = []
    for name, d in summaries.items():
        p, o = d["prompt_tokens_pcts"], d["output_tokens_pcts"]
        classes = ",".join(f"{c}:{n}" for c, n in sorted(d.get("classes", {}).items()))
        lru = d["theoretical_hit_ratio_lru"]
        cap = d.get("capacity_tokens")
        rows.append([
            name, f"{d['requests']:,}", classes,
            "/".join(_fmt_tokens(p[k]) for k in ("p50", "p90", "p99", "max")),
            "/".join(_fmt_tokens(o[k]) for k in ("p50", "p99")),
            _fmt_tokens(d["unique_tokens"]), _fmt_tokens(d["total_prompt_tokens"]),
            _fmt_ratio(d["theoretical_hit_ratio_unbounded"]),
            "-" if lru is None else f"{_fmt_ratio(lru)} ({_fmt_tokens(cap)})",
            str(d.get("block_tokens", "")),
        ])
        if d.get("duration_s") is not None:
            notes.append(f"{name}: arrivals span {d['duration_s']:.1f} s")
        if d.get("agentic"):
            notes.extend(f"{name}: {line}" for line in agentic_lines(d["agentic"]))
        notes.extend(f"{name}: {n}" for n in d.get("notes", []))
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))) for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = "\n".join(lines) + "\n"
    text += ("hit = theoretical prefix-cache hit ratio of prompt tokens (contiguous prefix, "
             "full blocks); unique tok = tokens an unbounded cache still computes\n")
    if notes:
        text += "\n".join(notes) + "\n"
    return text


def agentic_lines(a: dict) -> list[str]:
    """The agentic section of a summary, a line each."""
    f, la = a["context_first_request"], a["context_last_request"]
    return [
        f"{a['conversations']:,} conversations, {a['requests']:,} requests "
        f"({a['subagent_requests']:,} in {a['subagent_sessions']:,} sub-agent sessions, "
        f"{a['spawns']:,} spawns); {a['non_streaming_requests']:,} non-streaming",
        f"context growth: first request p50 {_fmt_tokens(f['p50'])} p90 "
        f"{_fmt_tokens(f['p90'])} -> last request p50 {_fmt_tokens(la['p50'])} p90 "
        f"{_fmt_tokens(la['p90'])} tokens",
        "within-conversation block hit ratio "
        f"{_fmt_ratio(a['within_conversation_block_hit_ratio'])} ({a['block_hits']:,} of "
        f"{a['blocks']:,} blocks of {a['block_size']} tokens; "
        f"{_fmt_ratio(a['conversation_wide_block_hit_ratio'])} counting sibling sub-agents): "
        f"{a['definition']}",
    ]


def _generate(args) -> int:
    import orjson

    cache: dict = {}
    wl, _ = _workload(args.target, args, cache)
    fh = sys.stdout.buffer if args.out == "-" else None
    try:
        if fh is None:
            fh = open(args.out, "wb")
    except OSError as exc:
        raise UserError(f"{args.out}: cannot write ({exc.strerror}); choose another --out") \
            from None
    n = 0
    try:
        for req in wl.requests():
            fh.write(orjson.dumps(asdict(req)) + b"\n")
            n += 1
            if args.limit is not None and n >= args.limit:
                break
    finally:
        if args.out != "-":
            fh.close()
    print(f"kvbench workloads: wrote {n} requests to {args.out}", file=sys.stderr)
    return 0
