"""The ``kvbench`` command line. Each subcommand lives in ``kvbench/commands/<name>.py`` with
``add_parser(subparsers)`` and ``run(args) -> int``; modules are imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvbench.core.errors import UserError
from kvbench.model import topologies

COMMANDS = {
    "run": "run the bench.toml matrix headless through Locust and write results",
    "report": "render an HTML (or Markdown) comparison report from results",
    "gate": "compare results with a baseline; exit code for CI",
    "history": "key metrics of recent runs in the results store",
    "recover": "write run.json of a killed run from its shards and job files",
    "serve": f"start a built-in reference endpoint ({', '.join(topologies.names())})",
    "collect": "run the remote telemetry agent on a GPU host",
    "workloads": "describe or generate workloads and traces",
    "locustfile": "print the path of an installed locustfile (locust -f \"$(kvbench locustfile "
                  "longctx)\")",
    "probe": "probe the endpoint's cache: retention (how long a prefix stays cached under "
             "background load)",
    "calibrate": "fit the built-in engine model to a calibration run: a twin endpoint (twin.toml)",
    "plan": "print the cost model's comparisons (routers, offload, P/D crossover, Hogwild!)",
    "predict": "capacity at SLO and latency of built-in endpoints (a calibrated twin) and "
               "what-if topologies, in virtual time, no load sent",
}


def _module(name: str):
    try:
        return importlib.import_module(f"kvbench.commands.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"kvbench.commands.{name}":
            return None
        raise


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbench", description="Benchmark LLM serving stacks built around the KV cache.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, help_text in COMMANDS.items():
        # Import only the command being run (imports such as locust or plotly are slow).
        mod = _module(name) if name == wanted else None
        p = sub.add_parser(name, help=help_text, description=help_text)
        if mod is not None:
            mod.add_parser(p)
            p.set_defaults(_run=mod.run)
    return parser


def _version() -> str:
    from kvbench import __version__

    return f"kvbench {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    run = getattr(args, "_run", None)
    if run is None:
        print(f"kvbench: '{args.command}' is not built yet in this version", file=sys.stderr)
        return 3
    try:
        return int(run(args) or 0)
    except UserError as exc:
        from kvbench.core.redact import redact

        print(f"kvbench: error: {redact(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kvbench: interrupted", file=sys.stderr)
        return 130
