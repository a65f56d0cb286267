"""What is measured, per request: each metric's definition stated once, the request frame it is
evaluated into, the runs' data as the report reads them, metric names and the SLO spec."""
