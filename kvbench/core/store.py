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
* ``interrupted`` (bool), ``interruption``: whether a signal or a kill cut the run, and how;
* ``counts``: {requests_started, records_written, dropped_at_cap[, in_flight_at_kill]};
* ``workloads``: {name: describe()}; ``workloads_sent``: {endpoint: {workload: describe()}}.

``RunMeta`` is the typed view of run.json; ``runs.finalize`` is its one writer. Tables are read
through ``scan`` (record batches, parquet then live shards, conformed to the schema) and written
through ``ShardWriter`` (append-only Arrow IPC shards, one per process and table; the load
processes also write each request's start, ``STARTS``, which ``compact`` folds in).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from kvbench.core.errors import DataError
from kvbench.core.schema import REQUESTS, SCHEMA_VERSION, TABLES

# A request's start, written as it is sent (``starts-<host>-<pid>.arrows``): the columns of
# REQUESTS known before the response. ``compact`` turns a start with no record into a
# ``cancelled`` record, so a killed load process leaves a trace of what it had in flight.
START_COLUMNS = ("run_id", "endpoint", "topology", "workload", "request_class", "stage",
                 "request_id", "session_id", "turn", "worker", "prompt_tokens_client",
                 "shared_prefix_tokens", "max_tokens", "t_scheduled", "t_sent")
STARTS = pa.schema([REQUESTS.field(n) for n in START_COLUMNS])
SHARD_SCHEMAS = {**TABLES, "starts": STARTS}
KILLED_IN_FLIGHT = "in flight when the load process was killed"


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



# --------------------------------------------------------------------------- run.json


@dataclass
class RunMeta:
    """run.json, typed. Unknown keys written by other versions are kept in ``extra``."""

    run_id: str
    suite: str = "default"
    started_ns: int | None = None
    ended_ns: int | None = None
    config: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    git_commit: str | None = None
    hosts: list = field(default_factory=list)
    endpoints: list = field(default_factory=list)
    stages: list = field(default_factory=list)
    clock_offsets_ns: dict = field(default_factory=dict)
    telemetry: dict = field(default_factory=dict)
    incomplete: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    workloads: dict = field(default_factory=dict)
    workloads_sent: dict | None = None  # None: written before kvbench recorded it
    interrupted: bool = False  # a signal or a kill cut the run before its planned end
    interruption: str | None = None  # how, e.g. "SIGTERM to kvbench run"
    extra: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict) -> "RunMeta":
        known = {f.name for f in fields(cls)} - {"extra"}
        kw = {k: v for k, v in data.items() if k in known and v is not None}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**{"run_id": str(data.get("run_id") or ""), **kw, "extra": extra})

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}

    @property
    def slo(self) -> dict:
        """The resolved config's ``[slo.*]`` tables: {class: {ttft_ms, tpot_ms, e2e_ms}}."""
        return (self.config or {}).get("slo") or {}


def write_run_json(run_dir: Path, meta: RunMeta) -> None:
    """Atomic write (temp file + rename), so a reader never sees half a run.json. Called only
    by ``kvbench.runs.finalize``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(meta.to_dict(), indent=2, sort_keys=True, default=str))
    os.replace(tmp, run_dir / "run.json")


def read_meta(run_dir: Path | str) -> RunMeta:
    """run.json of a run directory, checked: present, readable, of this schema version."""
    run_dir = Path(run_dir)
    meta_path = run_dir / "run.json"
    if not meta_path.exists():
        raise DataError(f"{run_dir}: no run.json there; give a results directory written by "
                        "kvbench run or a locustfile")
    try:
        data = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise DataError(f"{meta_path}: unreadable run.json ({exc}); rerun or restore it") from None
    ver = data.get("schema_version") if isinstance(data, dict) else None
    if ver != SCHEMA_VERSION:
        raise DataError(f"{meta_path}: results of schema version {ver}, this kvbench reads "
                        f"version {SCHEMA_VERSION}; use the kvbench version that wrote them")
    return RunMeta.from_dict(data)


# --------------------------------------------------------------------------- writing tables


def shard_stem(host: str | None = None, pid: int | None = None) -> str:
    """``<host>-<pid>`` with the host made file-name safe: one shard per process and table."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", host or socket.gethostname())
    return f"{host}-{pid or os.getpid()}"


class ShardWriter:
    """The one writer of table shards: appends record batches to
    ``<run_dir>/<table>-<host>-<pid>[-<tag>].arrows``, an Arrow IPC stream flushed after each
    batch, so a killed process keeps every complete batch (``scan`` reads up to the last).
    Thread-safe; the file is created with the first batch (or by ``open``)."""

    def __init__(self, run_dir: Path | str, table: str, tag: str | None = None) -> None:
        self.schema = SHARD_SCHEMAS[table]
        stem = f"{table}-{shard_stem()}"
        self.path = Path(run_dir) / (f"{stem}-{tag}.arrows" if tag else f"{stem}.arrows")
        self._lock = threading.Lock()
        self._fh = None
        self._writer = None
        self.rows = 0
        self.closed = False

    def open(self) -> None:
        """Create the shard now (an empty stream is a valid, readable shard)."""
        with self._lock:
            self._open()

    def _open(self) -> None:
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "ab")
            self._writer = ipc.new_stream(self._fh, self.schema)
            self._fh.flush()

    def write(self, batch: pa.RecordBatch | None) -> int:
        """Append one batch (cast to the table's schema); returns the rows written."""
        if batch is None or batch.num_rows == 0:
            return 0
        if batch.schema != self.schema:
            batch = batch.cast(self.schema)
        with self._lock:
            if self.closed:
                return 0
            self._open()
            self._writer.write_batch(batch)
            self._fh.flush()
            self.rows += batch.num_rows
        return batch.num_rows

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self._writer is not None:
                self._writer.close()
                self._fh.close()
                self._writer = self._fh = None


def write_proc_meta(run_dir: Path | str, meta: dict) -> Path:
    """A load process's sidecar ``proc-<host>-<pid>.json`` (counts, stages, incomplete), read
    by whoever finalizes the run."""
    path = Path(run_dir) / f"proc-{shard_stem()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1, default=str))
    os.replace(tmp, path)
    return path


def read_proc_meta(run_dir: Path | str) -> list[dict]:
    """The sidecars of every load process of a run (unreadable ones skipped)."""
    out = []
    for p in sorted(Path(run_dir).glob("proc-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


# --------------------------------------------------------------------------- reading tables


def _conform(batch: pa.RecordBatch, schema: pa.Schema,
             columns: Sequence[str] | None) -> pa.RecordBatch:
    """``batch`` with the schema's types and ``columns`` (missing ones as nulls)."""
    names = list(columns) if columns is not None else schema.names
    arrays = []
    for name in names:
        typ = schema.field(name).type
        i = batch.schema.get_field_index(name)
        arrays.append(batch.column(i).cast(typ) if i >= 0 else pa.nulls(batch.num_rows, typ))
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema([schema.field(n) for n in names]))


def _shard_batches(run_dir: Path, table: str) -> Iterator[pa.RecordBatch]:
    """Every complete batch of every ``<table>-*.arrows`` shard (a killed writer loses only
    its unfinished batch)."""
    for shard in sorted(run_dir.glob(f"{table}-*.arrows")):
        try:
            with open(shard, "rb") as fh:
                reader = ipc.open_stream(fh)
                while True:
                    try:
                        yield reader.read_next_batch()
                    except StopIteration:
                        break
        except (pa.ArrowInvalid, OSError):
            continue  # truncated mid-batch: keep what was read


def scan(run_dir: Path | str, table: str, columns: Sequence[str] | None = None,
         batch_size: int = 65_536, parquet: bool = True,
         shards: bool = True) -> Iterator[pa.RecordBatch]:
    """The one reader of a run's tables: record batches of ``<table>.parquet`` (if compacted),
    then of its live shards, each conformed to schema v1 (``columns`` only, missing columns of
    older files as nulls)."""
    run_dir = Path(run_dir)
    schema = TABLES[table]
    if columns is not None:
        unknown = [c for c in columns if c not in schema.names]
        if unknown:
            raise ValueError(f"{table} has no column(s) {unknown}")
    pfile = run_dir / f"{table}.parquet"
    if parquet and pfile.exists():
        pf = pq.ParquetFile(pfile)
        have = set(pf.schema_arrow.names)
        read = [c for c in (columns or schema.names) if c in have]
        for batch in pf.iter_batches(batch_size=batch_size, columns=read):
            yield _conform(batch, schema, columns)
    if shards:
        for batch in _shard_batches(run_dir, table):
            yield _conform(batch, schema, columns)


def read_table(run_dir: Path | str, table: str, columns: Sequence[str] | None = None,
               **kw) -> pa.Table:
    """One table of a run (``scan`` gathered): parquet plus any live shards."""
    schema = TABLES[table]
    batches = list(scan(run_dir, table, columns, **kw))
    if batches:
        return pa.Table.from_batches(batches)
    empty = schema.empty_table()
    return empty.select(list(columns)) if columns is not None else empty


def read_shards(run_dir: Path | str, table: str) -> pa.Table:
    """The live shards of a table only (not its parquet)."""
    return read_table(run_dir, table, parquet=False)


def compact(run_dir: Path | str, table: str, remove_shards: bool = True) -> int:
    """Merge ``<table>-*.arrows`` shards (and an existing parquet) into ``<table>.parquet``;
    for requests, each start with no record (its process was killed) becomes a ``cancelled``
    record (``unfinished_starts``) and the start shards go too."""
    run_dir = Path(run_dir)
    shard_files = sorted(run_dir.glob(f"{table}-*.arrows"))
    start_files = sorted(run_dir.glob("starts-*.arrows")) if table == "requests" else []
    if not shard_files and not start_files:
        return 0
    t = read_table(run_dir, table)
    if start_files:
        lost = unfinished_starts(run_dir, t)
        if lost.num_rows:
            t = pa.concat_tables([t, lost])
    tmp = run_dir / f"{table}.parquet.tmp"
    pq.write_table(t, tmp, compression="zstd")
    os.replace(tmp, run_dir / f"{table}.parquet")
    if remove_shards:
        for s in shard_files + start_files:
            s.unlink(missing_ok=True)
    return t.num_rows


def read_starts(run_dir: Path | str) -> pa.Table:
    """Every request start the load processes of a run wrote (complete batches)."""
    batches = [_conform(b, STARTS, None) for b in _shard_batches(Path(run_dir), "starts")]
    return pa.Table.from_batches(batches, schema=STARTS) if batches else STARTS.empty_table()


def unfinished_starts(run_dir: Path | str, records: pa.Table) -> pa.Table:
    """Requests records of the starts that have no record in ``records`` (same worker and
    request id): ``cancelled`` with their send times and ``KILLED_IN_FLIGHT``."""
    starts = read_starts(run_dir)
    if starts.num_rows == 0:
        return REQUESTS.empty_table()
    import pyarrow.compute as pc

    def keyed(t: pa.Table) -> pa.Table:  # a null worker (a hand-made shard) matches null
        return t.append_column("_w", pc.fill_null(t.column("worker"), ""))

    done = keyed(records.select(["worker", "request_id"])).drop_columns(["worker"])
    starts = keyed(starts).join(done, ["_w", "request_id"], join_type="left anti")
    starts = starts.drop_columns(["_w"])
    starts = starts.combine_chunks()  # one row per start still: (worker, request_id) is unique
    n = starts.num_rows
    cols = []
    for f in REQUESTS:
        if f.name in START_COLUMNS:
            cols.append(starts.column(f.name).cast(f.type))
        elif f.name == "status":
            cols.append(pa.array(["cancelled"] * n, f.type))
        elif f.name == "error":
            cols.append(pa.array([KILLED_IN_FLIGHT] * n, f.type))
        elif pa.types.is_list(f.type):
            cols.append(pa.array([[]] * n, f.type))
        else:
            cols.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(cols, schema=REQUESTS)


@dataclass
class Results:
    path: Path
    meta: RunMeta
    tables: dict[str, pa.Table] = field(default_factory=dict)

    @property
    def requests(self) -> pa.Table:
        return self.tables["requests"]


def load_results(path: Path | str) -> Results:
    """Read one run directory: run.json plus every table (parquet, then live shards)."""
    run_dir = Path(path)
    meta = read_meta(run_dir)
    return Results(run_dir, meta, {name: read_table(run_dir, name) for name in TABLES})
