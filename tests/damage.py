"""Damaged result folders, made by seeded mutations of a real run's folder (for the tests of
``kvbench report`` and ``kvbench gate`` on bad data).

Each mutation damages one thing (a file's bytes, one run.json field, a table's schema or a
column's type) and returns the name of the file it damaged: the one sentence the CLI prints
must name it. ``CATEGORIES`` are the 17 named damages of issue 11; ``fuzz`` draws many more.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Callable

import msgpack
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from kvbench.core import rows
from kvbench.core.layout import table_files
from kvbench.core.schema import TABLES
from kvbench.core.shards import read_table

# Values of every JSON type, for run.json fields of the wrong type.
WRONG_VALUES = ([], {}, "x", "", 7, -1, 1.5, 1e30, True, None, [1, "a"], {"a": [1]},
                [[]], [{"x": 1}], "2026-01-01")
RUN_FIELDS = ("run_id", "suite", "started_ns", "ended_ns", "config", "versions", "git_commit",
              "hosts", "endpoints", "stages", "clock_offsets_ns", "telemetry", "incomplete",
              "counts", "workloads", "workloads_sent", "schema_version")
STAGE_FIELDS = ("endpoint", "workload", "profile", "index", "pacing", "rate_rps", "users",
                "duration_s", "t_start_ns", "t_end_ns")
ENDPOINT_FIELDS = ("name", "topology", "url", "model", "kind", "gpus", "gpu_hour_cost")
CONFIG_FIELDS = ("slo", "gate", "suite", "workloads", "endpoints")

Mutation = Callable[[Path, random.Random], str]


# the tables a load process writes as msgpack rows (kvbench.core.rows); the collectors' as
# Arrow IPC
ROWS_TABLES = ("requests",)


def to_shards(run_dir: Path) -> None:
    """The folder as a live run leaves it, no parquet: the requests as the load process's rows
    shard, every other table as a collector's Arrow IPC shard."""
    for name in TABLES:
        files = table_files(run_dir, name)
        if not files:
            continue
        t = (pq.read_table(files[0]) if files == [run_dir / f"{name}.parquet"] else
             read_table(run_dir, name, shards=False))
        suffix = ".rows" if name in ROWS_TABLES else ".arrows"
        _rewrite(run_dir / f"{name}-host-1{suffix}", t, batch_rows=8)
        for p in files:
            p.unlink()
        shutil.rmtree(run_dir / name, ignore_errors=True)


def _data_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (
        ".parquet", ".arrows", ".rows", ".json"))


def _meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _write_meta(run_dir: Path, meta) -> str:
    (run_dir / "run.json").write_text(json.dumps(meta))
    return "run.json"


# --------------------------------------------------------------------------------------------
# bytes of a file


def truncate(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    path.write_bytes(data[:rng.randrange(1, max(len(data), 2))])
    return path.name


def zero(path: Path, rng: random.Random) -> str:
    path.write_bytes(b"")
    return path.name


def garbage(path: Path, rng: random.Random) -> str:
    n = rng.randrange(1, 4096)
    junk = bytes(rng.getrandbits(8) for _ in range(n))
    if path.suffix == ".parquet" and rng.random() < 0.5:
        junk = b"PAR1" + junk + b"PAR1"  # passes the magic-number check
    path.write_bytes(junk)
    return path.name


def flip(path: Path, rng: random.Random) -> str:
    """A few flipped bytes in the middle (bit rot)."""
    data = bytearray(path.read_bytes())
    if len(data) < 16:
        return zero(path, rng)
    for _ in range(rng.randrange(1, 8)):
        i = rng.randrange(8, len(data) - 8)
        data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return path.name


def delete(path: Path, rng: random.Random) -> str:
    path.unlink()
    return path.name


BYTE_DAMAGE = (truncate, zero, garbage, flip, delete)


# --------------------------------------------------------------------------------------------
# run.json


def run_json_whole(value) -> Mutation:
    def m(run_dir: Path, rng: random.Random) -> str:
        return _write_meta(run_dir, value)
    m.__name__ = f"run_json_is_{json.dumps(value)}"
    return m


def run_field(name: str, value) -> Mutation:
    def m(run_dir: Path, rng: random.Random) -> str:
        meta = _meta(run_dir)
        meta[name] = value
        return _write_meta(run_dir, meta)
    m.__name__ = f"run_json_{name}_{json.dumps(value)[:20]}"
    return m


def stage_field(name: str, value) -> Mutation:
    def m(run_dir: Path, rng: random.Random) -> str:
        meta = _meta(run_dir)
        meta["stages"][0][name] = value
        return _write_meta(run_dir, meta)
    m.__name__ = f"stage_{name}_{json.dumps(value)[:20]}"
    return m


def endpoint_field(name: str, value) -> Mutation:
    def m(run_dir: Path, rng: random.Random) -> str:
        meta = _meta(run_dir)
        meta["endpoints"][0][name] = value
        return _write_meta(run_dir, meta)
    m.__name__ = f"endpoint_{name}_{json.dumps(value)[:20]}"
    return m


def config_field(name: str, value) -> Mutation:
    def m(run_dir: Path, rng: random.Random) -> str:
        meta = _meta(run_dir)
        meta["config"][name] = value
        return _write_meta(run_dir, meta)
    m.__name__ = f"config_{name}_{json.dumps(value)[:20]}"
    return m


# --------------------------------------------------------------------------------------------
# tables


def _table_file(run_dir: Path, table: str) -> Path:
    found = table_files(run_dir, table) + rows.shard_files(run_dir, table)
    return found[0]


def _rewrite(path: Path, t: pa.Table, table: str | None = None, batch_rows: int = 64) -> None:
    """``t`` as the file's kind: Parquet, an Arrow IPC stream or a rows stream (whose header
    names ``table``: by default the one of the file's name)."""
    if path.suffix == ".parquet":
        pq.write_table(t, path)
    elif path.suffix == ".rows":
        with open(path, "wb") as fh:
            fh.write(msgpack.packb(rows.header(table or path.name.split("-")[0],
                                               t.column_names)))
            for b in t.to_batches(max_chunksize=batch_rows):
                fh.write(rows.pack_batch([c.to_pylist() for c in b.columns]))
    else:
        with open(path, "wb") as fh, ipc.new_stream(fh, t.schema) as w:
            for b in t.to_batches(max_chunksize=batch_rows):
                w.write_batch(b)


def _read(path: Path) -> pa.Table:
    """A table file as written, its own columns and types (a rows stream's types inferred)."""
    if path.suffix == ".parquet":
        return pq.read_table(path)
    if path.suffix == ".arrows":
        return ipc.open_stream(path.read_bytes()).read_all()
    unpacker = rows.unpacker()
    unpacker.feed(path.read_bytes())
    try:
        names = unpacker.unpack()["columns"]
    except Exception as exc:  # noqa: BLE001 - an earlier damage made it unreadable
        raise ValueError(f"{path.name}: no rows header ({type(exc).__name__})") from None
    cols = [[] for _ in names]
    for batch in unpacker:
        for col, values in zip(cols, batch):
            col += values
    return pa.table(dict(zip(names, cols)))


def other_schema(table: str) -> Mutation:
    """The table's file replaced by one of another table's schema (or of no schema kvbench
    knows)."""
    def m(run_dir: Path, rng: random.Random) -> str:
        path = _table_file(run_dir, table)
        other = rng.choice([n for n in TABLES if n != table] + ["alien"])
        t = (TABLES[other].empty_table() if other != "alien" else
             pa.table({"a": [1, 2], "b": ["x", "y"]}))
        _rewrite(path, t, table=other)
        return path.name
    m.__name__ = f"{table}_other_schema"
    return m


def extra_shard(table: str) -> Mutation:
    """A second shard beside the table (of either kind), of another schema."""
    def m(run_dir: Path, rng: random.Random) -> str:
        path = run_dir / f"{table}-otherhost-99{rng.choice(rows.SHARD_SUFFIXES)}"
        t = rng.choice([pa.table({"a": [1, 2]}),
                        pa.table({"status": [1, 2], "t_sent": ["a", "b"]}),
                        pa.table({"endpoint": [[1], [2]]})])
        _rewrite(path, t)
        return path.name
    m.__name__ = f"{table}_shard_of_another_schema"
    return m


# Wrong types a column can be rewritten to (each value count-preserving).
def _wrong_column(col: pa.ChunkedArray, rng: random.Random) -> pa.Array:
    n = len(col)
    choices = [
        lambda: pa.array(["x%d" % i for i in range(n)]),
        lambda: pa.array([i * 7 for i in range(n)], pa.int64()),
        lambda: pa.array([i / 3 for i in range(n)], pa.float64()),
        lambda: pa.array([[i] for i in range(n)], pa.list_(pa.int64())),
        lambda: pa.array([{"a": i} for i in range(n)]),
        lambda: pa.array([bool(i % 2) for i in range(n)]),
        lambda: pa.nulls(n, pa.null()),
    ]
    return rng.choice(choices)()


def wrong_column(table: str, column: str | None = None) -> Mutation:
    def m(run_dir: Path, rng: random.Random) -> str:
        path = _table_file(run_dir, table)
        t = _read(path)
        name = column or rng.choice(t.column_names)
        i = t.schema.get_field_index(name)
        if i < 0:  # a partition column, in the folder names only: one written in the file
            t = t.append_column(name, _wrong_column(t.column(0), rng))
        else:
            t = t.set_column(i, name, _wrong_column(t.column(i), rng))
        _rewrite(path, t)
        return path.name
    m.__name__ = f"{table}_{column or 'any'}_wrong_type"
    return m


def missing_column(table: str) -> Mutation:
    def m(run_dir: Path, rng: random.Random) -> str:
        path = _table_file(run_dir, table)
        t = _read(path)
        _rewrite(path, t.drop_columns([rng.choice(t.column_names)]))
        return path.name
    m.__name__ = f"{table}_missing_column"
    return m


# --------------------------------------------------------------------------------------------


def _on(glob: str | tuple, damage) -> Mutation:
    """``damage`` done to the first file of ``glob`` (of the first of globs that finds one)."""
    globs = (glob,) if isinstance(glob, str) else glob

    def m(run_dir: Path, rng: random.Random) -> str:
        return damage(next(f for g in globs for f in sorted(run_dir.glob(g))), rng)
    m.__name__ = f"{globs[0]}_{damage.__name__}"
    return m


# a run's requests files (layout 2: a partitioned dataset; layout 1: requests.parquet)
REQUESTS_FILES = ("requests/**/*.parquet", "requests.parquet")

# The 17 damages of issue 11's account (the folder as kvbench run leaves it: parquet).
CATEGORIES: dict[str, Mutation] = {
    "requests.parquet truncated": _on(REQUESTS_FILES, truncate),
    "requests.parquet zero bytes": _on(REQUESTS_FILES, zero),
    "requests.parquet garbage": _on(REQUESTS_FILES, lambda p, r: _put(
        p, b"PAR1" + b"\x17" * 999 + b"PAR1")),
    "engine.parquet truncated": _on("engine.parquet", truncate),
    "gpu.parquet zero bytes": _on("gpu.parquet", zero),
    "run.json []": run_json_whole([]),
    "run.json zero bytes": _on("run.json", zero),
    "run.json truncated": _on("run.json", lambda p, r: _put(p, p.read_bytes()[:200])),
    # no run.json, job file or process sidecar: nothing to recover the run from (with a job
    # file or a sidecar left, kvbench recovers the run instead)
    "run.json, job files and sidecars missing": lambda d, r: _delete_all(
        d, "run.json", "job-*.json", "proc-*.json"),
    "run.json stages a string": run_field("stages", "open"),
    "run.json endpoints a dict": run_field("endpoints", {"emu": 1}),
    "run.json config a list": run_field("config", [1, 2]),
    "run.json a stage's t_start_ns a string": stage_field("t_start_ns", "soon"),
    "requests.parquet of another schema": other_schema("requests"),
    "a requests shard of another schema": extra_shard("requests"),
    "requests.parquet status an int column": lambda d, r: _set_column(
        d, "status", lambda n: pa.array(range(n), pa.int64())),
    "requests.parquet t_sent strings": lambda d, r: _set_column(
        d, "t_sent", lambda n: pa.array([f"t{j}" for j in range(n)])),
}


def _delete_all(run_dir: Path, *globs: str) -> str:
    for g in globs:
        for p in run_dir.glob(g):
            p.unlink()
    return globs[0]


def _put(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return path.name


def _set_column(run_dir: Path, column: str, make: Callable[[int], pa.Array]) -> str:
    path = table_files(run_dir, "requests")[0]
    t = pq.read_table(path)
    t = t.set_column(t.schema.get_field_index(column), column, make(t.num_rows))
    pq.write_table(t, path)
    return path.name


def _all_mutations(run_dir: Path) -> list[Mutation]:
    out: list[Mutation] = []
    for p in _data_files(run_dir):
        out += [_on(str(p.relative_to(run_dir)), d) for d in BYTE_DAMAGE]
    out += [run_json_whole(v) for v in ([], "x", None, 1, {}, [{"run_id": "a"}])]
    out += [run_field(f, v) for f in RUN_FIELDS for v in WRONG_VALUES]
    out += [stage_field(f, v) for f in STAGE_FIELDS for v in WRONG_VALUES]
    out += [endpoint_field(f, v) for f in ENDPOINT_FIELDS for v in WRONG_VALUES]
    out += [config_field(f, v) for f in CONFIG_FIELDS for v in WRONG_VALUES]
    tables = [t for t in TABLES if table_files(run_dir, t)
              or rows.shard_files(run_dir, t)]
    for t in tables:
        out += [other_schema(t), extra_shard(t), wrong_column(t), missing_column(t)]
        out += [wrong_column(t, c) for c in TABLES[t].names]
    return out


def fuzz(seed_dir: Path, out_root: Path, count: int, seed: int = 0,
         start: int = 0) -> list[tuple[Path, str, str]]:
    """``count`` damaged copies of ``seed_dir`` under ``out_root``: (folder, mutation, file).

    Every mutation kind appears before any repeats (shuffled, seeded); a copy may carry a
    second damage (a quarter of them), which names its first file too."""
    rng = random.Random(seed)
    kinds = _all_mutations(seed_dir)
    order: list[Mutation] = []
    while len(order) < count:
        batch = list(kinds)
        rng.shuffle(batch)
        order += batch
    out = []
    for i, m in enumerate(order[:count]):
        d = out_root / f"d{start + i:04d}"
        shutil.copytree(seed_dir, d)
        files = [m(d, rng)]
        if rng.random() < 0.25:
            extra = rng.choice(kinds)
            try:
                files.append(extra(d, rng))
            except (IndexError, KeyError, FileNotFoundError, TypeError, AttributeError,
                    ValueError, pa.ArrowException):
                pass  # the first damage already removed what the second would damage
        out.append((d, m.__name__, " ".join(files)))
    return out
