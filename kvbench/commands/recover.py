"""``kvbench recover RESULTS...``: write run.json of a run whose finalizer was killed (SIGKILL of
the load process or of ``kvbench run``, a crash, a power cut): its shards are compacted, each
request started but never recorded becomes a ``cancelled`` record with its send times, and
run.json is rebuilt from the job file(s) and sidecars, marked interrupted. ``kvbench report``
and ``kvbench gate`` do the same on their own for such a directory (``ensure_recovered``).

A run on object storage (``s3://bucket/prefix/RUN``, ``kvbench.core.objstore``) is read from a
local copy (``local_run``); one without its ``_COMPLETE`` marker (its ``kvbench run`` killed
before the upload ended) is recovered from this machine's spool, uploaded, then read."""

from __future__ import annotations

import sys
from pathlib import Path

from kvbench.core.errors import UserError


def add_parser(p) -> None:
    p.add_argument("results", nargs="+", metavar="RESULTS",
                   help="results directories of killed runs (results/<run_id>), or "
                        "s3://BUCKET/PREFIX/RUN_ID (uploaded from this machine's spool)")


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


def _location(spec: str):
    from kvbench.core import objstore

    try:
        return objstore.split_run(spec)
    except ValueError as exc:
        raise UserError(f"{spec[:100]}: {exc}") from None


def _store_error(url: str, exc: OSError) -> UserError:
    return UserError(f"{url}: the store cannot be read or written "
                     f"({str(exc).splitlines()[0][:160]}); check endpoint_url, region and the "
                     "AWS credentials in the environment")


def upload_spool(spec: str) -> bool:
    """Run ``spec`` (an s3:// URL) completed on the store from this machine's spool, if its
    marker is missing there and the spool holds it: recovered (run.json rebuilt), uploaded,
    marker last, the spool removed. Whether it did."""
    import shutil

    from kvbench.core import objstore

    loc, run_id = _location(spec)
    try:
        if objstore.complete(loc, run_id) is not None:
            return False
        spool = objstore.spool_root(loc) / run_id
        if not spool.is_dir():
            return False
        ensure_recovered(spool)
        n = objstore.upload_run(spool, loc, run_id)
    except OSError as exc:
        raise _store_error(loc.url(run_id), exc) from None
    shutil.rmtree(spool, ignore_errors=True)
    print(f"kvbench: {loc.url(run_id)} had no {objstore.MARKER} marker; uploaded {n} file(s) "
          f"from the local spool {spool}, marker last", file=sys.stderr)
    return True


def local_run(spec) -> Path:
    """The local folder of run ``spec``: a path as given, or an s3:// run (``latest``: the
    last uploaded) copied into the local cache, its spool uploaded first when the store lacks
    its marker. A run on the store with no marker and no spool here is refused."""
    from kvbench.core import objstore

    if not objstore.is_url(spec):
        return Path(spec)
    loc, run_id = _location(str(spec))
    try:
        if run_id == objstore.LATEST:
            run_id = objstore.read_latest(loc) or run_id
            spec = loc.url(run_id)
        if objstore.complete(loc, run_id) is None and not upload_spool(spec):
            what = ("holds no complete run" if objstore.listing(loc, run_id) else
                    "holds no run")
            raise UserError(f"{loc.url(run_id)} {what} (no {objstore.MARKER} marker: its "
                            "kvbench run was stopped before its upload ended, or still runs) "
                            "and this machine has no spool of it; run kvbench recover "
                            f"{loc.url(run_id)} on the machine that ran it, or wait for it")
        return objstore.fetch_run(loc, run_id)
    except OSError as exc:
        raise _store_error(loc.url(run_id), exc) from None


def run(args) -> int:
    from kvbench.core import objstore

    for spec in args.results:
        if objstore.is_url(spec):
            if not upload_spool(spec):
                loc, run_id = _location(spec)
                try:
                    done = objstore.complete(loc, run_id) is not None
                except OSError as exc:
                    raise _store_error(spec, exc) from None
                if not done:
                    local_run(spec)  # neither complete nor spooled here: refused
                print(f"kvbench recover: {spec} is complete on the store; nothing to do",
                      file=sys.stderr)
            continue
        path = Path(spec)
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
