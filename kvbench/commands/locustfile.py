"""``kvbench locustfile NAME``: the absolute path of an installed locustfile, so a wheel user
runs ``locust -f "$(kvbench locustfile longctx)" --host ...``; ``kvbench locustfile --options``:
the ``--kvbench-*`` options a locustfile adds to Locust's, with their help. Locust prints
``--help`` before it imports a locustfile (locustio/locust#2917), so ``locust -f ... --help``
cannot list them; the web UI's form does."""

from __future__ import annotations


def add_parser(p) -> None:
    p.add_argument("name", nargs="?",
                   help="longctx, rag, agent, mix, trace, ... (the locustfiles shipped)")
    p.add_argument("--options", action="store_true",
                   help="list the --kvbench-* options the locustfiles add to locust's own, "
                        "with their help and environment variables")


def options_help() -> str:
    """The help of every ``--kvbench-*`` option, as Locust's parser would print it: what a
    locustfile imports is imported, and every listener it registers fills a parser of
    Locust's kind."""
    from locust import events
    from locust.argument_parser import LocustArgumentParser

    import kvbench.loadgen.user  # noqa: F401 - what every shipped locustfile imports

    parser = LocustArgumentParser(prog="locust -f LOCUSTFILE", add_help=False,
                                  description="kvbench's options to locust (each also reads "
                                              "the environment variable shown)")
    events.init_command_line_parser.fire(parser=parser)
    return parser.format_help()


def run(args) -> int:
    if args.options:
        print(options_help(), end="")
        return 0
    if not args.name:
        from kvbench.core.errors import UserError

        raise UserError("kvbench locustfile: name a locustfile (longctx, rag, agent, mix, "
                        "trace, ...) or pass --options")
    from kvbench.runs.locust import locustfile

    print(locustfile(args.name))
    return 0
