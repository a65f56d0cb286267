"""``kvbench run``: the bench.toml matrix (endpoints x workloads x load stages), headless through
Locust, with preflight checks before any load, then results, run.json and a short summary.

The work is ``kvbench.runs``' (matrix, preflight, built-in endpoints, the Locust child per job,
telemetry, finalize); this module parses the arguments and prints progress and the summary.
Locust runs in subprocesses, so gevent never enters this process; the collectors run in its
threads.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path

from kvbench.core.errors import UserError

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


def add_parser(p) -> None:
    p.add_argument("--config", default="bench.toml", help="bench.toml (default: ./bench.toml)")
    p.add_argument("--processes", type=int, default=1,
                   help="Locust load processes per run (each writes its own records shard)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--workers", type=int, default=0, metavar="N",
                   help="distributed on Locust's master and N local worker processes; their "
                        "records reach the run through the master (no shared disk needed)")
    g.add_argument("--expect-workers", type=int, default=0, metavar="N",
                   help="distributed: a Locust master that waits for N workers started "
                        "elsewhere (locust -f \"$(kvbench locustfile job)\" --worker "
                        "--master-host HOST --master-port PORT), once per Locust run")
    p.add_argument("--master-bind-host", default=None, metavar="HOST",
                   help="address the master listens on (default 127.0.0.1 with --workers, "
                        "0.0.0.0 with --expect-workers)")
    p.add_argument("--master-port", type=int, default=0, metavar="PORT",
                   help="the master's port (default: a free one with --workers, 5557 with "
                        "--expect-workers)")
    p.add_argument("--workers-wait", type=float, default=600.0, metavar="S",
                   help="how long the master waits for its workers to connect (default 600)")
    p.add_argument("--results-dir", default=None, help="override suite.results_dir")
    p.add_argument("--run-id", default=None, help="run id (default: time, suite and pid)")
    p.add_argument("--endpoint", action="append", default=None, metavar="NAME",
                   help="run only this endpoint (repeatable)")
    p.add_argument("--workload", action="append", default=None, metavar="NAME",
                   help="run only this workload (repeatable)")
    p.add_argument("--profile", default=None, help="override suite.profile")
    p.add_argument("--duration-scale", type=float, default=1.0,
                   help="multiply every stage duration (0.1 for a quick look)")


def run(args) -> int:
    from kvbench.config import load_config
    from kvbench.config.parse import classes_without_slo
    from kvbench.core import store
    from kvbench import engines
    from kvbench.runs import (builtin, cache, finalize, locust, matrix, preflight, progress,
                              search, telemetry)
    from kvbench.workloads.registry import make_workload

    cfg_path = Path(args.config)
    cfg = load_config(cfg_path)
    if args.processes < 1:
        raise UserError("--processes must be at least 1")
    if args.duration_scale <= 0:
        raise UserError("--duration-scale must be positive, e.g. 0.5")
    dist = distributed(args)
    sel = matrix.select(cfg, endpoints=args.endpoint, workloads=args.workload,
                        profile=args.profile, where=str(cfg_path))
    no_slo = classes_without_slo(cfg, sel.workloads)
    if no_slo:
        print(f"kvbench: warning: no SLO for request class(es) {', '.join(no_slo)} in "
              f"{cfg_path}: reports show their goodput and SLO attainment as \"no SLO\"; add "
              f"[slo.<class>] tables (ttft_ms, tpot_ms, e2e_ms) to judge them", flush=True)
    if dist is not None and not dist.local:
        local_only = [ep.name for ep in sel.endpoints if ep.kind == "builtin"]
        if local_only:
            raise UserError(f"{cfg_path}: endpoint(s) {', '.join(local_only)} are built-in, "
                            "served on this host's loopback where workers elsewhere cannot "
                            "reach them; run them with --workers N, or point [[endpoints]] at "
                            "a server the workers reach (kvbench serve --host 0.0.0.0)")
    searching = [n for n in sel.profiles if cfg.profiles[n].pacing == "search"]
    if dist is not None and searching:
        raise UserError(f"{cfg_path}: profile {searching[0]} is a capacity search, which runs "
                        "its probes from this host alone; drop --workers/--expect-workers or "
                        "pick a fixed-rate profile with --profile")
    results_dir = Path(args.results_dir or cfg.suite.results_dir)
    run_id = args.run_id or store.new_run_id(cfg.suite.name)
    run_dir = results_dir / run_id
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} already holds results; pick another --run-id")

    print(f"kvbench run {run_id}: {len(sel.endpoints)} endpoint(s) x {len(sel.workloads)} "
          f"workload(s) x profile {', '.join(sel.profiles)}", flush=True)
    workloads = {n: make_workload(n, cfg) for n in sel.workloads}
    started_ns = time.time_ns()
    servers = []
    collectors = None
    notes: dict = {"telemetry": {}, "incomplete": [], "clock_offsets_ns": {}}
    jobs = []
    cache_states: list = []  # per job: the cache state it started from (run.json)
    receiver = None
    interrupted: Interrupted | None = None
    previous = {sig: signal.signal(sig, _on_signal) for sig in STOP_SIGNALS}
    try:
        targets = []
        for ep in sel.endpoints:
            if ep.kind == "builtin":
                proc, url = builtin.start(ep)
                servers.append(proc)
            else:
                url = ep.url.rstrip("/")
            targets.append((ep, url))
        checked, adapters = [], {}
        for ep, url in targets:
            c = preflight.check(ep, url, workloads)
            checked.append((ep, url, c.model, c.max_context_tokens))
            adapters[ep.name] = engines.get(c.engine)
        jobs = matrix.jobs(cfg, sel, checked, run_id=run_id, results_dir=results_dir,
                           duration_scale=args.duration_scale)
        run_dir.mkdir(parents=True, exist_ok=True)
        finalize.mark_running(run_dir)  # recovery leaves the run alone while this lives
        collectors = telemetry.start(run_dir, cfg, jobs, notes)
        if cfg.suite.otlp_listen:  # the engines' per-request spans, joined in the report
            from kvbench.runs.otlp import OtlpReceiver

            host, _, port = cfg.suite.otlp_listen.rpartition(":")
            try:
                receiver = OtlpReceiver(run_dir, host.strip("[]"), int(port)).start()
            except OSError as exc:
                raise UserError(f"{cfg_path}: field suite.otlp_listen: cannot listen on "
                                f"{cfg.suite.otlp_listen} ({exc.strerror}); pick a free "
                                "port") from None
            print(f"kvbench run: OTLP/HTTP traces received at {receiver.url}", flush=True)
        total_s = sum(matrix.expected_s(j) for j in jobs)
        print(f"kvbench run: {len(jobs)} Locust run(s), about {total_s:.0f} s of load; records "
              f"in {run_dir}", flush=True)
        def one(k: int, job, wls: dict, quiet: bool = False) -> None:
            label = job.label()
            print(f"[{k}/{len(jobs)}] {label} ...", flush=True)
            t0 = time.monotonic()
            job, state = cache.prepare(job, adapters[job.endpoint.name], job.headers(),
                                       wls.get(job.workload))
            print(f"[{k}/{len(jobs)}] cache: {state['started_from']}", flush=True)
            cache_states.append(state)  # kept when a stop cuts the job
            # quiet unless stdout is a terminal; endpoints run side by side share none
            with (contextlib.nullcontext() if quiet else progress.Progress(job, run_dir)):
                out = (search.run(job, args.processes) if job.pacing == "search" else
                       locust.run(job, args.processes, dist))
            cache.finish(state, job, adapters[job.endpoint.name], job.headers(),
                         wls.get(job.workload))
            print(f"[{k}/{len(jobs)}] {label}: done in {time.monotonic() - t0:.1f} s, "
                  f"{finalize.records_so_far(run_dir)} records so far", flush=True)
            if out.error:
                raise UserError(out.error)
            if out.rc not in (0, 1):  # 1: Locust saw failed requests, which the records hold
                notes["incomplete"].append({"what": label,
                                            "why": f"locust exited with code {out.rc}"})

        if cfg.suite.parallel_endpoints and dist is None and len(sel.endpoints) > 1:
            _side_by_side(jobs, one, lambda: {n: make_workload(n, cfg) for n in sel.workloads},
                          locust)
        else:
            for k, job in enumerate(jobs, 1):
                one(k, job, workloads)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (Interrupted)
        interrupted = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        try:
            print(f"kvbench run: interrupted ({interrupted}); stopping the load and the "
                  "built-in endpoints, writing what was recorded", file=sys.stderr, flush=True)
        except OSError:  # SIGHUP: the terminal may be gone; the cleanup matters more
            pass
    finally:
        for sig in STOP_SIGNALS:  # the load is over: stop everything, write run.json whole
            signal.signal(sig, signal.SIG_IGN)
        telemetry.stop(collectors, notes)
        if receiver is not None:
            if interrupted is None:
                receiver.drain()  # the engines' last batch of spans
            got = receiver.stop()
            notes["telemetry"]["otlp"] = (f"{got['spans']} request spans" if got["spans"] else
                                          "no request spans received")
        for proc in servers:
            builtin.stop(proc)
    try:
        if not run_dir.exists():
            return 128 + interrupted.signum if interrupted else 0
        why = f"{interrupted} to kvbench run" if interrupted else None
        meta = finalize.finalize(
            run_dir, jobs, workloads=workloads, started_ns=started_ns,
            telemetry=notes["telemetry"], incomplete=notes["incomplete"],
            clock_offsets_ns=notes["clock_offsets_ns"], interrupted=why,
            meta={"cache_states": cache_states} if jobs else {
                "run_id": run_id, "suite": cfg.suite.name, "config": cfg.public_dump()})
        finalize.mark_running(run_dir, False)
        _link_latest(results_dir, run_id)
        _summary(run_dir, meta)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + interrupted.signum if interrupted else 0


def _side_by_side(jobs: list, one, build_workloads, locust) -> None:
    """``suite.parallel_endpoints``: each endpoint's jobs in order, the endpoints at once (one
    thread each, each with its own Locust child and its own workload generators). An
    interrupt stops every Locust child; each thread then ends with its job, its records kept.
    The first error any thread met is raised once all have ended."""
    lanes: dict[str, list] = {}
    for k, job in enumerate(jobs, 1):
        lanes.setdefault(job.endpoint.name, []).append((k, job))
    stop = threading.Event()
    errors: list[BaseException] = []

    def lane(items: list) -> None:
        wls = build_workloads()
        try:
            for k, job in items:
                if stop.is_set():
                    return
                one(k, job, wls, quiet=True)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=lane, args=(items,), name=f"kvbench-{name}",
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


def distributed(args):
    """The distributed setting of ``kvbench run``'s flags (None: one host, ``--processes``);
    a bad combination fails before any load."""
    from kvbench.runs.locust import Distributed

    workers = getattr(args, "workers", 0) or 0
    expect = getattr(args, "expect_workers", 0) or 0
    if workers < 0 or expect < 0:
        raise UserError("--workers and --expect-workers take a positive count, e.g. 4")
    if not (workers or expect):
        if args.master_bind_host or args.master_port:
            raise UserError("--master-bind-host and --master-port go with --workers or "
                            "--expect-workers")
        return None
    if args.processes > 1:
        raise UserError("--processes and --workers/--expect-workers both set how many load "
                        "processes run; give one of them")
    if not 0 <= args.master_port <= 65535:
        raise UserError(f"--master-port {args.master_port}: give a TCP port, 1 to 65535")
    if args.workers_wait <= 0:
        raise UserError("--workers-wait must be positive, e.g. 600")
    if workers:
        return Distributed(workers, local=True, bind_host=args.master_bind_host or "127.0.0.1",
                           port=args.master_port, wait_s=args.workers_wait)
    return Distributed(expect, local=False, bind_host=args.master_bind_host or "0.0.0.0",
                       port=args.master_port or 5557, wait_s=args.workers_wait)


def _link_latest(results_dir: Path, run_id: str) -> None:
    latest = results_dir / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(run_id)
    except OSError as exc:
        print(f"kvbench run: could not update {latest} ({exc})", file=sys.stderr)


def _summary(run_dir: Path, meta) -> None:
    """A few numbers per endpoint, computed with the reports' metric definitions; requests a
    stop cut (``cancelled``) are counted apart from errors."""
    from kvbench.core.store import load_results
    from kvbench.reports import metrics as M

    counts = meta.counts
    if meta.interrupted:
        print(f"kvbench run: INTERRUPTED ({meta.interruption}); the results hold what was "
              "recorded until then")
    for name, acct in (meta.workers or {}).items():
        if acct.get("lost"):
            print(f"kvbench run: LOST WORKER {name} ({acct.get('lost_why')}): "
                  f"{acct.get('missing', 0)} of its requests missing, {acct.get('records', 0)} "
                  "of its records reached the master")
    res = load_results(run_dir)
    if res.requests.num_rows == 0:
        print(f"kvbench run: no requests recorded; results in {run_dir}")
        return
    slo = (res.meta.config or {}).get("slo") or {}
    frame = M.request_frame(res.requests, stages=res.meta.stages or (), slo=slo)
    print(f"{'endpoint':<16} {'requests':>8} {'ok':>6} {'errors':>6} {'cancelled':>9} "
          f"{'TTFT p50 ms':>12} {'TPOT p50 ms':>12}")
    total_cancelled = 0
    for ep in frame["endpoint"].cat.categories:
        sub = frame[frame["endpoint"] == ep]
        o = M.outcomes(sub)  # cancelled at the stop: neither ok nor an error
        total_cancelled += o["cancelled"]
        print(f"{ep:<16} {o['requests']:>8} {o['ok']:>6} {o['errors']:>6} {o['cancelled']:>9} "
              f"{M.statistic(sub, 'ttft_p50'):>12.1f} {M.statistic(sub, 'tpot_p50'):>12.1f}")
    print(f"kvbench run: {counts['records_written']} records of {counts['requests_started']} "
          f"requests started, {total_cancelled} cancelled at the stop (not errors), "
          f"{counts['dropped_at_cap']} dropped at the in-flight cap; results in {run_dir}")
    _overloaded(frame)
    _capacity(frame, res.meta)
    print(f"next: kvbench report {run_dir} -o report.html")


def _overloaded(frame) -> None:
    """One line per stage the endpoint could not keep up with (the reports' verdict:
    achieved throughput and first tokens/s both clearly below the offered rate)."""
    from kvbench.reports import overload

    rates = overload.rates(frame)
    for _, r in rates[rates["overloaded"].fillna(False).astype(bool)].iterrows():
        print(f"kvbench run: OVERLOADED: {r['endpoint']} x {r['workload']} stage {r['stage']}: "
              f"offered {r['offered_rps']:.2f} req/s, achieved {r['throughput_rps']:.2f} req/s "
              f"(first tokens {r['started_rps']:.2f}/s); the report's diagnosis says why")


def _capacity(frame, meta) -> None:
    """A capacity search's result per endpoint: the rate at SLO, its bracket, what broke."""
    from kvbench.reports import capacity

    caps = capacity.summarise(meta.stages or [], frame, (meta.config or {}).get("slo") or {})
    gpus = {e.get("name"): e for e in meta.endpoints or []}
    for c in caps:
        u = c.unit
        if c.capacity_rps is None:
            cap = "below the start"
        elif c.fail_rps is None:
            cap = f">= {c.capacity_rps:g} {u} (passed {c.capacity_rps:g}, nothing failed)"
        else:
            cap = f"{c.estimate_rps:.3g} {u}"
        got = (c.at_capacity or {}).get("achieved_rps")
        if u == "users" and got is not None and got == got:
            cap += f" ({got:.3g} req/s answered at {c.capacity_rps:g} users)"
        fail = (f" (passed {c.capacity_rps:g}, failed {c.fail_rps:g})"
                if c.fail_rps is not None and c.capacity_rps is not None else
                f", fails at {c.fail_rps:g}" if c.fail_rps is not None else "")
        br = c.breaks or {}
        why = (f"; {br['class']} breaks first ({br['missed']})" if br.get("class") else "")
        ep = gpus.get(c.endpoint) or {}
        per = capacity.per_gpu_and_cost(c, ep.get("gpus"), ep.get("gpu_hour_cost"))
        pg = (f", {per['capacity_per_gpu']:.2f} {u} per GPU"
              if per["capacity_per_gpu"] is not None else "")
        thin = (c.at_capacity or {}).get("thin")
        print(f"kvbench run: CAPACITY at SLO: {c.endpoint} x {c.workload}: {cap}{fail}{pg} "
              f"({c.probes} probes, {c.load_s:.0f} s of load, {c.status}){why}"
              + (f"; thin evidence there: {thin}" if thin else ""))
