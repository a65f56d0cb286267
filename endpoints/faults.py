"""Fault injection: drawn per request from the configured rates, or asked for by the client
with the ``x-kvbench-fault`` header (which then replaces the draw)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvbench.endpoints.config import EmulatorConfig
from kvbench.endpoints.protocol import ApiError

HEADER = "x-kvbench-fault"


@dataclass
class Faults:
    """The faults of one request; times in milliseconds of wall time."""

    error: int | None = None
    rate_limit: bool = False
    stall_before_ms: float = 0.0
    stall_mid_ms: float = 0.0
    reset: bool = False
    malformed: bool = False
    slow_headers_ms: float = 0.0

    @property
    def mid_stream(self) -> bool:
        """True when the stream itself misbehaves (its writes go through the handler task)."""
        return bool(self.malformed or self.reset or self.stall_mid_ms)


def parse_fault_header(value: str, cfg: EmulatorConfig) -> Faults:
    """``x-kvbench-fault: error=503, stall_mid=500, reset, malformed, rate_limit,
    stall_before=ms, slow_headers=ms`` (comma-separated)."""
    f = Faults()
    fc = cfg.faults
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, arg = part.partition("=")
        name = name.strip().lower().replace("-", "_")
        arg = arg.strip()
        try:
            if name == "error":
                f.error = int(arg) if arg else fc.error_statuses[0]
                if not 400 <= f.error <= 599:
                    raise ValueError
            elif name in ("rate_limit", "429"):
                f.rate_limit = True
            elif name == "stall_before":
                f.stall_before_ms = float(arg) if arg else fc.stall_ms
            elif name == "stall_mid":
                f.stall_mid_ms = float(arg) if arg else fc.stall_ms
            elif name == "reset":
                f.reset = True
            elif name == "malformed":
                f.malformed = True
            elif name == "slow_headers":
                f.slow_headers_ms = float(arg) if arg else fc.slow_headers_ms
            else:
                raise KeyError
        except (ValueError, KeyError):
            raise ApiError(400, f"header x-kvbench-fault: cannot read {part!r}; use error=CODE, "
                                "rate_limit, stall_before=MS, stall_mid=MS, reset, malformed "
                                "or slow_headers=MS", param="x-kvbench-fault") from None
    return f


def draw_faults(rng: random.Random, cfg: EmulatorConfig) -> Faults:
    fc = cfg.faults
    f = Faults()
    if fc.error_rate and rng.random() < fc.error_rate:
        f.error = rng.choice(fc.error_statuses)
    if fc.rate_limit_rate and rng.random() < fc.rate_limit_rate:
        f.rate_limit = True
    if fc.stall_before_rate and rng.random() < fc.stall_before_rate:
        f.stall_before_ms = fc.stall_ms
    if fc.stall_mid_rate and rng.random() < fc.stall_mid_rate:
        f.stall_mid_ms = fc.stall_ms
    if fc.reset_rate and rng.random() < fc.reset_rate:
        f.reset = True
    if fc.malformed_rate and rng.random() < fc.malformed_rate:
        f.malformed = True
    if fc.slow_headers_rate and rng.random() < fc.slow_headers_rate:
        f.slow_headers_ms = fc.slow_headers_ms
    return f


def faults_for(header: str | None, rng: random.Random, cfg: EmulatorConfig) -> Faults:
    """The header's faults when the client sent one, else a draw from the configured rates."""
    return parse_fault_header(header, cfg) if header else draw_faults(rng, cfg)
