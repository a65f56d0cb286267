"""kvbench's built-in reference endpoints (``kvbench serve``): vLLM's metric names and
``/tokenize``, plus ``kvbench:`` metrics of the emulator's own, which identify it."""

from __future__ import annotations

from dataclasses import replace

from kvbench.engines.base import register
from kvbench.engines.vllm import VLLM

BUILTIN = register(replace(
    VLLM, name="builtin", title="kvbench built-in emulator", prefixes=("kvbench:",),
    reset_cache=None, priority=10))
