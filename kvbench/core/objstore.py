"""Results on object storage: a results folder named ``s3://bucket/prefix`` (AWS S3, or any
S3-compatible store: MinIO, Ceph, R2), read and written through ``pyarrow.fs.S3FileSystem``.

A run never writes to the bucket while its load goes on: the load processes, the capacity search,
the live view and compaction use a local *spool* folder, ``spool_root(loc) / run_id``
(``$KVBENCH_SPOOL_DIR`` or ``~/.cache/kvbench/spool``, then the endpoint's host, the bucket and
the prefix). ``Uploader``, a thread of the ``kvbench run`` parent (never of a load process: this
module imports pyarrow), copies each file of the spool once it is complete (a sidecar or job
file written whole, a shard whose load process has closed, a Parquet file no longer changing)
and, at the end, ``upload_run`` mirrors the whole folder and writes ``_COMPLETE`` last: a run on
the bucket without that object is incomplete (still being written, or its writer was killed) and
is never read as a run. ``fetch_run`` copies a complete run into a local cache folder (files
already there with the same size and time are kept) for the readers, which then read a local
folder as ever.

Where: URL options (``s3://bucket/prefix?endpoint_url=...&region=...&path_style=true``), then
``[storage]`` in bench.toml, then the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_DEFAULT_REGION``). Credentials are the AWS SDK's own chain (environment,
``~/.aws`` profiles, instance roles): kvbench never reads, takes or writes a key, and a URL with
one (userinfo, a key option) is refused.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

SCHEME = "s3"
MARKER = "_COMPLETE"  # uploaded last: the run's files are all there
LATEST = "latest"  # an object holding the id of the last run uploaded to the prefix
OPTIONS = ("endpoint_url", "region", "path_style")
SKIP = ("runner.json",)  # the spool's own "still running" mark: no meaning elsewhere
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CHUNK = 1 << 20


def is_url(text) -> bool:
    """Whether ``text`` names an object store (``s3://...``) rather than a local folder."""
    return isinstance(text, str) and text.strip().lower().startswith(f"{SCHEME}://")


@dataclass(frozen=True)
class Location:
    """A prefix of a bucket, and how to reach the store (None: the default)."""

    bucket: str
    prefix: str = ""  # no leading or trailing '/'
    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool | None = None

    def key(self, *parts: str) -> str:
        """``bucket/prefix/part/...``: a path of ``S3FileSystem``."""
        return "/".join(p.strip("/") for p in (self.bucket, self.prefix, *parts) if p)

    def url(self, *parts: str) -> str:
        return f"{SCHEME}://{self.key(*parts)}"

    def host(self) -> str:
        """A file-name-safe name of the store: its endpoint's host and port, or ``aws``."""
        if not self.endpoint_url:
            return "aws"
        return re.sub(r"[^A-Za-z0-9_.-]", "_", urlsplit(self.endpoint_url).netloc) or "aws"


def _truthy(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"option {name}={value[:20]!r} is not true or false")


def endpoint_problem(url: str) -> str | None:
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return (f"endpoint_url {url[:80]!r} is not an http(s) URL; write e.g. "
                "\"http://127.0.0.1:9000\"")
    if u.username or u.password:
        return ("endpoint_url holds a user name or password; remove it (credentials come "
                "from the AWS environment variables or profile, never from the config)")
    return None


def parse(url: str, storage=None, env=None) -> Location:
    """The location ``url`` names, its options completed from ``storage`` (``[storage]``'s
    fields: an object or a dict) and the environment. A bad URL raises ``ValueError`` with the
    reason and the fix."""
    env = os.environ if env is None else env
    text = url.strip()
    if not is_url(text):
        raise ValueError(f"{text[:80]!r} is not an {SCHEME}:// URL")
    u = urlsplit(text)
    if "@" in u.netloc:
        raise ValueError("the URL holds credentials (user:key@); remove them: they come from "
                         "the AWS environment variables or profile")
    if u.fragment or text.endswith("#"):
        raise ValueError("the URL holds a '#'; object keys written by kvbench have none, "
                         "remove it")
    bucket = u.netloc
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(f"{bucket[:70]!r} is not a bucket name (3 to 63 lower-case letters, "
                         "digits, '.' and '-'); write s3://BUCKET/PREFIX")
    prefix = u.path.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"prefix {prefix[:70]!r} has an empty, '.' or '..' part; write "
                         "s3://BUCKET/a/b")
    opts: dict = {}
    for name, value in parse_qsl(u.query, keep_blank_values=True):
        if name not in OPTIONS:
            why = (" (credentials come from the AWS environment variables or profile, never "
                   "from the URL)" if re.search(r"key|secret|token|password", name, re.I)
                   else "")
            raise ValueError(f"unknown option {name[:40]!r}{why}; the options are "
                             f"{', '.join(OPTIONS)}")
        opts[name] = _truthy(name, value) if name == "path_style" else value
    if storage is not None:
        given = storage if isinstance(storage, dict) else storage.model_dump()
        for name in OPTIONS:
            if opts.get(name) is None and given.get(name) is not None:
                opts[name] = given[name]
    opts.setdefault("endpoint_url", env.get("AWS_ENDPOINT_URL_S3") or
                    env.get("AWS_ENDPOINT_URL") or None)
    opts.setdefault("region", env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None)
    if opts["endpoint_url"]:
        why = endpoint_problem(opts["endpoint_url"])
        if why:
            raise ValueError(why)
        opts["endpoint_url"] = opts["endpoint_url"].rstrip("/")
    return Location(bucket, prefix, **opts)


def split_run(url: str, storage=None) -> tuple[Location, str]:
    """``s3://bucket/prefix/RUN``: the store's location and the run id."""
    loc = parse(url, storage)
    head, _, run_id = loc.prefix.rpartition("/")
    if not run_id:
        raise ValueError(f"{url[:80]!r} names a bucket, not a run; write "
                         "s3://BUCKET/PREFIX/RUN_ID")
    return replace(loc, prefix=head), run_id


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvbench"


def spool_root(loc: Location) -> Path:
    """Where ``kvbench run`` writes the runs of ``loc`` before they are uploaded."""
    base = os.environ.get("KVBENCH_SPOOL_DIR")
    base = Path(base) if base else _cache_home() / "spool"
    return base.joinpath(loc.host(), loc.bucket, *filter(None, loc.prefix.split("/")))


def cache_root(loc: Location) -> Path:
    """Where the readers keep their copies of the runs of ``loc``."""
    return _cache_home().joinpath("s3", loc.host(), loc.bucket,
                                  *filter(None, loc.prefix.split("/")))


_fs_lock = threading.Lock()
_fs: dict = {}


def filesystem(loc: Location):
    """The ``S3FileSystem`` of ``loc``'s store (one per store and process)."""
    from pyarrow import fs as pafs

    k = (loc.endpoint_url, loc.region, loc.path_style)
    with _fs_lock:
        if k not in _fs:
            kw: dict = {"connect_timeout": 10, "request_timeout": 60}
            if loc.region:
                kw["region"] = loc.region
            if loc.endpoint_url:
                u = urlsplit(loc.endpoint_url)
                kw["endpoint_override"] = u.netloc + u.path
                kw["scheme"] = u.scheme
            if loc.path_style is False:
                kw["force_virtual_addressing"] = True
            _fs[k] = pafs.S3FileSystem(**kw)
        return _fs[k]


def bucket_problem(loc: Location) -> str | None:
    """Why the results cannot be written to ``loc`` (None: its bucket is there)."""
    from pyarrow import fs as pafs

    try:
        info = filesystem(loc).get_file_info(loc.bucket)
    except OSError as exc:
        return (f"the store at {loc.endpoint_url or 'AWS S3'} cannot be reached or refuses "
                f"access ({str(exc).splitlines()[0][:160]}); check endpoint_url, region and "
                "the AWS credentials in the environment or profile")
    if info.type == pafs.FileType.NotFound:
        return (f"bucket {loc.bucket!r} does not exist at {loc.endpoint_url or 'AWS S3'}; "
                "create it first or name another")
    return None


def listing(loc: Location, run_id: str) -> dict[str, tuple[int, int]]:
    """The objects of run ``run_id``: {path relative to the run: (size, time ns)}."""
    from pyarrow import fs as pafs

    root = loc.key(run_id)
    sel = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    out = {}
    for info in filesystem(loc).get_file_info(sel):
        if info.type == pafs.FileType.File:
            out[info.path[len(root) + 1:]] = (info.size, info.mtime_ns or 0)
    return out


def read_object(loc: Location, *parts: str) -> bytes | None:
    try:
        with filesystem(loc).open_input_stream(loc.key(*parts)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def put_bytes(loc: Location, data: bytes, *parts: str) -> None:
    with filesystem(loc).open_output_stream(loc.key(*parts)) as f:
        f.write(data)


def put_file(loc: Location, path: Path, *parts: str) -> None:
    with open(path, "rb") as src, filesystem(loc).open_output_stream(loc.key(*parts)) as dst:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)


def complete(loc: Location, run_id: str) -> dict | None:
    """The marker of run ``run_id`` (None: the run is not complete on the store)."""
    data = read_object(loc, run_id, MARKER)
    if data is None:
        return None
    try:
        marker = json.loads(data)
    except ValueError:
        return None
    return marker if isinstance(marker, dict) else None


def read_latest(loc: Location) -> str | None:
    data = read_object(loc, LATEST)
    return data.decode("utf-8", "replace").strip() if data else None


def local_files(run_dir: Path) -> dict[str, Path]:
    """A spooled run's files to upload, sub-folders but no hidden ones (a compaction's work):
    {relative path: path}."""
    rels = {p: p.relative_to(run_dir).as_posix() for p in sorted(run_dir.rglob("*"))}
    return {r: p for p, r in rels.items() if p.is_file() and p.suffix != ".tmp"
            and p.name not in SKIP + (MARKER,) and not r.startswith(".") and "/." not in r}


def upload_run(run_dir: Path, loc: Location, run_id: str, sent: dict | None = None) -> int:
    """Mirror ``run_dir`` to ``loc/run_id``: every file not yet sent as it is now (``sent``:
    {relative path: (size, mtime ns)} of what this process already uploaded; None: compare
    sizes with the store's), objects the folder no longer holds removed (shards folded into
    Parquet), then the marker, last, and ``latest``. Returns the files uploaded."""
    run_dir = Path(run_dir)
    remote = listing(loc, run_id)
    if MARKER in remote:  # a run being written again is incomplete until its end
        filesystem(loc).delete_file(loc.key(run_id, MARKER))
    files = local_files(run_dir)
    n = 0
    for rel, path in files.items():
        st = path.stat()
        if sent is not None:
            if sent.get(rel) == (st.st_size, st.st_mtime_ns) and rel in remote:
                continue
        elif rel in remote and remote[rel][0] == st.st_size and rel != "run.json":
            continue
        put_file(loc, path, run_id, rel)
        n += 1
    fs = filesystem(loc)
    for rel in remote:
        if rel not in files and rel != MARKER:
            fs.delete_file(loc.key(run_id, rel))
    marker = {"run_id": run_id, "written_ns": time.time_ns(),
              "files": {rel: p.stat().st_size for rel, p in files.items()}}
    put_bytes(loc, json.dumps(marker, indent=1).encode(), run_id, MARKER)
    put_bytes(loc, run_id.encode(), LATEST)
    return n


def fetch_run(loc: Location, run_id: str, dest: Path | None = None) -> Path:
    """Copy complete run ``run_id`` into the local cache (or ``dest``): files already there
    with the store's size and time are kept. Returns the local folder."""
    dest = Path(dest) if dest is not None else cache_root(loc) / run_id
    index_path = dest / ".objstore.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    fs = filesystem(loc)
    for rel, (size, mtime) in listing(loc, run_id).items():
        target = dest / rel
        if index.get(rel) == [size, mtime] and target.is_file() and \
                target.stat().st_size == size:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".part")
        with fs.open_input_stream(loc.key(run_id, rel)) as src, open(tmp, "wb") as out:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
        os.replace(tmp, target)
        index[rel] = [size, mtime]
    dest.mkdir(parents=True, exist_ok=True)
    index_path.write_text(json.dumps(index))
    return dest


def _closed_stems(run_dir: Path) -> set[str]:
    """``<host>-<pid>`` of each load process whose sidecar says it closed its shards."""
    out = set()
    for p in run_dir.glob("proc-*.json"):
        try:
            if json.loads(p.read_bytes()).get("closed_ns"):
                out.add(p.stem.removeprefix("proc-"))
        except (OSError, ValueError, AttributeError):
            continue
    return out


class Uploader:
    """Uploads the complete files of a spooled run while it goes on (every ``interval_s``),
    then, at ``finish``, the whole run and its marker. Upload errors during the run are kept
    for the end (the spool still holds everything); ``finish`` raises ``OSError``."""

    def __init__(self, run_dir: Path, loc: Location, run_id: str,
                 interval_s: float = 2.0) -> None:
        self.run_dir, self.loc, self.run_id = Path(run_dir), loc, run_id
        self.interval_s = interval_s
        self.sent: dict[str, tuple[int, int]] = {}
        self.seen: dict[str, tuple[int, int]] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvbench-upload", daemon=True)

    def start(self) -> "Uploader":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except OSError as exc:
                self.errors.append(str(exc).splitlines()[0][:200])

    def ready(self, rel: str, path: Path, st, closed: set[str]) -> bool:
        """Whether a spool file is complete: a shard once its process closed (or a rotated
        part once ``rows.sealed``), a JSON file written whole (by rename), anything else once
        unchanged over one interval."""
        now = (st.st_size, st.st_mtime_ns)
        if path.suffix in (".rows", ".arrows"):
            from kvbench.core.rows import sealed
            table, _, rest = path.stem.partition("-")
            return sealed(path) or any(rest == s or rest.startswith(s + "-") for s in closed)
        if path.suffix == ".json":
            return True
        stable = self.seen.get(rel) == now
        self.seen[rel] = now
        return stable

    def step(self) -> int:
        closed = _closed_stems(self.run_dir)
        n = 0
        for rel, path in local_files(self.run_dir).items():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            now = (st.st_size, st.st_mtime_ns)
            if self.sent.get(rel) == now or not self.ready(rel, path, st, closed):
                continue
            put_file(self.loc, path, self.run_id, rel)
            self.sent[rel] = now
            n += 1
        return n

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def finish(self) -> int:
        """The whole run uploaded, the marker last; the files sent in all."""
        self.stop()
        upload_run(self.run_dir, self.loc, self.run_id, self.sent)
        return len(local_files(self.run_dir))
