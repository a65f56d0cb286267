"""The live figures of a running load (the web UI's tab, kvbench run's progress line), from the
report's own metric definitions."""
