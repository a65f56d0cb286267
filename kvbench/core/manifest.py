"""The history manifest of a results store (a local folder or ``s3://bucket/prefix``): one small
JSON object per run and per write, so listing a store's runs reads neither every run nor every
history file, and two nightly jobs writing the same store at once never touch the same object.

Layout, under the store's ``history/`` (the underscore keeps Hive/Arrow/Spark dataset readers
of ``history/`` off these files)::

    history/_manifest/suite=<suite>/<started_ns:020d>-<run_id>@<written_ns:020d>.json
    history/_index.json   # a compacted copy of the entries: an optimisation, never the truth

An entry is written once and never changed: a new verdict for a run (the gate after an
``--accept``) is a new object with a later ``written_ns``, and readers take the newest object
of each run. So no writer ever reads, modifies and writes back a shared object; the listing of
``_manifest/`` is the truth. ``_index.json`` maps object names to their entries: a reader takes
from it the entries of the names it listed and reads only the others; an index entry whose
object is no longer listed (pruned) is ignored, and a lost race between two index rebuilds
only costs reads. Pure JSON: no pandas or pyarrow beyond the S3 filesystem of ``objstore``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvbench.core import objstore

MANIFEST = "history/_manifest"
INDEX = "history/_index.json"
VERSION = 1


@dataclass(frozen=True)
class Store:
    """Where a results store lives: ``root`` (a local folder) or ``loc`` (an object store)."""

    root: Path | None = None
    loc: objstore.Location | None = None

    @classmethod
    def of(cls, results_dir, storage=None) -> "Store":
        """The store named by a path, an ``s3://`` URL, a ``Location`` or a ``Store``."""
        if isinstance(results_dir, Store):
            return results_dir
        if isinstance(results_dir, objstore.Location):
            return cls(loc=results_dir)
        if objstore.is_url(results_dir):
            return cls(loc=objstore.parse(str(results_dir), storage))
        return cls(root=Path(results_dir))

    @property
    def remote(self) -> bool:
        return self.loc is not None

    def where(self, rel: str = "") -> str:
        """A name of ``rel`` for messages: its path, or its URL."""
        if self.loc is not None:
            return self.loc.url(rel)
        return str(self.root / rel) if rel else str(self.root)

    def run_ref(self, run_id: str, run_path) -> str:
        """How an entry names its run: the URL on a store, the absolute folder locally."""
        if self.loc is not None:
            return self.loc.url(run_id)
        return str(Path(run_path).resolve())

    def put(self, rel: str, data: bytes) -> None:
        """Write an object whole: a local file appears by rename, never half-written."""
        if self.loc is not None:
            objstore.put_bytes(self.loc, data, rel)
            return
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def get(self, rel: str) -> bytes | None:
        if self.loc is not None:
            return objstore.read_object(self.loc, rel)
        try:
            return (self.root / rel).read_bytes()
        except FileNotFoundError:
            return None

    def list(self, rel: str) -> list[str]:
        """The objects under ``rel`` (paths relative to it), sorted; none if it is absent."""
        if self.loc is not None:
            return sorted(objstore.listing(self.loc, rel))
        base = self.root / rel
        if not base.is_dir():
            return []
        return sorted(p.relative_to(base).as_posix() for p in base.rglob("*")
                      if p.is_file() and not p.name.startswith("."))

    def delete(self, rel: str) -> None:
        if self.loc is not None:
            try:
                objstore.filesystem(self.loc).delete_file(self.loc.key(rel))
            except FileNotFoundError:
                pass
            return
        (self.root / rel).unlink(missing_ok=True)

    def delete_tree(self, rel: str) -> None:
        """A run's folder (or prefix) and everything in it."""
        if self.loc is not None:
            for name in objstore.listing(self.loc, rel):
                self.delete(f"{rel}/{name}")
            return
        import shutil

        shutil.rmtree(self.root / rel, ignore_errors=True)


def entry_name(suite: str, started_ns: int, run_id: str, written_ns: int) -> str:
    return f"suite={suite}/{int(started_ns):020d}-{run_id}@{int(written_ns):020d}.json"


def _parse_name(name: str) -> tuple[str, int, str, int] | None:
    """(suite, started_ns, run_id, written_ns) of an object name; None: not an entry."""
    part, _, file = name.partition("/")
    if not part.startswith("suite=") or not file.endswith(".json") or "/" in file:
        return None
    head, at, written = file[:-5].rpartition("@")
    started, dash, run_id = head.partition("-")
    if not (at and dash and run_id and started.isdigit() and written.isdigit()):
        return None
    return part[len("suite="):], int(started), run_id, int(written)


def write_entry(store: Store, entry: dict) -> str:
    """Add ``entry`` (``run_id``, ``suite``, ``started_ns``, ``verdict``, ``run``,
    ``history``, ``figures``...) as a new object; returns its name under ``_manifest/``."""
    written = time.time_ns()
    entry = dict(entry, version=VERSION, written_ns=written)
    name = entry_name(entry["suite"], entry["started_ns"], entry["run_id"], written)
    store.put(f"{MANIFEST}/{name}", json.dumps(entry, sort_keys=True).encode())
    return name


@dataclass
class Listing:
    """The newest object of each run (by suite and start), and the older ones it supersedes."""

    newest: dict  # (suite, started_ns, run_id) -> name
    superseded: list  # names

    def runs(self, suite: str | None = None) -> list[tuple[tuple, str]]:
        """[(key, name)] oldest first, of ``suite`` when given."""
        return sorted((k, n) for k, n in self.newest.items() if suite is None or k[0] == suite)


def list_entries(store: Store, suite: str | None = None) -> Listing:
    """One listing of ``_manifest/`` (of one suite's folder when ``suite`` is given)."""
    rel = MANIFEST if suite is None else f"{MANIFEST}/suite={suite}"
    names = store.list(rel)
    if suite is not None:
        names = [f"suite={suite}/{n}" for n in names]
    newest: dict = {}
    superseded = []
    for name in names:
        parsed = _parse_name(name)
        if parsed is None:
            continue
        s, started, run_id, written = parsed
        key = (s, started, run_id)
        old = newest.get(key)
        if old is None or _parse_name(old)[3] < written:
            if old is not None:
                superseded.append(old)
            newest[key] = name
        else:
            superseded.append(name)
    return Listing(newest, superseded)


def _load_index(store: Store) -> dict:
    data = store.get(INDEX)
    try:
        doc = json.loads(data) if data else {}
    except ValueError:
        return {}  # a damaged index is only a slower read
    entries = doc.get("entries") if isinstance(doc, dict) else None
    return entries if isinstance(entries, dict) and doc.get("version") == VERSION else {}


def read_entries(store: Store, suite: str | None = None, limit: int | None = None,
                 where=None) -> list[dict]:
    """The newest entry of each run, oldest first: of ``suite`` when given, only runs whose
    entry satisfies ``where`` (a predicate), the newest ``limit`` of them. Objects are read from
    the index when it holds them, else one by one, newest first, until ``limit`` are found."""
    listing = list_entries(store, suite)
    index = _load_index(store)
    out = []
    for _, name in reversed(listing.runs(suite)):
        entry = index.get(name)
        if not isinstance(entry, dict):
            entry = read_entry(store, name)
            if entry is None:
                continue
        if where is not None and not where(entry):
            continue
        out.append(entry)
        if limit is not None and len(out) >= limit:
            break
    return out[::-1]


def read_entry(store: Store, name: str) -> dict | None:
    """One entry; None when it vanished (pruned meanwhile). A damaged one names itself."""
    from kvbench.core.errors import DataError

    data = store.get(f"{MANIFEST}/{name}")
    if data is None:
        return None
    try:
        entry = json.loads(data)
        if not isinstance(entry, dict) or "run_id" not in entry:
            raise ValueError("not an entry")
    except ValueError:
        raise DataError(f"{store.where(f'{MANIFEST}/{name}')}: not a readable history "
                        "manifest entry; remove it (that run leaves the history) and gate "
                        "again") from None
    return entry


def rebuild_index(store: Store) -> int:
    """Write ``_index.json`` from every current entry (superseded ones left out); returns the
    entries it holds. Safe beside writers: an entry written meanwhile is simply not in it."""
    listing = list_entries(store)
    old = _load_index(store)
    entries = {}
    for _, name in listing.runs():
        entry = old.get(name) if isinstance(old.get(name), dict) else read_entry(store, name)
        if entry is not None:
            entries[name] = entry
    store.put(INDEX, json.dumps({"version": VERSION, "built_ns": time.time_ns(),
                                 "entries": entries}, sort_keys=True).encode())
    return len(entries)


BASELINE_VERDICTS = ("pass", "accepted")


def plan_prune(entries: list[dict], keep_runs: int | None = None,
               keep_days: float | None = None, now_ns: int | None = None) -> list[dict]:
    """The entries to drop (``entries``: every run, oldest first): per suite, those beyond the
    newest ``keep_runs`` or started more than ``keep_days`` ago; never a suite's newest passing
    or accepted run, which ``last-pass`` needs."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    drop = []
    suites: dict = {}
    for e in entries:
        suites.setdefault(e.get("suite"), []).append(e)
    for runs in suites.values():
        runs = sorted(runs, key=lambda e: (e["started_ns"], e["run_id"]))
        passing = [e for e in runs if e.get("verdict") in BASELINE_VERDICTS]
        keep_base = passing[-1]["run_id"] if passing else None
        for i, e in enumerate(runs):
            old = keep_runs is not None and i < len(runs) - keep_runs
            if keep_days is not None:
                old = old or e["started_ns"] < now_ns - keep_days * 86400e9
            if old and e["run_id"] != keep_base:
                drop.append(e)
    return drop


def prune(store: Store, keep_runs: int | None = None, keep_days: float | None = None,
          runs_too: bool = False, now_ns: int | None = None) -> list[dict]:
    """Drop the manifest entries (every version) and history files of the runs ``plan_prune``
    names, and superseded entries; with ``runs_too``, the runs' own folders in this store as
    well. Then rebuild the index. Returns the dropped entries. Entries written meanwhile by
    another job are not in this listing and stay."""
    listing = list_entries(store)
    entries = read_entries(store)
    drop = plan_prune(entries, keep_runs, keep_days, now_ns)
    gone = {(e["suite"], e["started_ns"], e["run_id"]) for e in drop}
    names = set(listing.superseded)
    for e in drop:
        if e.get("history"):
            store.delete(e["history"])
        if runs_too and _inside(store, e):
            store.delete_tree(e["run_id"])
    for name in store.list(MANIFEST):
        parsed = _parse_name(name)
        if parsed and parsed[:3] in gone:
            names.add(name)
    for name in sorted(names):
        store.delete(f"{MANIFEST}/{name}")
    rebuild_index(store)
    return drop


def _inside(store: Store, entry: dict) -> bool:
    """Whether the entry's run is the store's own ``<store>/<run_id>`` (never elsewhere)."""
    run = str(entry.get("run") or "")
    if store.loc is not None:
        return run == store.loc.url(entry["run_id"])
    return run == str((store.root / entry["run_id"]).resolve())
