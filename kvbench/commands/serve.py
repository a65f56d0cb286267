"""``kvbench serve``: run one built-in reference endpoint until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
import tomllib
from pathlib import Path

import orjson

from kvbench.core.errors import UserError
from kvbench.model import topologies


def add_parser(p) -> None:
    default = topologies.default().name
    p.add_argument("--topology", choices=topologies.names(), default=default,
                   help=f"which serving design to emulate (default: {default})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    p.add_argument("--config", help="TOML file of emulator settings (endpoints.config)")
    p.add_argument("--options-json", help="emulator settings as a JSON object (over --config)")


def load_options(config: str | None, options_json: str | None) -> dict:
    options: dict = {}
    if config:
        path = Path(config)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: settings file not found; pass the path of a TOML file "
                            "with emulator settings") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: not valid TOML ({exc}); fix the syntax there") from None
        options.update(data.get("emulator", data))
    if options_json:
        try:
            extra = orjson.loads(options_json)
        except orjson.JSONDecodeError as exc:
            raise UserError(f"--options-json is not valid JSON ({exc}); pass an object such "
                            "as '{\"time_scale\": 0.1}'") from None
        if not isinstance(extra, dict):
            raise UserError("--options-json must be a JSON object such as '{\"slowdown\": 1.2}'")
        options.update(extra)
    return options


def build_config(topology: str, options: dict, where: str = "emulator settings"):
    from pydantic import ValidationError

    from kvbench.endpoints.config import validate_options

    try:
        return validate_options(topology, options)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
        msg = first["msg"].removeprefix("Value error, ")
        raise UserError(f"{where}: field {loc}: {msg}; see endpoints/config.py for the "
                        "settings and their ranges") from None


async def serve(cfg, host: str, port: int) -> None:
    from kvbench.endpoints.server import EmulatorServer

    srv = EmulatorServer(cfg, host, port)
    try:
        await srv.start()
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another "
                        "--port or use --port 0") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvbench serve: listening on {srv.url} (topology {cfg.topology})", flush=True)
    try:
        await stop.wait()
    finally:
        await srv.stop()


def run(args) -> int:
    from kvbench.runs import lifeline

    lifeline.watch_parent()  # started by kvbench run: stop when it dies (SIGTERM, handled)
    options = load_options(args.config, args.options_json)
    cfg = build_config(args.topology, options, args.config or "--options-json")
    asyncio.run(serve(cfg, args.host, args.port))
    print("kvbench serve: stopped", file=sys.stderr, flush=True)
    return 0
