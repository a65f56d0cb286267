"""``kvbench report RESULTS... [-o FILE] [--format html|md] [--slo-config bench.toml]
[--history N]``."""

from __future__ import annotations

import sys
from pathlib import Path

from kvbench.core.errors import UserError


def add_parser(p) -> None:
    p.add_argument("results", nargs="+", metavar="RESULTS",
                   help="results directories (results/<run_id>, or results/latest) or runs "
                        "on object storage (s3://BUCKET/PREFIX/RUN_ID, copied into a local "
                        "cache); several give one side-by-side bake-off")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="file to write (default: report.html in the first results directory "
                        "for html, standard output for md)")
    p.add_argument("--format", choices=("html", "md"), default="html",
                   help="html: one self-contained page; md: a compact summary for CI logs")
    p.add_argument("--slo-config", type=Path, default=None, metavar="BENCH_TOML",
                   help="take the SLOs from this bench.toml instead of the runs' own config")
    p.add_argument("--title", default=None, help="report title")
    p.add_argument("--history", type=int, default=30, metavar="N",
                   help="a History section with the trend of the last N runs of the results "
                        "store the run belongs to (its folder's parent or s3:// prefix), read "
                        "from its history manifest; 0: none (default 30)")


def run(args) -> int:
    from kvbench.commands.recover import local_run
    from kvbench.reports.rendering.render import render

    if args.history < 0:
        raise UserError(f"--history {args.history}: give a number of runs, 0 for none")
    sources = list(args.results)  # the store a run belongs to: where the user named it
    args.results = [local_run(spec) for spec in args.results]  # s3://: a local copy
    for path in args.results:
        if not path.is_dir():
            raise UserError(f"{path}: not a results directory; pass the folder kvbench run "
                            "wrote (results/<run_id> or results/latest)")
    from kvbench.commands.recover import ensure_recovered

    for path in args.results:
        ensure_recovered(path)  # a killed run: its run.json rebuilt first
    slo = None
    if args.slo_config is not None:
        from kvbench.config import load_config

        slo = load_config(args.slo_config).slo
    text = render(args.results, args.format, slo=slo, title=args.title, history=args.history,
                  sources=sources)
    out = args.output
    if out is None and args.format == "html":
        out = args.results[0] / "report.html"
    if out is None:
        sys.stdout.write(text)
        return 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{out}: cannot write the report ({exc.strerror}); choose another "
                        "path with -o") from None
    print(f"kvbench report: wrote {out} ({len(text) / 1e6:.1f} MB)", file=sys.stderr)
    return 0
