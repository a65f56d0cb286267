"""kvbench's built-in reference endpoints (``kvbench serve``): vLLM's metric names and
``/tokenize`` and its dev-mode ``POST /reset_prefix_cache`` (always served, refused with 409
while requests are in flight), plus ``kvbench:`` metrics of the emulator's own, which identify it."""

from __future__ import annotations

from dataclasses import replace

from kvbench.engines.base import HttpCall, register
from kvbench.engines.vllm import VLLM

BUILTIN = register(replace(
    VLLM, name="builtin", title="kvbench built-in emulator", prefixes=("kvbench:",),
    reset_cache=HttpCall("POST", "/reset_prefix_cache", "refused (409) while requests run"),
    priority=10))
