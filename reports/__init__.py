"""Reports: from records to figures, findings, verdicts and pages.

* ``measures``: what is measured, per request: each metric's definition stated once
  (``definitions``, in the expression language of ``expr``, evaluated in memory and columnar),
  the request frame, the runs' data as the report reads them, the metric names and SLO spec;
* ``statistics``: estimates over requests and their intervals: the bootstrap engine
  (``resampling``), the metric kinds and the registry every figure is evaluated through;
* ``analysis``: what the figures say: capacity at SLO, overload, the Pareto frontier, the
  prefix-cache checks, engine counters, server traces, retention, history, the gate and the
  diagnosis;
* ``rendering``: the template context, tables, plots and the HTML and Markdown pages.

Each imports only those below it in this list (pyproject.toml's import-linter contracts).
The modules' old paths (``kvbench.reports.metrics``, ...) import as the same modules.
"""

from kvbench.core.moved import keep_old_paths

keep_old_paths(__name__, {
    "frame": "measures.frame", "spec": "measures.spec", "data": "measures.data",
    "resampling": "statistics.resampling", "metrics": "statistics.metrics",
    "capacity": "analysis.capacity", "overload": "analysis.overload",
    "pareto": "analysis.pareto", "cache_verify": "analysis.cache_verify",
    "engine_counters": "analysis.engine_counters", "server_traces": "analysis.server_traces",
    "retention": "analysis.retention", "history": "analysis.history", "gate": "analysis.gate",
    "diagnose": "analysis.diagnose", "render": "rendering.render", "plots": "rendering.plots",
})
