"""One numbering of load stages for people, wherever a stage is named: the console of kvbench
run, run.json's search notes ("started assuming probe N passed") and the report.

A stage is numbered by its run.json ``index`` + 1 (the first stage of a job is 1). A capacity
search's stages are "probe N", a fixed ladder's "stage N"; a search's warm-up (role
``warmup``, unjudged) is "warm-up" and has no probe number. Pure functions, no imports: the
load process's side of the search reads this module too."""

from __future__ import annotations


def number(index: int) -> int:
    """The number people read for run.json stage ``index``."""
    return int(index) + 1


def label(index: int, role: str | None = None, search: bool = True) -> str:
    """"warm-up", "probe N" (a search's stage) or "stage N" (a ladder's)."""
    if role == "warmup":
        return "warm-up"
    return f"{'probe' if search else 'stage'} {number(index)}"


def stage_label(stage) -> str:
    """The label of a run.json stage (a ``StageEntry``): its search note decides probe or
    stage."""
    note = getattr(stage, "search", None)
    return label(stage.index, getattr(note, "role", None), note is not None)


def labels(stages) -> dict[tuple[str, str, int], str]:
    """(endpoint, workload, index) -> label, for every stage of ``stages`` (rows of a request
    frame carry the same three keys)."""
    return {(str(s.endpoint), str(s.workload), int(s.index)): stage_label(s) for s in stages}


def label_of(keys: dict[tuple[str, str, int], str], endpoint, workload, index) -> str:
    """The label of a frame row's stage; "stage N" where run.json does not list it."""
    return keys.get((str(endpoint), str(workload), int(index)), label(int(index), search=False))
