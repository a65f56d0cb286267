"""Names and places the results store accepts from the user: a run id is one plain folder of
the results folder (never a path, never one of the store's own folders), and the results
folder is a local path (a URL scheme names object storage, which the store does not write)."""

from __future__ import annotations

import re

from kvbench.core.contract import NAME_PATTERN

# folders of a results folder that belong to the store, not to a run, and the name
# ``kvbench gate --baseline`` reads as "the last run that passed"
RESERVED_RUN_IDS = ("history", "latest", "last-pass")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a run's folder (None: it can). Run ids follow the rule of
    endpoint and workload names: letters, digits, '_', '.' and '-', at most 64 characters,
    starting with a letter or digit; so no '/', no '..', nothing absolute."""
    if not re.fullmatch(NAME_PATTERN, run_id):
        return (f"{run_id[:60]!r} is not a plain name; use letters, digits, '_', '.' and '-' "
                "only, at most 64 characters, starting with a letter or digit (it names one "
                "folder inside the results folder)")
    if ".." in run_id:
        return f"{run_id!r} holds '..'; pick a name without it"
    if run_id.lower() in RESERVED_RUN_IDS:
        return (f"{run_id!r} is a name the results store keeps for itself; pick another "
                f"(not {', '.join(RESERVED_RUN_IDS)})")
    return None


def results_dir_problem(results_dir: str) -> str | None:
    """Why ``results_dir`` cannot be the results folder (None: it can)."""
    m = _SCHEME.match(results_dir.strip())
    if m:
        return (f"{results_dir[:80]!r} is a URL ({m.group(1)}://), and results are written to "
                "a local folder only (object storage is not supported yet); give a local path "
                "and copy the run folder there afterwards")
    return None
