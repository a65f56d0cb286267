"""run.json's account of a capacity search: each probe's stage gets its ``search`` note (role,
verdict, why, and the budget stop on the last), from the control files the run's searches
left (``runs.finalize`` calls ``annotate``)."""

from __future__ import annotations

from pathlib import Path

from kvbench.core.contract import SearchNote, StageEntry
from kvbench.runs.search.control import control_path, read_control


def annotate(run_dir: Path | str, stages: list[StageEntry]) -> list[StageEntry]:
    """``stages`` with each probe's ``SearchNote`` (the others as they are)."""
    notes: dict[tuple[str, int], SearchNote] = {}
    for path in Path(run_dir).glob("search-*.json"):
        control = read_control(path)
        if control is None:
            continue
        for k, p in enumerate(control.probes):
            last = k == len(control.probes) - 1
            notes[(path.name, p.index)] = SearchNote(
                role=p.role, verdict=p.verdict, why=p.why, estimate=p.estimate or None,
                target=p.target, confidence=p.confidence,  # what the report judges it against
                stop=control.stop if last else None)
    if not notes:
        return stages
    return [st.replace(search=notes[key]) if (key := _key(st)) in notes else st
            for st in stages]


def _key(stage: StageEntry) -> tuple[str, int]:
    return control_path("", stage.endpoint or "", stage.workload or "").name, stage.index
