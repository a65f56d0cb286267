"""A run of the bench.toml matrix: the resolved job handed to each load process, the matrix,
preflight checks, and finalize (the one writer of run.json)."""
