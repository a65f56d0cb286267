"""The results store: where a run's files live and how they are read back.

``<results_dir>/<run_id>/`` holds the tables of ``kvbench.schema`` and ``run.json``.
``run.json`` keys (all written by the run, read by reports and the gate):

* ``schema_version`` (int), ``run_id``, ``suite``, ``started_ns``, ``ended_ns`` (epoch ns);
* ``config``: the resolved bench.toml as a dict (secrets never included);
* ``versions``: {package: version}; ``git_commit``; ``hosts``: [host names];
* ``endpoints``: [{name, topology, url, model, kind, gpus, gpu_hour_cost}];
* ``stages``: [{endpoint, workload, profile, index, pacing, rate_rps, users, duration_s,
  t_start_ns, t_end_ns}];
* ``clock_offsets_ns``: {host: offset to add to that host's timestamps};
* ``telemetry``: {source: "ok" | reason it is missing};
* ``incomplete``: [{what, why}] — everything that did not happen as asked;
* ``counts``: {requests_started, records_written, dropped_at_cap}.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from kvbench.core.errors import DataError
from kvbench.core.schema import SCHEMA_VERSION, TABLES


def new_run_id(suite: str = "default") -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{suite}-{os.getpid() % 10000:04d}"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def git_commit(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("kvbench", "locust", "aiohttp", "pyarrow", "pandas", "numpy", "nvidia-ml-py"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    import platform

    out["python"] = platform.python_version()
    return out


def write_run_json(run_dir: Path, meta: dict) -> None:
    """Atomic write (temp file + rename), so a reader never sees half a run.json."""
    meta = {"schema_version": SCHEMA_VERSION, **meta}
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    os.replace(tmp, run_dir / "run.json")


def read_shards(run_dir: Path, table: str) -> pa.Table:
    """Every complete batch of every ``<table>-*.arrows`` shard (a killed writer loses only
    its unfinished batch)."""
    schema = TABLES[table]
    parts = []
    for shard in sorted(run_dir.glob(f"{table}-*.arrows")):
        try:
            with open(shard, "rb") as fh:
                reader = ipc.open_stream(fh)
                while True:
                    try:
                        parts.append(reader.read_next_batch())
                    except StopIteration:
                        break
        except (pa.ArrowInvalid, OSError):
            continue  # truncated mid-batch: keep what was read
    if not parts:
        return schema.empty_table()
    return pa.Table.from_batches(parts).cast(schema)


def compact(run_dir: Path, table: str, remove_shards: bool = True) -> int:
    """Merge ``<table>-*.arrows`` shards (and an existing parquet) into ``<table>.parquet``."""
    shards = sorted(run_dir.glob(f"{table}-*.arrows"))
    if not shards:
        return 0
    t = read_shards(run_dir, table)
    existing = run_dir / f"{table}.parquet"
    if existing.exists():
        t = pa.concat_tables([pq.read_table(existing).cast(TABLES[table]), t])
    tmp = run_dir / f"{table}.parquet.tmp"
    pq.write_table(t, tmp, compression="zstd")
    os.replace(tmp, existing)
    if remove_shards:
        for s in shards:
            s.unlink(missing_ok=True)
    return t.num_rows


@dataclass
class Results:
    path: Path
    meta: dict
    tables: dict[str, pa.Table] = field(default_factory=dict)

    @property
    def requests(self) -> pa.Table:
        return self.tables["requests"]


def read_meta(run_dir: Path | str) -> dict:
    """run.json of a run directory, checked: present, readable, of this schema version."""
    run_dir = Path(run_dir)
    meta_path = run_dir / "run.json"
    if not meta_path.exists():
        raise DataError(f"{run_dir}: no run.json there; give a results directory written by "
                        "kvbench run or a locustfile")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise DataError(f"{meta_path}: unreadable run.json ({exc}); rerun or restore it") from None
    ver = meta.get("schema_version")
    if ver != SCHEMA_VERSION:
        raise DataError(f"{meta_path}: results of schema version {ver}, this kvbench reads "
                        f"version {SCHEMA_VERSION}; use the kvbench version that wrote them")
    return meta


def read_table(run_dir: Path | str, name: str) -> pa.Table:
    """One table of a run: its parquet (if compacted) plus any live shards."""
    run_dir = Path(run_dir)
    schema = TABLES[name]
    parts = []
    pfile = run_dir / f"{name}.parquet"
    if pfile.exists():
        parts.append(pq.read_table(pfile).cast(schema))
    live = read_shards(run_dir, name)
    if live.num_rows:
        parts.append(live)
    return pa.concat_tables(parts) if parts else schema.empty_table()


def load_results(path: Path | str) -> Results:
    """Read one run directory: run.json plus every table (parquet, then live shards)."""
    run_dir = Path(path)
    meta = read_meta(run_dir)
    return Results(run_dir, meta, {name: read_table(run_dir, name) for name in TABLES})
