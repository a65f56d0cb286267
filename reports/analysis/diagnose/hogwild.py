"""The Hogwild! finding: parallel workers on one task that gain too little over a single one
(seed 000's row)."""

from __future__ import annotations

from kvbench.reports.statistics import metrics as M
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose.base import Finding, _fmt

HOGWILD_GAIN = 1.3  # seed 000: "Hogwild! gain under 1.3x -> Revert to single-worker"


def hogwild(d: ReportData) -> list[Finding]:
    f = d.frame
    hw = f[f["request_class"] == "hogwild"]
    if len(hw) == 0:
        return []
    specs = {}
    for run in d.runs:
        for name, spec in (run.config.get("workloads") or {}).items():
            if isinstance(spec, dict) and spec.get("kind") == "hogwild":
                specs[name] = spec
    out = []
    for ep, sub in hw.groupby("endpoint", observed=True):
        per_task = {}
        for wl, w in sub.groupby("workload", observed=True):
            spec = specs.get(str(wl))
            if spec is None:
                continue
            end = (w["t_sent_ns"] + w["e2e_ms"].fillna(0) * M.NS_PER_MS).max()
            makespan_s = (end - w["t_sent_ns"].min()) / 1e9
            per_task[str(wl)] = (int(spec.get("workers", 4)), makespan_s
                                 / max(int(spec.get("tasks", 2)), 1))
        base = [t for wl, (n, t) in per_task.items() if n == 1]
        if not base:
            continue
        t1 = min(base)
        for wl, (n, t) in sorted(per_task.items()):
            if n <= 1 or t <= 0:
                continue
            speedup = t1 / t
            if speedup >= HOGWILD_GAIN:
                continue
            below = speedup < 1
            out.append(Finding(
                "hogwild", f"{ep}: Hogwild! with {n} workers is "
                + ("slower than one worker" if below else "barely faster than one worker"),
                [("per-task completion, 1 worker", _fmt(t1, "s")),
                 (f"per-task completion, {n} workers ({wl})", _fmt(t, "s")),
                 ("speedup", f"{speedup:.2f}x (worth it from {HOGWILD_GAIN}x)")],
                "the workers duplicate each other's work" if below else
                "coordination through the shared cache dominates the parallel gain",
                "use a reasoning model that divides the work (seed 000), or revert to a single "
                "worker" if below else "revert to a single worker for this task",
                endpoint=str(ep), numbers={"speedup": speedup}))
    return out

