"""``kvbench run``: the bench.toml matrix (endpoints x workloads x load stages), headless through
Locust, with preflight checks before any load, then results, run.json and a short summary.

The work is ``kvbench.runs.orchestrate``'s; this module parses the arguments and prints: every
line ``kvbench run`` writes is ``Console``'s (progress, as the run calls it, and the summary).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvbench.core.errors import UserError
from kvbench.core.objstore import MARKER


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
    p.add_argument("--results-dir", default=None,
                   help="override suite.results_dir: a local folder, or s3://BUCKET/PREFIX "
                        "(spooled locally, uploaded as it completes; [storage] in bench.toml "
                        "or AWS_ENDPOINT_URL for MinIO/Ceph/R2)")
    p.add_argument("--run-id", default=None, help="run id (default: time, suite and pid)")
    p.add_argument("--endpoint", action="append", default=None, metavar="NAME",
                   help="run only this endpoint (repeatable)")
    p.add_argument("--workload", action="append", default=None, metavar="NAME",
                   help="run only this workload (repeatable)")
    p.add_argument("--profile", default=None, help="override suite.profile")
    p.add_argument("--duration-scale", type=float, default=1.0,
                   help="multiply every stage duration (0.1 for a quick look)")


def run(args) -> int:
    from kvbench.runs.orchestrate import MatrixRun, RunOptions

    check_places(args)
    opts = RunOptions(config=Path(args.config), processes=args.processes,
                      dist=distributed(args), results_dir=args.results_dir, run_id=args.run_id,
                      endpoints=args.endpoint, workloads=args.workload, profile=args.profile,
                      duration_scale=args.duration_scale)
    return MatrixRun(opts, Console()).run()


def check_places(args) -> None:
    """``--run-id`` names one plain folder of the results folder and ``--results-dir`` is a
    local path or an s3:// URL: refused before anything is read or written."""
    from kvbench.core.paths import results_dir_problem, run_id_problem

    if args.run_id is not None:
        why = run_id_problem(args.run_id)
        if why:
            raise UserError(f"--run-id {why}.")
    if args.results_dir is not None:
        why = results_dir_problem(args.results_dir, remote_ok=True)
        if why:
            raise UserError(f"--results-dir {why}.")


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


class Console:
    """What ``kvbench run`` says, in the order the run calls it."""

    @staticmethod
    def say(line: str, err: bool = False) -> None:
        # whole lines, each naming its lane when endpoints run side by side
        from kvbench.runs.search.console import emit

        emit(line, sys.stderr if err else sys.stdout)

    def no_slo(self, classes: list[str], cfg_path) -> None:
        self.say(f"kvbench: warning: no SLO for request class(es) {', '.join(classes)} in "
                 f"{cfg_path}: reports show their goodput and SLO attainment as \"no SLO\"; "
                 "add [slo.<class>] tables (ttft_ms, tpot_ms, e2e_ms) to judge them")

    def begin(self, run_id: str, sel) -> None:
        self.say(f"kvbench run {run_id}: {len(sel.endpoints)} endpoint(s) x "
                 f"{len(sel.workloads)} workload(s) x profile {', '.join(sel.profiles)}")

    def otlp(self, url: str) -> None:
        self.say(f"kvbench run: OTLP/HTTP traces received at {url}")

    def planned(self, jobs: list, total_s: float, run_dir: Path) -> None:
        self.say(f"kvbench run: {len(jobs)} Locust run(s), about {total_s:.0f} s of load; "
                 f"records in {run_dir}")

    def job_begins(self, k: int, n: int, label: str) -> None:
        self.say(f"[{k}/{n}] {label} ...")

    def job_cache(self, k: int, n: int, started_from: str) -> None:
        self.say(f"[{k}/{n}] cache: {started_from}")

    def job_done(self, k: int, n: int, label: str, took_s: float, records: int) -> None:
        self.say(f"[{k}/{n}] {label}: done in {took_s:.1f} s, {records} records so far")

    def interrupted(self, why) -> None:
        try:
            self.say(f"kvbench run: interrupted ({why}); stopping the load and the built-in "
                     "endpoints, writing what was recorded", err=True)
        except OSError:  # SIGHUP: the terminal may be gone; the cleanup matters more
            pass

    def incomplete(self, reasons: list[str], code: int) -> None:
        """The run's last line: why its load is not whole, and the exit code that says so."""
        sys.stdout.flush()  # after the summary, in a log that holds both streams
        print(f"kvbench run: INCOMPLETE (exit {code}): {'; '.join(reasons)}; the results hold "
              "what was recorded, and run.json's incomplete says the same", file=sys.stderr)

    def no_latest(self, latest: Path, exc: OSError) -> None:
        print(f"kvbench run: could not update {latest} ({exc})", file=sys.stderr)

    def uploaded(self, url: str, files: int) -> None:
        self.say(f"kvbench run: uploaded {files} file(s) to {url} (its {MARKER} marker last); "
                 "the local spool removed")

    def upload_failed(self, url: str, spool: Path, exc: OSError) -> None:
        print(f"kvbench run: could not upload the run to {url} "
              f"({str(exc).splitlines()[0][:200]}); it stays in {spool}: run kvbench recover "
              f"{url} to upload it", file=sys.stderr)

    def summary(self, run_dir: Path, meta, shown: str | None = None) -> None:
        """A few numbers per endpoint, computed with the reports' metric definitions;
        requests a stop cut (``cancelled``) are counted apart from errors. ``shown``: where
        the results go, when not ``run_dir`` (an s3:// URL)."""
        from kvbench.core.store import load_results
        from kvbench.reports.statistics import metrics as M

        counts = meta.counts
        if meta.interrupted:
            print(f"kvbench run: INTERRUPTED ({meta.interruption}); the results hold what was "
                  "recorded until then")
        for name, acct in (meta.workers or {}).items():
            if acct.get("lost"):
                print(f"kvbench run: LOST WORKER {name} ({acct.get('lost_why')}): "
                      f"{acct.get('missing', 0)} of its requests missing, "
                      f"{acct.get('records', 0)} of its records reached the master")
        res = load_results(run_dir)
        if res.requests.num_rows == 0:
            print(f"kvbench run: no requests recorded; results in {shown or run_dir}")
            return
        frame = M.request_frame(res.requests, stages=res.meta.stages or (), slo=res.meta.slo)
        print(f"{'endpoint':<16} {'requests':>8} {'ok':>6} {'errors':>6} {'cancelled':>9} "
              f"{'TTFT p50 ms':>12} {'TPOT p50 ms':>12}")
        total_cancelled = 0
        for ep in frame["endpoint"].cat.categories:
            sub = frame[frame["endpoint"] == ep]
            o = M.outcomes(sub)  # cancelled at the stop: neither ok nor an error
            total_cancelled += o["cancelled"]
            print(f"{ep:<16} {o['requests']:>8} {o['ok']:>6} {o['errors']:>6} "
                  f"{o['cancelled']:>9} {M.statistic(sub, 'ttft_p50'):>12.1f} "
                  f"{M.statistic(sub, 'tpot_p50'):>12.1f}")
        print(f"kvbench run: {counts['records_written']} records of "
              f"{counts['requests_started']} requests started, {total_cancelled} cancelled at "
              f"the stop (not errors), {counts['dropped_at_cap']} dropped at the in-flight cap; "
              f"results in {shown or run_dir}")
        self.overloaded(frame, res.meta.stages or [])
        self.capacity(frame, res.meta)
        print(f"next: kvbench report {shown or run_dir} -o report.html")

    @staticmethod
    def overloaded(frame, stages=()) -> None:
        """One line per stage the endpoint could not keep up with (the reports' verdict:
        achieved throughput and first tokens/s both clearly below the offered rate), but a
        capacity search's probes above its capacity (``diagnose.search``: how it found it)."""
        from kvbench.reports.analysis import overload
        from kvbench.reports.analysis.diagnose.search import exempt, keep_mask
        from kvbench.reports.analysis.numbering import label_of, labels

        rates = overload.rates(frame[keep_mask(frame, exempt(stages))])
        names = labels(stages)
        for _, r in rates[rates["overloaded"].fillna(False).astype(bool)].iterrows():
            print(f"kvbench run: OVERLOADED: {r['endpoint']} x {r['workload']} "
                  f"{label_of(names, r['endpoint'], r['workload'], r['stage'])}: offered {r['offered_rps']:.2f} req/s, achieved "
                  f"{r['throughput_rps']:.2f} req/s (first tokens {r['started_rps']:.2f}/s); "
                  "the report's diagnosis says why")

    @staticmethod
    def capacity(frame, meta) -> None:
        """A capacity search's result per endpoint x workload: the capacity at SLO as the
        report words it (``reports.capacity.capacity_text``), its bracket, what broke."""
        from kvbench.reports.analysis import capacity as C
        from kvbench.reports.rendering.render import fmt

        for c in C.summarise(meta.stages or [], frame, meta.slo):
            u = c.unit
            num = (lambda x: fmt(x, "count")) if u == "users" else fmt
            fail = (f" (passed {num(c.capacity_rps)}, failed {num(c.fail_rps)})"
                    if c.fail_rps is not None and c.capacity_rps is not None else
                    f", fails at {num(c.fail_rps)}" if c.fail_rps is not None else "")
            br = c.breaks or {}
            why = f"; {br['class']} breaks first ({br['missed']})" if br else ""
            ep = meta.endpoint(c.endpoint)
            per = C.per_gpu_and_cost(c, ep and ep.gpus, ep and ep.gpu_hour_cost)
            pg = (f", {per['capacity_per_gpu']:.2f} {u} per GPU"
                  if per["capacity_per_gpu"] is not None else "")
            thin = (c.at_capacity or {}).get("thin")
            print(f"kvbench run: CAPACITY at SLO: {c.endpoint} x {c.workload}: "
                  f"{C.capacity_text(c, fmt, unit=True)}{fail}{pg} ({c.probes} probes, "
                  f"{c.load_s:.0f} s of load, {c.status}){why}"
                  + (f"; thin evidence there: {thin}" if thin else ""))
