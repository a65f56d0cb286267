"""Engine adapters: one module per engine family (vLLM, SGLang, llama.cpp, TensorRT-LLM/Dynamo,
the built-in emulator), each registering an ``EngineAdapter`` at import. Every module of this
package is imported here, so a new family is one new file."""

from __future__ import annotations

import importlib
import pkgutil

from kvbench.engines.base import EngineAdapter, HttpCall, adapters, detect, get, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["EngineAdapter", "HttpCall", "adapters", "detect", "get", "register"]
