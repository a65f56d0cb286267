"""A run of the bench.toml matrix, below loadgen and above config: the resolved job handed to
each load process (job), the matrix (matrix), checks before load (preflight), built-in endpoints
(builtin), the Locust child per job (locust), telemetry, and finalize (the one writer of
run.json)."""
