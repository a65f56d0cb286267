"""Names and places the results store accepts from the user: a run id is one plain folder of
the results folder (never a path, never one of the store's own folders), and the results
folder is a local path or an ``s3://bucket/prefix`` URL (``kvbench.core.objstore``: the run is
spooled locally and uploaded); another URL scheme is refused."""

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


def results_dir_problem(results_dir: str, remote_ok: bool = False) -> str | None:
    """Why ``results_dir`` cannot be the results folder (None: it can). ``remote_ok``: the
    caller (``kvbench run``, bench.toml) spools and uploads to ``s3://`` URLs; the others
    (a locustfile's ``--kvbench-results``) write a local folder only."""
    m = _SCHEME.match(results_dir.strip())
    if not m:
        return None
    from kvbench.core import objstore

    if not objstore.is_url(results_dir):
        return (f"{results_dir[:80]!r} is a URL ({m.group(1)}://), and results go to a local "
                "folder or to object storage as s3://BUCKET/PREFIX; give one of those")
    if not remote_ok:
        return (f"{results_dir[:80]!r} is an s3:// URL, which only kvbench run uploads to; "
                "give a local path here")
    try:
        objstore.parse(results_dir, env={})
    except ValueError as exc:
        return f"{results_dir[:80]!r}: {exc}"
    return None
