"""bench.toml: the suite's schema, validated into typed objects before any load is sent.

Composed of each concern's own spec module: workload kinds (``kvbench.workloads.registry``),
endpoints (``endpoints``), load profiles (``load``), SLOs and gate rules
(``kvbench.reports.measures.spec``), collection (``kvbench.collectors.spec``). Every error is one
sentence naming the file, the field and the fix, raised as ``UserError``.
"""

from __future__ import annotations

from kvbench.collectors.spec import CollectConfig, GpuRole
from kvbench.config.bench import BenchConfig, SuiteConfig
from kvbench.config.endpoints import (
    DEFAULT_CONTEXT_TOKENS,
    BuiltinEndpoint,
    EndpointSpec,
    OpenAIEndpoint,
)
from kvbench.config.load import LoadProfile, Stage
from kvbench.config.parse import load_config, one_sentence, parse_config
from kvbench.reports.measures.spec import SLO, GateConfig, GateRule
from kvbench.workloads.specs import Strict

__all__ = [
    "BenchConfig", "BuiltinEndpoint", "CollectConfig", "DEFAULT_CONTEXT_TOKENS", "EndpointSpec",
    "GateConfig", "GateRule", "GpuRole", "LoadProfile", "OpenAIEndpoint", "SLO", "Stage",
    "Strict", "SuiteConfig", "load_config", "one_sentence", "parse_config",
]
