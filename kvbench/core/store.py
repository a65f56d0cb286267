"""The results store: where a run's files live and how they are read back.

``<results_dir>/<run_id>/`` holds the tables of ``kvbench.schema`` and ``run.json``.
``run.json`` keys (all written by the run, read by reports and the gate):

* ``schema_version`` (int), ``run_id``, ``suite``, ``started_ns``, ``ended_ns`` (epoch ns);
* ``config``: the resolved bench.toml as a dict (secrets never included);
* ``versions``: {package: version}; ``git_commit``; ``hosts``: [host names];
* ``endpoints``: [{name, topology, url, model, kind, gpus, gpu_hour_cost}];
* ``stages``: [{endpoint, workload, profile, index, pacing, rate_rps, users, duration_s,
  t_start_ns, t_end_ns[, search: {role, verdict, why[, stop]}]}] (``search``: a capacity
  search's probe, ``kvbench.runs.search``);
* ``clock_offsets_ns``: {host: offset to add to that host's timestamps};
* ``workers``: {worker "host:pid": {batches, records, lost, missing, clock_offset_ns, ...}}, a
  distributed run whose workers sent their records to the master (``runs.transport``);
* ``worker_clock_offsets_ns``: {worker: ns to add to its ``t_scheduled``/``t_sent``}, which
  ``load_results`` applies so every worker's times read on the master's clock;
* ``telemetry``: {source: "ok" | reason it is missing};
* ``incomplete``: [{what, why}] — everything that did not happen as asked;
* ``interrupted`` (bool), ``interruption``: whether a signal or a kill cut the run, and how;
* ``counts``: {requests_started, records_written, dropped_at_cap[, in_flight_at_kill]};
* ``workloads``: {name: describe()}; ``workloads_sent``: {endpoint: {workload: describe()}}.

``RunMeta`` is the typed view of run.json; ``runs.finalize`` is its one writer. Tables are read
through ``scan`` (record batches, parquet then live shards, conformed to the schema). Live
shards are written one per process and table, append-only: the collectors' by ``ShardWriter``
(Arrow IPC, ``.arrows``), the load processes' by ``core.rows.RowShardWriter`` (msgpack rows,
``.rows``, without pyarrow), which also write each request's start, ``STARTS``, that
``compact`` folds in.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator, Sequence

import msgpack
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from kvbench.core import rows
from kvbench.core.errors import DataError
# the pyarrow-free helpers a load process uses, kept importable from here
from kvbench.core.rows import (START_COLUMNS, new_run_id, shard_files,  # noqa: F401
                               shard_stem, worker_name, write_proc_meta)
from kvbench.core.schema import REQUESTS, SCHEMA_VERSION, STATUSES, TABLES

STARTS = pa.schema([REQUESTS.field(n) for n in START_COLUMNS])  # rows.START_COLUMNS, typed
SHARD_SCHEMAS = {**TABLES, "starts": STARTS}
KILLED_IN_FLIGHT = "in flight when the load process was killed"


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
    workers: dict = field(default_factory=dict)  # distributed: what each worker sent
    worker_clock_offsets_ns: dict = field(default_factory=dict)  # distributed: per worker
    interrupted: bool = False  # a signal or a kill cut the run before its planned end
    interruption: str | None = None  # how, e.g. "SIGTERM to kvbench run"
    # per job, the prefix-cache state it started from and the engine's counters around it
    # (``kvbench.runs.cache``); empty: written before kvbench recorded it
    cache_states: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict, source: Path | str = "run.json") -> "RunMeta":
        """The typed view of a run.json dict, its field types checked first: a wrong type is
        a ``DataError`` naming ``source``, the field and what was found."""
        check_run_json(data, source)
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
    """run.json of a run directory, checked: present, readable, a JSON object of this schema
    version whose fields have their types (``check_run_json``)."""
    run_dir = Path(run_dir)
    meta_path = run_dir / "run.json"
    if not meta_path.exists():
        raise DataError(f"{run_dir}: no run.json there; give a results directory written by "
                        "kvbench run or a locustfile")
    try:
        data = json.loads(meta_path.read_bytes())
    except OSError as exc:
        raise DataError(f"{meta_path}: cannot be read ({exc.strerror or exc}); check the "
                        "file's permissions or restore it") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        what = "empty" if not meta_path.stat().st_size else f"not valid JSON ({exc})"
        raise DataError(f"{meta_path}: run.json is {what}; restore it from a copy, or rerun "
                        "the run") from None
    if not isinstance(data, dict):
        raise DataError(f"{meta_path}: run.json holds {_json_kind(data)}, not the JSON object "
                        "kvbench writes; restore it from a copy, or rerun the run")
    ver = data.get("schema_version")
    if ver != SCHEMA_VERSION:
        raise DataError(f"{meta_path}: results of schema version {ver!r}, this kvbench reads "
                        f"version {SCHEMA_VERSION}; use the kvbench version that wrote them")
    return RunMeta.from_dict(data, meta_path)


def _json_kind(value) -> str:
    """How a JSON value reads in a sentence: 'a list', 'the number 7', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        short = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {short!r}"
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# The types of run.json's fields that readers rely on (others pass through): checked by
# pydantic in strict mode, so "7" is not an int and true is not a number. Times are epoch ns
# within int64, as the records' own.
def _run_json_models():
    from typing import Annotated, Any, Optional

    from pydantic import BaseModel, ConfigDict, Field

    Ns = Annotated[int, Field(ge=0, lt=2**63)]
    Num = Annotated[float, Field(allow_inf_nan=False)]
    Count = Annotated[int, Field(ge=0)]

    class _Loose(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")

    class SearchNote(_Loose):
        role: Optional[str] = None  # ramp | refine | bisect
        verdict: Optional[str] = None  # pass | fail | straddle (None: cut by a stop)
        why: Optional[str] = None
        stop: Optional[str] = None  # "budget": the search ended after this probe

    class Stage(_Loose):
        endpoint: Optional[str] = None
        workload: Optional[str] = None
        profile: Optional[str] = None
        index: Count = 0
        pacing: Optional[str] = None
        rate_rps: Optional[Num] = None
        users: Optional[Count] = None
        duration_s: Optional[Num] = None
        t_start_ns: Optional[Ns] = None
        t_end_ns: Optional[Ns] = None
        # the load process's largest event-loop pause in the stage (the largest of its
        # processes), and how many pauses were over 5 ms (summed): client lateness per request
        # cannot show a stall that made every stream late together
        loop_pause_max_ms: Optional[Num] = None
        loop_pause_max_offcpu_ms: Optional[Num] = None  # of it, the process not running
        loop_pauses_over_5ms: Optional[Count] = None
        search: Optional[SearchNote] = None  # a capacity search's probe

    class Endpoint(_Loose):
        name: str
        topology: Optional[str] = None
        url: Optional[str] = None
        model: Optional[str] = None
        kind: Optional[str] = None
        gpus: Optional[Count] = None
        gpu_hour_cost: Optional[Num] = None

    class Slo(_Loose):
        ttft_ms: Optional[Num] = None
        tpot_ms: Optional[Num] = None
        e2e_ms: Optional[Num] = None

    class Config(_Loose):
        slo: Optional[dict[str, Slo]] = None
        gate: Optional[dict[str, Any]] = None
        suite: Optional[dict[str, Any]] = None
        workloads: Optional[dict[str, Any]] = None
        endpoints: Optional[list[dict[str, Any]]] = None

    class Described(_Loose):  # the describe() keys reports read
        requests: Optional[Count] = None
        block_tokens: Optional[Count] = None
        capacity_tokens: Optional[Count] = None
        theoretical_hit_ratio_lru: Optional[Num] = None
        theoretical_hit_ratio_unbounded: Optional[Num] = None

    class Run(_Loose):
        schema_version: Optional[int] = None
        run_id: Optional[str] = None
        suite: Optional[str] = None
        started_ns: Optional[Ns] = None
        ended_ns: Optional[Ns] = None
        config: Optional[Config] = None
        versions: Optional[dict[str, Any]] = None
        git_commit: Optional[str] = None
        hosts: Optional[list[Any]] = None
        endpoints: Optional[list[Endpoint]] = None
        stages: Optional[list[Stage]] = None
        clock_offsets_ns: Optional[dict[str, Any]] = None
        telemetry: Optional[dict[str, Any]] = None
        incomplete: Optional[list[dict[str, Any]]] = None
        counts: Optional[dict[str, Any]] = None
        workloads: Optional[dict[str, Any]] = None
        workloads_sent: Optional[dict[str, dict[str, Described]]] = None
        workers: Optional[dict[str, dict[str, Any]]] = None
        worker_clock_offsets_ns: Optional[dict[str, int]] = None
        cache_states: Optional[list[dict[str, Any]]] = None

    return Run


_RUN_MODEL = None


def check_run_json(data, source: Path | str = "run.json") -> None:
    """Raise a ``DataError`` naming ``source`` and the first field whose type is wrong."""
    from pydantic import ValidationError

    global _RUN_MODEL
    if not isinstance(data, dict):
        raise DataError(f"{source}: holds {_json_kind(data)}, not a JSON object; restore it "
                        "from a copy, or rerun the run")
    if _RUN_MODEL is None:
        _RUN_MODEL = _run_json_models()
    try:
        _RUN_MODEL.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        msg = first["msg"]
        msg = msg[len("Input "):] if msg.startswith("Input ") else msg[0].lower() + msg[1:]
        more = len(exc.errors()) - 1
        raise DataError(f"{source}: field {loc} {msg}, found {_json_kind(first.get('input'))}"
                        f"{f' ({more} more problems)' if more else ''}; restore run.json from "
                        "a copy, or rerun the run") from None


# --------------------------------------------------------------------------- writing tables


class ShardWriter:
    """The writer of Arrow table shards (collectors, OTLP spans): appends record batches to
    ``<run_dir>/<table>-<host>-<pid>[-<tag>].arrows``, an Arrow IPC stream flushed after each
    batch, so a killed process keeps every complete batch (``scan`` reads up to the last).
    Thread-safe; the file is created with the first batch (or by ``open``)."""

    def __init__(self, run_dir: Path | str, table: str, tag: str | None = None) -> None:
        self.schema = SHARD_SCHEMAS[table]
        self.path = rows.shard_path(run_dir, table, ".arrows", tag)
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


def read_proc_meta(run_dir: Path | str) -> list[dict]:
    """The sidecars of every load process of a run. Each is written whole (temp file and
    rename), so one that is not a JSON object with counts, stages and incomplete of their
    types is damaged: a ``DataError`` naming it."""
    out = []
    for p in sorted(Path(run_dir).glob("proc-*.json")):
        try:
            data = json.loads(p.read_bytes())
        except OSError as exc:
            raise DataError(f"{p}: cannot be read ({exc.strerror or exc}); check its "
                            "permissions or remove it") from None
        except ValueError as exc:
            raise DataError(f"{p}: a load process's sidecar that is not valid JSON ({exc}); "
                            "remove it (its process's counts are then unknown)") from None
        problem = _proc_meta_problem(data)
        if problem:
            raise DataError(f"{p}: a load process's sidecar whose {problem}; remove it (its "
                            "process's counts are then unknown)")
        out.append(data)
    return out


def _proc_meta_problem(data) -> str | None:
    if not isinstance(data, dict):
        return f"content is {_json_kind(data)}, not an object"
    counts = data.get("counts", {})
    if not isinstance(counts, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in counts.values()):
        return "counts are not whole numbers by name"
    stages = data.get("stages", [])
    if not isinstance(stages, list) or not all(
            isinstance(st, dict) and all(isinstance(st.get(k), int) and not isinstance(
                st.get(k), bool) for k in ("t_start_ns", "t_end_ns")) for st in stages):
        return "stages are not a list of objects with integer t_start_ns and t_end_ns"
    if not isinstance(data.get("incomplete", []), list):
        return "incomplete is not a list"
    return None


# --------------------------------------------------------------------------- reading tables


# Columns without which a file is not that table at all (older files may lack later columns,
# which read as nulls).
REQUIRED = {"requests": ("endpoint", "status", "t_scheduled", "t_sent"),
            "gpu": ("t_ns",),
            "engine": ("t_ns", "endpoint", "metric", "value")}
# Columns every finished record of a table has (checked by ``scan(strict=True)``).
NOT_NULL = {"requests": ("endpoint", "status"), "gpu": ("t_ns",), "engine": ("t_ns", "metric")}
_IPC_MARKER = b"\xff\xff\xff\xff"  # every Arrow IPC stream message starts with it


def _compatible(have: pa.DataType, want: pa.DataType) -> bool:
    """True when a column written as ``have`` reads as ``want`` without changing meaning: the
    same type, integers of another width, integers or floats as floats, string widths and
    dictionaries of strings, lists of compatible values, or an all-null column."""
    t = pa.types
    if have == want or t.is_null(have):
        return True
    if t.is_dictionary(have):
        return _compatible(have.value_type, want)
    if t.is_integer(want):
        return t.is_integer(have)
    if t.is_floating(want):
        return t.is_integer(have) or t.is_floating(have)
    if t.is_string(want) or t.is_large_string(want):
        return t.is_string(have) or t.is_large_string(have)
    if t.is_list(want) or t.is_large_list(want):
        return (t.is_list(have) or t.is_large_list(have)) and _compatible(
            have.value_type, want.value_type)
    return False


def check_schema(have: pa.Schema, table: str, path: Path) -> None:
    """Raise a ``DataError`` naming ``path`` when a file's schema is not one of ``table``'s:
    a required column missing, or a column of a type that does not read as the schema's."""
    schema = SHARD_SCHEMAS[table]
    missing = [c for c in REQUIRED.get(table, ()) if c not in have.names]
    if missing:
        cols = ", ".join(have.names[:6]) + (", ..." if len(have.names) > 6 else "")
        raise DataError(f"{path}: not a {table} table of schema v{SCHEMA_VERSION} (no column "
                        f"{', '.join(missing)}; it has {cols or 'no columns'}); remove it or "
                        "restore the run's own file")
    for f in have:
        if f.name in schema.names and not _compatible(f.type, schema.field(f.name).type):
            raise DataError(f"{path}: column {f.name} is {f.type}, the {table} schema has "
                            f"{schema.field(f.name).type}; the file was not written by "
                            "kvbench, or is damaged: restore the run's own file")


def _conform(batch: pa.RecordBatch, schema: pa.Schema, columns: Sequence[str] | None,
             path: Path | None = None, table: str = "", strict: bool = False
             ) -> pa.RecordBatch:
    """``batch`` with the schema's types and ``columns`` (missing ones as nulls); a value
    that does not read as its column's type is a ``DataError`` naming ``path``, and so is,
    when ``strict``, a null where every finished record has a value or an unknown status."""
    names = list(columns) if columns is not None else schema.names
    arrays = []
    for name in names:
        typ = schema.field(name).type
        i = batch.schema.get_field_index(name)
        if i < 0:
            arrays.append(pa.nulls(batch.num_rows, typ))
            continue
        try:
            col = batch.column(i).cast(typ)
        except (pa.ArrowException, ValueError) as exc:
            raise DataError(f"{path}: column {name} does not read as {typ} "
                            f"({str(exc).splitlines()[0]}); restore the run's own file") from None
        if strict and name in NOT_NULL.get(table, ()) and col.null_count:
            raise DataError(f"{path}: {col.null_count} record(s) without a {name}, which every "
                            f"{table} record has; the file is damaged: restore the run's own "
                            "file")
        if strict and table == "requests" and name == "status":
            bad = pc.filter(col, pc.invert(pc.is_in(col, pa.array(STATUSES))))
            if len(bad):
                raise DataError(f"{path}: status {bad[0].as_py()!r} is not one of "
                                f"{', '.join(STATUSES)}; the file is damaged or of another "
                                "kvbench version")
        arrays.append(col)
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema([schema.field(n) for n in names]))


def _shard_batches(run_dir: Path, table: str) -> Iterator[tuple[Path, pa.RecordBatch]]:
    """Every complete batch of every ``<table>-*`` shard (``.arrows``: Arrow IPC, written by
    the collectors and older runs; ``.rows``: a load process's msgpack rows, ``core.rows``),
    with its file (a killed writer loses only its unfinished batch; an empty file is a process
    that wrote nothing). A file that is not a stream of its kind, or one of another table or
    schema, is a ``DataError``."""
    for shard in shard_files(run_dir, table):
        try:
            if shard.suffix == rows.ROWS_SUFFIX:
                for batch in _rows_batches(shard, table):
                    yield shard, batch
            else:
                for batch in _arrows_batches(shard, table):
                    yield shard, batch
        except OSError as exc:
            raise DataError(f"{shard}: cannot be read ({exc.strerror or exc}); check its "
                            "permissions or remove it") from None


def _arrows_batches(shard: Path, table: str) -> Iterator[pa.RecordBatch]:
    with open(shard, "rb") as fh:
        head = fh.read(4)
        if not head:
            return
        if head != _IPC_MARKER:
            raise DataError(f"{shard}: not an Arrow IPC stream (a {table} shard starts "
                            "with one); remove it or restore the run's own file")
        fh.seek(0)
        try:
            reader = ipc.open_stream(fh)
        except (pa.ArrowInvalid, OSError):
            return  # killed while writing the schema: no records in it
        check_schema(reader.schema, table, shard)
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError):
                break  # truncated mid-batch: keep what was read
            try:
                batch.validate(full=True)
            except pa.ArrowInvalid:
                break  # a batch cut or damaged at the end: keep what was read
            yield batch


_UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException)


def _rows_batches(shard: Path, table: str) -> Iterator[pa.RecordBatch]:
    """The batches of a ``.rows`` shard as record batches of the header's columns that the
    table has (typed by its schema; columns it does not know are left out, as in an Arrow
    shard). A batch cut at the end (a kill) ends the file silently; anything else that does
    not read is a ``DataError`` naming the file."""
    for batch, _ in _rows_from(shard, table, None, 0):
        if not isinstance(batch, tuple):  # the header's columns
            yield batch


def _rows_from(shard: Path, table: str, head: tuple | None, offset: int
               ) -> Iterator[tuple[pa.RecordBatch | tuple, int]]:
    """``_rows_batches`` from byte ``offset`` on, each batch with the offset after it.
    ``head``: the shard's columns (known fields, their schema, how many a batch holds) as a
    first yield gave them (``offset`` 0: read from the header, yielded first as a tuple)."""
    schema = SHARD_SCHEMAS[table]
    with open(shard, "rb") as fh:
        if head is None:
            first = fh.read(1)
            if not first:
                return  # a process that wrote nothing
            fh.seek(0)
            unpacker = rows.unpacker(fh)
            try:
                header = next(unpacker) if rows.starts_with_map(first) else None
            except StopIteration:
                return  # killed while writing the header: no records in it
            except _UNPACK_ERRORS:
                header = None
            problem = rows.header_problem(header, table)
            if problem:
                raise DataError(f"{shard}: {problem}; remove it or restore the run's own file")
            names = header["columns"]
            known = [(i, schema.field(n)) for i, n in enumerate(names) if n in schema.names]
            have = pa.schema([f for _, f in known])
            check_schema(have, table, shard)
            head = (known, have, len(names))
            base = 0
            if offset == 0:
                yield head, unpacker.tell()
        else:
            fh.seek(offset)
            unpacker = rows.unpacker(fh)
            base = offset
        known, have, n_names = head
        while True:
            try:
                batch = next(unpacker)
            except StopIteration:
                return  # the end, or a batch cut by a kill: everything before it is kept
            except _UNPACK_ERRORS as exc:
                raise DataError(f"{shard}: damaged after its first {base + unpacker.tell()} "
                                f"bytes ({exc}); restore the run's own file, or remove "
                                "it") from None
            problem = rows.batch_problem(batch, n_names)
            if problem:
                raise DataError(f"{shard}: {problem}; the file is damaged: restore the run's "
                                "own file, or remove it")
            arrays = []
            for i, f in known:
                try:
                    arrays.append(pa.array(batch[i], type=f.type))
                except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                    raise DataError(f"{shard}: column {f.name} does not read as {f.type} "
                                    f"({str(exc).splitlines()[0][:160]}); restore the run's "
                                    "own file") from None
            yield pa.RecordBatch.from_arrays(arrays, schema=have), base + unpacker.tell()


class ShardTail:
    """One table's live shards, read as they grow: each ``read`` parses only the batches
    completed since the last (a running capacity search reads its records every half second;
    reading every shard whole each time made a poll's cost grow with the run: the search's
    own process went from 8% to 36% of a core over 80 s of a ground-truth search). ``.arrows``
    shards (collectors, older runs) are read whole each time. The table it returns holds the
    shards' records only (``columns``, conformed as ``scan`` does), never a parquet file."""

    def __init__(self, run_dir: Path | str, table: str,
                 columns: Sequence[str] | None = None) -> None:
        self.run_dir, self.table, self.columns = Path(run_dir), table, columns
        self._shards: dict[Path, tuple] = {}  # shard -> (head, offset after its last batch)
        self._batches: list[pa.RecordBatch] = []

    def read(self) -> pa.Table:
        schema = SHARD_SCHEMAS[self.table]
        other = []
        for shard in shard_files(self.run_dir, self.table):
            try:
                if shard.suffix != rows.ROWS_SUFFIX:
                    other += [_conform(b, schema, self.columns, shard, self.table, False)
                              for b in _arrows_batches(shard, self.table)]
                    continue
                head, offset = self._shards.get(shard, (None, 0))
                for batch, end in _rows_from(shard, self.table, head, offset):
                    if isinstance(batch, tuple):
                        head = batch
                    else:
                        self._batches.append(_conform(batch, schema, self.columns, shard,
                                                      self.table, False))
                    offset = end
                if head is not None:
                    self._shards[shard] = (head, offset)
            except OSError as exc:
                raise DataError(f"{shard}: cannot be read ({exc.strerror or exc}); check its "
                                "permissions or remove it") from None
        batches = self._batches + other
        if batches:
            return pa.Table.from_batches(batches)
        empty = schema.empty_table()
        return empty.select(list(self.columns)) if self.columns is not None else empty


def _parquet_batches(pfile: Path, table: str, read_cols: Sequence[str] | None,
                     batch_size: int) -> Iterator[pa.RecordBatch]:
    """Record batches of a table's parquet file; a file that is not Parquet, is cut short,
    damaged or of another schema is a ``DataError`` naming it."""
    def damaged(exc: Exception) -> DataError:
        size = pfile.stat().st_size if pfile.exists() else 0
        what = ("empty (0 bytes)" if size == 0 else
                f"not a readable Parquet file ({str(exc).splitlines()[0][:160]})")
        return DataError(f"{pfile}: {what}; the run's {table} records cannot be read: restore "
                         "the file or rerun the run")
    try:
        pf = pq.ParquetFile(pfile)
        have = pf.schema_arrow
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise damaged(exc) from None
    check_schema(have, table, pfile)
    read = [c for c in (read_cols or TABLES[table].names) if c in have.names]
    try:
        for batch in pf.iter_batches(batch_size=batch_size, columns=read):
            yield batch
    except (pa.ArrowException, OSError, ValueError, IndexError, EOFError) as exc:
        raise damaged(exc) from None


def scan(run_dir: Path | str, table: str, columns: Sequence[str] | None = None,
         batch_size: int = 65_536, parquet: bool = True,
         shards: bool = True, strict: bool = False) -> Iterator[pa.RecordBatch]:
    """The one reader of a run's tables: record batches of ``<table>.parquet`` (if compacted),
    then of its live shards, each conformed to schema v1 (``columns`` only, missing columns of
    older files as nulls). A damaged file is a ``DataError`` naming it; ``strict`` (readers of
    finished runs: reports, the gate) also refuses records without the values every finished
    record has (``NOT_NULL``) and unknown statuses."""
    run_dir = Path(run_dir)
    schema = TABLES[table]
    if columns is not None:
        unknown = [c for c in columns if c not in schema.names]
        if unknown:
            raise ValueError(f"{table} has no column(s) {unknown}")
    pfile = run_dir / f"{table}.parquet"
    if parquet and pfile.exists():
        for batch in _parquet_batches(pfile, table, columns, batch_size):
            yield _conform(batch, schema, columns, pfile, table, strict)
    if shards:
        for shard, batch in _shard_batches(run_dir, table):
            yield _conform(batch, schema, columns, shard, table, strict)


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
    """Merge ``<table>-*`` shards (``.arrows`` and ``.rows``, and an existing parquet) into
    ``<table>.parquet``; for requests, each start with no record (its process was killed)
    becomes a ``cancelled`` record (``unfinished_starts``) and the start shards go too."""
    run_dir = Path(run_dir)
    table_files = shard_files(run_dir, table)
    start_files = shard_files(run_dir, "starts") if table == "requests" else []
    if not table_files and not start_files:
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
        for s in table_files + start_files:
            s.unlink(missing_ok=True)
    return t.num_rows


def read_starts(run_dir: Path | str) -> pa.Table:
    """Every request start the load processes of a run wrote (complete batches)."""
    batches = [_conform(b, STARTS, None, shard, "starts")
               for shard, b in _shard_batches(Path(run_dir), "starts")]
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
    tables = {name: read_table(run_dir, name, strict=True) for name in TABLES}
    tables["requests"] = align_worker_clocks(tables["requests"], meta.worker_clock_offsets_ns)
    return Results(run_dir, meta, tables)


ALIGNED = ("t_scheduled", "t_sent")  # epoch ns read on the sending worker's clock


def align_worker_clocks(requests: pa.Table, offsets_ns: dict | None) -> pa.Table:
    """``requests`` with each worker's ``t_scheduled`` and ``t_sent`` moved onto the master's
    clock (run.json ``worker_clock_offsets_ns``: ns to add, by worker name); workers without
    an offset (or of offset 0) are left as written."""
    offsets = {w: int(o) for w, o in (offsets_ns or {}).items() if int(o)}
    if not offsets or requests.num_rows == 0:
        return requests
    workers = requests.column("worker")
    shift = pc.fill_null(pc.cast(pc.index_in(workers, pa.array(list(offsets))), pa.int64()), -1)
    table = pa.array([0] + list(offsets.values()), pa.int64())
    add = pc.take(table, pc.add(shift, 1))
    for name in ALIGNED:
        i = requests.schema.get_field_index(name)
        col = requests.column(i)
        requests = requests.set_column(i, requests.field(i),
                                       pc.add(col, add).cast(col.type))
    return requests
