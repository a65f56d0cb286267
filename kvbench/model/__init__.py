"""The seeds' cost model and hardware/model profiles: pure functions, no I/O."""
