"""``kvbench probe retention``: how long a prefix stays cached under background load (the work
is ``kvbench.runs.retention``; the report ``kvbench.reports.analysis.retention``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvbench.core.errors import UserError
from kvbench.core.redact import redact_url


def add_parser(p) -> None:
    sub = p.add_subparsers(dest="probe", metavar="PROBE", required=True)
    r = sub.add_parser("retention", help="hit probability and TTFT of a resent prefix against "
                       "the idle gap, under a background working set")
    r.add_argument("--config", default=None, help="bench.toml holding --endpoint")
    r.add_argument("--endpoint", default=None,
                   help="an [[endpoints]] name of --config (a built-in one is started)")
    r.add_argument("--url", default=None, help="or a server's base URL")
    r.add_argument("--model", default=None, help="model (default: the first /v1/models lists)")
    r.add_argument("--engine", default="auto", help="engine family (default: from /metrics)")
    r.add_argument("--gaps", default="0.25:4", metavar="LOW:HIGH[:FACTOR]",
                   help="idle gaps in seconds, a geometric ladder (default 0.25:4, factor 2)")
    r.add_argument("--working-set", default="0.5,2", metavar="M,...",
                   help="background working sets as multiples of the KV capacity")
    r.add_argument("--capacity-tokens", type=int, default=None,
                   help="KV capacity per replica (default: the engine's /metrics)")
    r.add_argument("--probe-tokens", type=int, default=0, help="default: capacity / 16")
    r.add_argument("--background-tokens", type=int, default=0,
                   help="tokens per background prompt (default: capacity / 32)")
    r.add_argument("--rate-tokens-s", type=float, default=0.0,
                   help="background prompt tokens per second (default: the LRU knee mid-ladder)")
    r.add_argument("--trials", type=int, default=1, help="probes per point")
    r.add_argument("-o", "--output", type=Path, default=None,
                   help="folder for retention.json and retention.html "
                        "(default: results/retention-<time>)")


def _floats(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.replace(":", ",").split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} {text!r}: give numbers, e.g. 0.25:4 or 0.5,2") from None
    if not out or any(x <= 0 for x in out):
        raise UserError(f"{what} {text!r}: every value must be positive")
    return out


def run(args) -> int:
    from kvbench import engines
    from kvbench.reports.analysis import retention as report
    from kvbench.runs import builtin, cache, preflight
    from kvbench.runs import retention as R
    from kvbench.workloads.tokenizer import get_tokenizer

    g = _floats(args.gaps, "--gaps")
    if len(g) not in (2, 3):
        raise UserError(f"--gaps {args.gaps!r}: give LOW:HIGH or LOW:HIGH:FACTOR")
    gaps = R.ladder(g[0], g[1], g[2] if len(g) == 3 else 2.0)
    sets = _floats(args.working_set, "--working-set")
    if args.trials < 1:
        raise UserError("--trials must be at least 1")
    proc, tokenizer, ep = None, None, None
    if args.endpoint:
        from kvbench.config import load_config

        cfg = load_config(args.config or "bench.toml")
        try:
            ep = cfg.endpoint(args.endpoint)
        except KeyError:
            raise UserError(f"--endpoint {args.endpoint}: not an [[endpoints]] name of "
                            f"{args.config or 'bench.toml'}") from None
        tokenizer = get_tokenizer(cfg.suite.tokenizer)
    elif not args.url:
        raise UserError("give --url of a server, or --config and --endpoint")
    try:
        if ep is not None and ep.kind == "builtin":
            proc, url = builtin.start(ep)
        else:
            url = (args.url or ep.url).rstrip("/")
        headers = preflight.endpoint_headers(ep) if ep is not None else {}
        model = args.model or getattr(ep, "model", None) or _first_model(url, headers)
        adapter = (engines.get(args.engine) if args.engine != "auto" else
                   preflight.adapter_for(ep or _Bare(url), url, headers))
        counters = cache.read_counters(
            (getattr(ep, "metrics_url", None) or url + "/metrics"), adapter, headers) or {}
        capacity = args.capacity_tokens or counters.get("capacity_tokens")
        if not capacity:
            raise UserError(f"{url}: the engine publishes no KV capacity; pass "
                            "--capacity-tokens (per replica)")
        spec = R.ProbeSpec(gaps, sets, int(capacity), int(counters.get("block_tokens") or
                                                          adapter.default_block_tokens),
                           args.probe_tokens, args.background_tokens, args.rate_tokens_s,
                           args.trials)
        print(f"kvbench probe retention: {redact_url(url)}, capacity {int(capacity):,} tokens, "
              f"{len(sets)} working set(s) x {len(gaps)} gaps x {args.trials} trial(s), about "
              f"{len(sets) * sum(gaps) * args.trials:.0f} s", flush=True)

        def progress(p) -> None:
            print(f"  working set {p.working_set:g}x gap {p.gap_s:g} s: cached "
                  f"{p.cached_tokens}/{p.probe_tokens}, TTFT {1e3 * p.ttft_s:.1f} ms (cold "
                  f"{1e3 * p.ttft_cold_s:.1f} ms), {p.background_new_tokens:,} new background "
                  "tokens", flush=True)

        result = R.probe(url, model, spec, headers=headers, tokenizer=tokenizer,
                         adapter=adapter,
                         endpoint=getattr(ep, "name", None) or redact_url(url),
                         progress=progress).to_dict()
    finally:
        if proc is not None:
            builtin.stop(proc)
    out = args.output or Path("results") / time.strftime("retention-%Y%m%dT%H%M%SZ",
                                                         time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    (out / "retention.json").write_text(json.dumps(result, indent=1))
    (out / "retention.html").write_text(report.render_html(result), encoding="utf-8")
    for r in report.summary(result):
        knee = (f"knee at {r['knee_gap_s']:.3g} s" if r["knee_gap_s"] else "no knee")
        pred = (f"LRU predicts {r['predicted_gap_s']:.3g} s" if r["predicted_gap_s"]
                else "LRU predicts none (the working set fits beside the probe)")
        print(f"working set {r['working_set']:g}x: {knee}; {pred}")
    print(f"kvbench probe retention: wrote {out / 'retention.html'}", file=sys.stderr)
    return 0


class _Bare:
    """An endpoint given by URL alone (for the engine detection)."""

    def __init__(self, url: str):
        self.name, self.url, self.engine, self.metrics_url = url, url, "auto", None


def _first_model(url: str, headers: dict) -> str:
    from kvbench.runs.preflight import http_json

    try:
        return http_json(url + "/v1/models", headers=headers)["data"][0]["id"]
    except Exception:  # noqa: BLE001 - any failure: tell the user
        raise UserError(f"{url}/v1/models did not name a model; pass --model") from None
