"""kvbench: a benchmark and load-testing suite for KV-cache-centric LLM serving."""

__version__ = "0.1.0"
