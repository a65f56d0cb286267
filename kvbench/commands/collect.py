"""``kvbench collect --listen HOST:PORT``: the remote telemetry agent for a GPU host (samples its
GPUs with NVML and serves them to ``kvbench run``; see collectors/agent.py)."""

from __future__ import annotations

import argparse
import os
import signal
import threading

from kvbench.core.errors import UserError


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"--listen {value!r}: expected HOST:PORT, e.g. "
                                         "127.0.0.1:9402 (port 0: any free port)")
    return host.strip("[]") or "127.0.0.1", int(port)


def add_parser(p: argparse.ArgumentParser) -> None:
    from kvbench.collectors.agent import DEFAULT_TOKEN_ENV
    from kvbench.collectors.agent_conn import IDLE_TIMEOUT_S, MIN_TOKEN_CHARS, REQUEST_TIMEOUT_S

    p.add_argument("--listen", type=_listen, default=("127.0.0.1", 9402), metavar="HOST:PORT",
                   help="address to serve samples on (default 127.0.0.1:9402; any address "
                        "other than loopback requires a token)")
    p.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, metavar="VAR",
                   help=f"environment variable holding the bearer token, at least "
                        f"{MIN_TOKEN_CHARS} characters (default {DEFAULT_TOKEN_ENV})")
    p.add_argument("--interval-s", type=float, default=0.1,
                   help="NVML sampling interval in seconds (default 0.1)")
    p.add_argument("--max-rows", type=int, default=1_000_000,
                   help="samples kept in memory; the oldest are dropped beyond (default 1e6)")
    p.add_argument("--idle-timeout-s", type=float, default=IDLE_TIMEOUT_S, metavar="S",
                   help="close a connection that sends no request for this long "
                        f"(default {IDLE_TIMEOUT_S:g})")
    p.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S, metavar="S",
                   help="close a connection whose request line and headers do not all arrive "
                        f"within this long of its first byte (default {REQUEST_TIMEOUT_S:g})")


def run(args) -> int:
    from kvbench.collectors.agent import AgentServer
    from kvbench.collectors.agent_conn import MAX_TIMEOUT_S

    if args.interval_s <= 0:
        raise UserError(f"kvbench collect: --interval-s {args.interval_s} must be above 0")
    for flag in ("idle_timeout_s", "request_timeout_s"):
        if not 0 < getattr(args, flag) <= MAX_TIMEOUT_S:
            raise UserError(f"kvbench collect: --{flag.replace('_', '-')} {getattr(args, flag)} "
                            f"must be above 0 and at most {MAX_TIMEOUT_S:g} (one day)")
    host, port = args.listen
    token = os.environ.get(args.token_env)  # set but blank is refused, not taken as none
    agent = AgentServer(host, port, token=token, interval_s=args.interval_s,
                        max_rows=args.max_rows, token_env=args.token_env,
                        idle_timeout_s=args.idle_timeout_s,
                        request_timeout_s=args.request_timeout_s)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    agent.start()
    try:
        status = agent.sampler.wait_ready(15)
        auth = "bearer token required" if token else "no token (loopback only)"
        print(f"kvbench collect: listening on {agent.url} (nvml: {status}; {auth})", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        agent.stop()
    return 0
