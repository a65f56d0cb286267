"""``kvbench locustfile NAME``: the absolute path of an installed locustfile, so a wheel user
runs ``locust -f "$(kvbench locustfile longctx)" --host ...``."""

from __future__ import annotations


def add_parser(p) -> None:
    p.add_argument("name", help="longctx, rag, agent, mix, trace, ... (the locustfiles shipped)")


def run(args) -> int:
    from kvbench.runs.locust import locustfile

    print(locustfile(args.name))
    return 0
