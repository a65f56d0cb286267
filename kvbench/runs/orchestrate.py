"""``kvbench run``'s work: the bench.toml matrix (endpoints x workloads x load stages),
headless through Locust, with preflight checks before any load, then results and run.json.

``MatrixRun`` holds one run's state (the built-in endpoints it started, its collectors, its
jobs and their cache states, what was incomplete, the stop signal that cut it) and does it in
steps: checks before anything starts, the endpoints, preflight, telemetry, the jobs (one after
another, or each endpoint's side by side), the stop, finalize. It prints nothing itself: every
line goes through ``console`` (``kvbench.commands.run.Console``), so the command owns the
wording. Locust runs in subprocesses, so gevent never enters this process; the collectors run
in its threads. Over 400 lines, kept whole: one run's steps in order, each a short method.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.core.contract import Incomplete, RunMeta
from kvbench.core.errors import INCOMPLETE_EXIT, UserError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal reached ``kvbench run``: everything it started stops, what was recorded
    is finalized, marked interrupted."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum, frame) -> None:
    for sig in STOP_SIGNALS:  # one interrupt: the cleanup that follows must not be cut
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


@dataclass
class RunOptions:
    """What ``kvbench run``'s flags ask for."""

    config: Path
    processes: int = 1
    dist: object | None = None  # runs.locust.Distributed; None: one host, ``processes``
    results_dir: str | None = None  # None: suite.results_dir
    run_id: str | None = None
    endpoints: list | None = None  # None: every endpoint
    workloads: list | None = None
    profile: str | None = None
    duration_scale: float = 1.0


@dataclass
class MatrixRun:
    opts: RunOptions
    console: object  # the lines of progress (``commands.run.Console``'s methods)
    cfg: object = None
    sel: object = None  # runs.matrix.Selection
    results_dir: Path | None = None
    run_id: str = ""
    run_dir: Path | None = None
    workloads: dict = field(default_factory=dict)  # name -> generator
    servers: list = field(default_factory=list)  # built-in endpoints started
    adapters: dict = field(default_factory=dict)  # endpoint -> engine adapter
    jobs: list = field(default_factory=list)
    cache_states: list = field(default_factory=list)  # per job: the state it started from
    collectors: object = None
    receiver: object = None  # the OTLP receiver, when suite.otlp_listen
    telemetry: dict = field(default_factory=dict)  # {source: "ok" | why it is missing}
    incomplete: list[Incomplete] = field(default_factory=list)
    cut_jobs: list[Incomplete] = field(default_factory=list)  # a job's load cut short
    clock_offsets_ns: dict = field(default_factory=dict)
    interrupted: Interrupted | None = None
    started_ns: int = 0
    remote: object = None  # core.objstore.Location of an s3:// results_dir; None: local
    uploader: object = None  # core.objstore.Uploader of the spooled run

    # -- before any load
    def check(self) -> None:
        """The config and flags, checked before anything starts (a user error raises)."""
        from kvbench.config import load_config
        from kvbench.config.parse import classes_without_slo
        from kvbench.core import objstore, store
        from kvbench.runs import matrix

        o = self.opts
        self.cfg = cfg = load_config(o.config)
        if o.processes < 1:
            raise UserError("--processes must be at least 1")
        if o.duration_scale <= 0:
            raise UserError("--duration-scale must be positive, e.g. 0.5")
        self.sel = sel = matrix.select(cfg, endpoints=o.endpoints, workloads=o.workloads,
                                       profile=o.profile, where=str(o.config))
        no_slo = classes_without_slo(cfg, sel.workloads)
        if no_slo:
            self.console.no_slo(no_slo, o.config)
        if o.dist is not None and not o.dist.local:
            local_only = [ep.name for ep in sel.endpoints if ep.kind == "builtin"]
            if local_only:
                raise UserError(f"{o.config}: endpoint(s) {', '.join(local_only)} are "
                                "built-in, served on this host's loopback where workers "
                                "elsewhere cannot reach them; run them with --workers N, or "
                                "point [[endpoints]] at a server the workers reach (kvbench "
                                "serve --host 0.0.0.0)")
        searching = [n for n in sel.profiles if cfg.profiles[n].pacing == "search"]
        if o.dist is not None and searching:
            raise UserError(f"{o.config}: profile {searching[0]} is a capacity search, which "
                            "runs its probes from this host alone; drop --workers/"
                            "--expect-workers or pick a fixed-rate profile with --profile")
        target = str(o.results_dir or cfg.suite.results_dir)
        self.remote = self.object_store(target)  # s3://: the run spooled here, then uploaded
        self.results_dir = objstore.spool_root(self.remote) if self.remote else Path(target)
        self.run_id = o.run_id or store.new_run_id(cfg.suite.name)
        self.run_dir = self.results_dir / self.run_id
        if self.run_dir.exists() and any(self.run_dir.iterdir()) or (
                self.remote and objstore.listing(self.remote, self.run_id)):
            raise UserError(f"{self.run_dir if not self.remote else self.remote.url(self.run_id)}"
                            " already holds results; pick another --run-id")

    def object_store(self, target: str):
        """The object store ``target`` names, its bucket checked (None: a local folder)."""
        from kvbench.core import objstore

        if not objstore.is_url(target):
            return None
        field = ("--results-dir" if self.opts.results_dir else
                 f"{self.opts.config}: field suite.results_dir")
        try:
            loc = objstore.parse(target, self.cfg.storage)
        except ValueError as exc:
            raise UserError(f"{field}: {exc}") from None
        why = objstore.bucket_problem(loc)
        if why:
            raise UserError(f"{field} {target.strip()[:200]}: {why} ([storage] in {self.opts.config} "
                            "sets endpoint_url, region and path_style)")
        return loc

    def run(self) -> int:
        """The whole run, its summary printed; the exit code."""
        from kvbench.workloads.registry import make_workload

        self.check()
        self.console.begin(self.run_id, self.sel)
        self.workloads = {n: make_workload(n, self.cfg) for n in self.sel.workloads}
        self.started_ns = time.time_ns()
        previous = {sig: signal.signal(sig, _on_signal) for sig in STOP_SIGNALS}
        try:
            try:
                self.load()
            except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (Interrupted)
                self.interrupted = (exc if isinstance(exc, Interrupted)
                                    else Interrupted(signal.SIGINT))
                self.console.interrupted(self.interrupted)
            finally:
                self.stop()
            meta = self.finish() if self.run_dir.exists() else None
            if meta is not None:
                self.console.summary(self.run_dir, meta, shown=self.remote and
                                     self.remote.url(self.run_id))
            failed = self.upload()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.interrupted:
            return 128 + self.interrupted.signum
        if failed:
            return INCOMPLETE_EXIT
        cut = self.cut_short(meta) if meta is not None else []
        if cut:
            self.console.incomplete(cut, INCOMPLETE_EXIT)
            return INCOMPLETE_EXIT
        return 0

    def cut_short(self, meta: RunMeta) -> list[str]:
        """Why the run's load is not whole, from what the jobs returned and run.json: a Locust
        child that exited on a signal or an error, a load process killed before it closed its
        records, a worker lost, records compacted that do not add up. Telemetry that could
        not be collected or a summary that could not be written leave the load whole."""
        out = [f"{i.what}: {i.why}" for i in self.cut_jobs]
        if meta.interrupted:  # no signal reached kvbench run: a load process's own account
            out.append(f"the load: {meta.interruption}")
        for name, acct in (meta.workers or {}).items():
            if acct.get("lost"):
                out.append(f"worker {name}: lost ({acct.get('lost_why')})")
        out += [f"{i.what}: {i.why}" for i in meta.incomplete
                if i.what == "records" or i.what.endswith("load process(es)")]
        return out

    # -- the load
    def load(self) -> None:
        from kvbench.runs import finalize, matrix, telemetry

        targets = self.start_endpoints()
        checked = self.preflight(targets)
        self.jobs = matrix.jobs(self.cfg, self.sel, checked, run_id=self.run_id,
                                results_dir=self.results_dir,
                                duration_scale=self.opts.duration_scale)
        parallel = (self.cfg.suite.parallel_endpoints and self.opts.dist is None
                    and len(self.sel.endpoints) > 1)
        if parallel:
            self.jobs = self.own_servers(self.jobs)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        finalize.mark_running(self.run_dir)  # recovery leaves the run alone while this lives
        if self.remote:  # complete files go up while the load goes on
            from kvbench.core.objstore import Uploader

            self.uploader = Uploader(self.run_dir, self.remote, self.run_id).start()
        self.collectors = self.noting(
            lambda notes: telemetry.start(self.run_dir, self.cfg, self.jobs, notes))
        self.start_otlp()
        # side by side, the lanes run at once: the load lasts as long as the longest lane
        lanes = self.lanes() if parallel else {"": list(enumerate(self.jobs, 1))}
        self.console.planned(self.jobs, max(sum(matrix.expected_s(j) for _, j in lane)
                                            for lane in lanes.values()), self.run_dir)
        if parallel:
            self.side_by_side()
        else:
            for k, job in enumerate(self.jobs, 1):
                self.one(k, job, self.workloads)

    def start_endpoints(self) -> list[tuple]:
        """(endpoint, URL) of each selected endpoint, the built-in ones started."""
        from kvbench.runs import builtin

        targets = []
        for ep in self.sel.endpoints:
            if ep.kind == "builtin":
                proc, url = builtin.start(ep)
                self.servers.append(proc)
            else:
                url = ep.url.rstrip("/")
            targets.append((ep, url))
        return targets

    def preflight(self, targets: list[tuple]) -> list[tuple]:
        """(endpoint, URL, model, context length) of each target, checked before any load."""
        from kvbench import engines
        from kvbench.runs import preflight

        checked = []
        for ep, url in targets:
            c = preflight.check(ep, url, self.workloads)
            checked.append((ep, url, c.model, c.max_context_tokens))
            self.adapters[ep.name] = engines.get(c.engine)
        return checked

    def start_otlp(self) -> None:
        """The engines' per-request spans, joined in the report (``suite.otlp_listen``)."""
        listen = self.cfg.suite.otlp_listen
        if not listen:
            return
        from kvbench.runs.otlp import OtlpReceiver

        host, _, port = listen.rpartition(":")
        try:
            self.receiver = OtlpReceiver(self.run_dir, host.strip("[]"), int(port)).start()
        except OSError as exc:
            raise UserError(f"{self.opts.config}: field suite.otlp_listen: cannot listen on "
                            f"{listen} ({exc.strerror}); pick a free port") from None
        self.console.otlp(self.receiver.url)

    def one(self, k: int, job, wls: dict, quiet: bool = False) -> None:
        """Job ``k``: its cache state prepared, its load run (a search's probes, or its
        stages), its cache counters read after. ``quiet``: a lane of endpoints run side by
        side, whose every line names its endpoint x workload (``search.console.lane``)."""
        from kvbench.runs.search import console

        with console.lane(f"{job.endpoint.name} x {job.workload}" if quiet else None):
            self._one(k, job, wls, quiet)

    def _one(self, k: int, job, wls: dict, quiet: bool) -> None:
        from kvbench.runs import cache, finalize, locust, progress, search

        n = len(self.jobs)
        label = job.label()
        self.console.job_begins(k, n, label)
        t0 = time.monotonic()
        adapter = self.adapters[job.endpoint.name]
        job, state = cache.prepare(job, adapter, job.headers(), wls.get(job.workload))
        self.console.job_cache(k, n, state.started_from)
        self.cache_states.append(state)  # kept when a stop cuts the job
        # quiet unless stdout is a terminal; endpoints run side by side share none
        with (contextlib.nullcontext() if quiet else progress.Progress(job, self.run_dir)):
            out = (search.run(job, self.opts.processes) if job.pacing == "search" else
                   locust.run(job, self.opts.processes, self.opts.dist))
        cache.finish(state, job, adapter, job.headers(), wls.get(job.workload))
        self.console.job_done(k, n, label, time.monotonic() - t0,
                              finalize.records_so_far(self.run_dir))
        if out.error:
            raise UserError(out.error)
        if out.rc not in (0, 1):  # 1: Locust saw failed requests, which the records hold
            note = Incomplete(what=label, why=f"locust exited with code {out.rc}")
            self.incomplete.append(note)
            self.cut_jobs.append(note)  # the run's exit says so (``cut_short``)

    def own_servers(self, jobs: list) -> list:
        """Side by side, a built-in endpoint's later workloads each get a server of their own
        (a fresh instance of the same emulated hardware, as a job's cache reset makes it), so
        that every endpoint x workload runs at once: the default bake-off's searches then
        have the time to hold what they claim. An endpoint at a URL keeps its workloads in
        order on its one server."""
        from dataclasses import replace

        from kvbench.runs import builtin

        specs = {ep.name: ep for ep in self.sel.endpoints}
        first: dict[str, str] = {}
        out = []
        for job in jobs:
            ep = specs.get(job.endpoint.name)
            name = job.endpoint.name
            staged = bool(job.profile and self.cfg.profiles[job.profile].stage_workloads())
            if ep is None or ep.kind != "builtin" or staged or \
                    first.setdefault(name, job.workload) == job.workload:
                out.append(job)
                continue
            proc, url = builtin.start(ep)
            self.servers.append(proc)
            out.append(replace(job, endpoint=replace(job.endpoint, url=url)))
        return out

    def lanes(self) -> dict[str, list]:
        """Side by side, the jobs of each server in order, as (number, job): an endpoint at
        a URL has one lane, a built-in endpoint one per workload (``own_servers``)."""
        lanes: dict[str, list] = {}
        for k, job in enumerate(self.jobs, 1):
            lanes.setdefault(f"{job.endpoint.name}@{job.endpoint.url}", []).append((k, job))
        return lanes

    def side_by_side(self) -> None:
        """``suite.parallel_endpoints``: each endpoint's jobs in order, the endpoints at once
        (one thread each, each with its own Locust child and its own workload generators).
        An interrupt stops every Locust child; each thread then ends with its job, its
        records kept. The first error any thread met is raised once all have ended."""
        from kvbench.runs import locust
        from kvbench.workloads.registry import make_workload

        lanes = self.lanes()
        stop = threading.Event()
        errors: list[BaseException] = []

        def lane(items: list) -> None:
            wls = {n: make_workload(n, self.cfg) for n in self.sel.workloads}
            try:
                for k, job in items:
                    if stop.is_set():
                        return
                    self.one(k, job, wls, quiet=True)
            except BaseException as exc:  # noqa: BLE001  (re-raised in the main thread)
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=lane, args=(items,),
                                    name=f"kvbench-{name.partition('@')[0]}",
                                    daemon=True) for name, items in lanes.items()]
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(0.2)
        except BaseException:  # an interrupt reaches the main thread: stop every lane's child
            stop.set()
            locust.stop_all()
            for t in threads:
                t.join()
            raise
        if errors:
            raise errors[0]

    # -- after the load
    def stop(self) -> None:
        """The load is over: stop everything it started, so that run.json is written whole."""
        from kvbench.runs import builtin, telemetry

        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        self.noting(lambda notes: telemetry.stop(self.collectors, notes))
        if self.receiver is not None:
            if self.interrupted is None:
                self.receiver.drain()  # the engines' last batch of spans
            got = self.receiver.stop()
            self.telemetry["otlp"] = (f"{got['spans']} request spans" if got["spans"] else
                                      "no request spans received")
        for proc in self.servers:
            builtin.stop(proc)

    def noting(self, step):
        """``step(notes)`` (``runs.telemetry``'s start or stop, which note in a dict what
        they found) with its notes kept in this run's fields; what ``step`` returns."""
        notes = {"telemetry": self.telemetry, "incomplete": [],
                 "clock_offsets_ns": self.clock_offsets_ns}
        out = step(notes)
        self.incomplete.extend(notes["incomplete"])  # Incomplete entries
        return out

    def finish(self) -> RunMeta:
        """run.json written, the run no longer marked running, ``latest`` pointing at it."""
        from kvbench.runs import finalize

        why = f"{self.interrupted} to kvbench run" if self.interrupted else None
        meta = finalize.finalize(
            self.run_dir, self.jobs, workloads=self.workloads, started_ns=self.started_ns,
            telemetry=self.telemetry, incomplete=[i.to_dict() for i in self.incomplete],
            clock_offsets_ns=self.clock_offsets_ns, interrupted=why,
            meta={"cache_states": self.cache_states} if self.jobs else {
                "run_id": self.run_id, "suite": self.cfg.suite.name,
                "config": self.cfg.public_dump()})
        finalize.mark_running(self.run_dir, False)
        if self.remote is None:  # on a store, the upload writes its ``latest`` object
            self.link_latest()
        return meta

    def upload(self) -> bool:
        """An s3:// run: all of it uploaded, its marker last, the spool then removed; whether
        that failed (the spool then stays, for ``kvbench recover``)."""
        import shutil

        if self.uploader is None:
            return False
        try:
            n = self.uploader.finish()
        except OSError as exc:
            self.console.upload_failed(self.remote.url(self.run_id), self.run_dir, exc)
            return True
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.console.uploaded(self.remote.url(self.run_id), n)
        return False

    def link_latest(self) -> None:
        latest = self.results_dir / "latest"
        try:
            if latest.is_symlink() or latest.exists():
                latest.unlink()
            latest.symlink_to(self.run_id)
        except OSError as exc:
            self.console.no_latest(latest, exc)
