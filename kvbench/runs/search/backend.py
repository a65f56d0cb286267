"""Where a real search sends its probes (``LocustBackend``): one Locust child for the whole
search, fed through the control file; a probe's requests are read back from the run
directory's record shards and start sidecars (pyarrow imported where they are read: the
load process imports this package for its feed). ``bench/search_sim.py`` gives the driver another
backend with the same methods (the emulator in virtual time)."""

from __future__ import annotations

import os
import subprocess
import time

from kvbench.runs import lifeline
from kvbench.runs.search.control import Control, control_path, write_control


class LocustBackend:
    def __init__(self, job, processes: int = 1) -> None:
        from kvbench.core import store
        from kvbench.runs import locust

        self.job, self.slo = job, job.slo
        self.run_dir = job.run_dir
        self.ctl = control_path(self.run_dir, job.endpoint.name, job.workload)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        job_file = job.save(self.run_dir / job.file_name())
        self.cmd, _ = locust.command(job, job_file, processes)
        self.log_path = self.run_dir / f"locust-{job_file.stem.removeprefix('job-')}.log"
        self.child = None
        self._logf = None
        # each poll parses only what was written since the last
        self.requests = store.ShardTail(self.run_dir, "requests", _record_columns())
        self.starts = store.ShardTail(self.run_dir, "starts")

    def publish(self, control: Control) -> None:
        write_control(self.ctl, control)

    def launch(self) -> None:
        from kvbench.runs import locust

        env = {**os.environ, **self.job.secret_env(), **lifeline.child_env()}
        self._logf = open(self.log_path, "w")
        self.child = locust.track(subprocess.Popen(
            self.cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=env,
            start_new_session=True))

    def alive(self) -> bool:
        return self.child.poll() is None

    def started(self, index: int, wait_s: float = 120.0) -> float | None:
        """The monotonic time probe ``index`` began (its stage opened in a sidecar)."""
        from kvbench.core import store

        key = (self.job.endpoint.name, self.job.workload)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.child.poll() is not None:
                return None
            for m in store.read_proc_meta(self.run_dir):
                # this job's stage: side by side, another workload's lane on the same
                # endpoint runs a stage of the same index in a sidecar of its own
                mine = [s for s in ([m.open_stage] if m.open_stage is not None else [])
                        + list(m.stages)
                        if s.index == index and (s.endpoint, s.workload) == key]
                if mine:
                    t_start = mine[0].t_start_ns or time.time_ns()
                    ago = (time.time_ns() - int(t_start)) / 1e9
                    return time.monotonic() - max(0.0, ago)
            time.sleep(0.05)
        return None

    def frames(self, index: int):
        return _frames(self.job, index, self.slo, self.requests, self.starts)

    def e2e_mean_s(self, index: int) -> float | None:
        """The mean response time of probe ``index``'s answered requests."""
        import pyarrow.compute as pc

        from kvbench.core import store

        t = store.read_table(self.run_dir, "requests", ["endpoint", "workload", "stage",
                                                        "status", "e2e_ns"], parquet=False)
        m = pc.and_(pc.and_(pc.equal(t.column("endpoint"), self.job.endpoint.name),
                            pc.equal(t.column("workload"), self.job.workload)),
                    pc.and_(pc.equal(t.column("stage"), index),
                            pc.equal(t.column("status"), "ok")))
        v = pc.mean(t.filter(m).column("e2e_ns")).as_py()
        return v / 1e9 if v else None

    now = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)

    def abort(self) -> None:
        from kvbench.runs import locust

        locust.stop(self.child)

    def close(self) -> tuple[int, str | None]:
        from kvbench.runs import locust

        try:
            rc = self.child.wait(max(60.0, self.job.drain_s + 30.0))
        except subprocess.TimeoutExpired:
            rc = locust.stop(self.child)
        finally:
            locust.untrack(self.child)
            self._logf.close()
            locust._scrub(self.log_path)
        return rc, locust._error(self.log_path, rc, self.job)


def _record_columns() -> list[str]:
    """The record columns a probe's verdict reads."""
    from kvbench.reports.measures.frame import FRAME_COLUMNS

    return sorted(set(FRAME_COLUMNS) | {"chunk_offsets_ns", "request_id", "worker"})


def _frames(job, index: int, slo: dict, requests, starts):
    """(finished records, still-running starts, load) of probe ``index``: request frames of
    the records and of the starts not yet recorded (as cancelled), and the load's figures
    (lateness, sends, the pending requests' ages, sends and finishes for ``not_steady``), from
    the run's "requests" and "starts" tails."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvbench.core.schema import TABLES
    from kvbench.reports.measures.frame import request_frame

    def mine(t):
        m = pc.and_(pc.and_(pc.equal(t.column("endpoint"), job.endpoint.name),
                            pc.equal(t.column("workload"), job.workload)),
                    pc.equal(t.column("stage"), index))
        return t.filter(m)

    recs, starts = mine(requests.read()), mine(starts.read())
    done_ids = set(zip(recs.column("worker").to_pylist(), recs.column("request_id").to_pylist()))
    keep = [(w, r) not in done_ids for w, r in zip(starts.column("worker").to_pylist(),
                                                   starts.column("request_id").to_pylist())]
    pend = starts.filter(pa.array(keep, pa.bool_())) if len(keep) else starts
    done = request_frame(recs, slo=slo) if recs.num_rows else None
    pending = None
    if pend.num_rows:
        n = pend.num_rows
        cols_p = {c: pend.column(c) for c in pend.column_names}
        full = {f.name: cols_p.get(f.name, pa.nulls(n, f.type)) for f in TABLES["requests"]}
        full["status"] = pa.array(["cancelled"] * n)
        table = pa.table(full)
        pending = request_frame(table.select(
            [c for c in _record_columns() if c in table.column_names]), slo=slo)
    sent = starts.column("t_sent").to_numpy(zero_copy_only=False).astype(np.int64)
    sched = starts.column("t_scheduled").to_numpy(zero_copy_only=False).astype(np.int64)
    recent = sent >= (sent.max() - 1_000_000_000) if len(sent) else sent.astype(bool)
    lateness = float(np.median(sent[recent] - sched[recent]) / 1e6) if recent.any() else None
    ages = ((time.time_ns() - pend.column("t_sent").to_numpy(zero_copy_only=False)
             .astype(np.int64)) / 1e9) if pend.num_rows else np.empty(0)
    load = {"lateness_ms": lateness, "sent": len(sent),
            "first_ns": int(sched.min()) if len(sched) else None, "pending_ages_s": ages}
    if len(sched):  # sends and finishes, seconds from the first arrival (not_steady)
        base = int(sched.min())
        r_sent = recs.column("t_sent").to_numpy(zero_copy_only=False).astype(np.float64)
        r_e2e = recs.column("e2e_ns").to_numpy(zero_copy_only=False).astype(np.float64)
        # a request that ended without an answer's length (an error) left at its send
        fin = r_sent + np.where(np.isnan(r_e2e), 0.0, r_e2e)
        load.update(sent_s=(sent - base) / 1e9,
                    done_s=np.concatenate([(fin - base) / 1e9, np.full(pend.num_rows, np.nan)]),
                    now_s=(time.time_ns() - base) / 1e9)
    return done, pending, load
