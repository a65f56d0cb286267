"""Telemetry while the load runs: ``nvml`` (local GPUs), ``prometheus`` (engine /metrics and the
DCGM exporter), ``agent`` (remote ``kvbench collect`` and the puller with clock offsets),
``session`` (``start_collectors`` / ``CollectorHandle.stop`` for ``kvbench run``)."""
