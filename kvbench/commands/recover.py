"""``kvbench recover RESULTS...``: write run.json of a run whose finalizer was killed (SIGKILL of
the load process or of ``kvbench run``, a crash, a power cut): its shards are compacted, each
request started but never recorded becomes a ``cancelled`` record with its send times, and
run.json is rebuilt from the job file(s) and sidecars, marked interrupted. ``kvbench report``
and ``kvbench gate`` do the same on their own for such a directory (``ensure_recovered``)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvbench.core.errors import UserError


def add_parser(p) -> None:
    p.add_argument("results", nargs="+", type=Path, metavar="RESULTS",
                   help="results directories of killed runs (results/<run_id>)")


def ensure_recovered(path: Path | str) -> bool:
    """Recover ``path`` if its run was killed before writing run.json; say so on stderr."""
    from kvbench.runs.finalize import recover

    path = Path(path)
    if not path.is_dir():
        return False
    meta = recover(path)
    if meta is None:
        return False
    c = meta.counts
    print(f"kvbench: {path} had no run.json ({meta.interruption}); recovered "
          f"{c.get('records_written', 0)} records and {c.get('in_flight_at_kill', 0)} requests "
          "in flight at the kill (recorded as cancelled); run.json written, marked interrupted",
          file=sys.stderr)
    return True


def run(args) -> int:
    for path in args.results:
        if not path.is_dir():
            raise UserError(f"{path}: not a results directory; pass the folder the killed run "
                            "wrote (results/<run_id>)")
        if (path / "run.json").exists():
            print(f"kvbench recover: {path} already has run.json; nothing to do",
                  file=sys.stderr)
            continue
        if not ensure_recovered(path):
            raise UserError(f"{path}: no records, job file or load-process sidecar there; "
                            "pass the folder a kvbench run or locustfile wrote")
    return 0
