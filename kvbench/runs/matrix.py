"""The run matrix: which endpoints, workloads and profiles of the config a ``kvbench run`` drives
(its command-line selection checked against the config), and the resolved jobs, one per
endpoint x workload x profile (x stage for closed loop, each stage its own Locust run)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbench.core.errors import UserError
from kvbench.runs.job import Job, resolve


@dataclass(frozen=True)
class Selection:
    endpoints: list  # config endpoint specs
    workloads: list[str]
    profiles: list[str]


def select(cfg, *, endpoints=None, workloads=None, profile=None,
           where: str = "the config") -> Selection:
    """The config's endpoints, workloads and profiles narrowed to the names asked for."""
    eps = _select(cfg.endpoints, endpoints, "endpoint", lambda e: e.name)
    wl_names = list(workloads or cfg.suite.workloads or default_workloads(cfg))
    for w in wl_names:
        if w not in cfg.workloads:
            raise UserError(f"--workload {w}: not a [workloads.*] table of {where}; use one "
                            f"of {sorted(cfg.workloads)}")
    profs = ([profile] if profile else
             [cfg.suite.profile] if cfg.suite.profile else sorted(cfg.profiles))
    for pn in profs:
        if pn not in cfg.profiles:
            raise UserError(f"--profile {pn}: not a [profiles.*] table of {where}; use one "
                            f"of {sorted(cfg.profiles)}")
    staged = [w for pn in profs for w in cfg.profiles[pn].stage_workloads()]
    if staged:  # a designed profile: its stages' workloads are what runs
        wl_names = list(dict.fromkeys(staged + ([] if len(profs) == 1 else wl_names)))
    return Selection(eps, wl_names, profs)


def _select(items, names, what, key):
    if not names:
        return list(items)
    known = {key(i): i for i in items}
    for n in names:
        if n not in known:
            raise UserError(f"--{what} {n}: not in the config; use one of {sorted(known)}")
    return [known[n] for n in names]


def default_workloads(cfg) -> list[str]:
    """Every workload but the parts of a mix."""
    parts = {p for s in cfg.workloads.values() for p in s.parts()}
    return [n for n in cfg.workloads if n not in parts]


def jobs(cfg, sel: Selection, targets: list[tuple], *, run_id: str, results_dir,
         duration_scale: float = 1.0) -> list[Job]:
    """The jobs of the matrix; ``targets``: (endpoint spec, url, model, max context tokens)
    per endpoint as preflight found them."""
    out = []
    for ep, url, model, ctx in targets:
        for pn in sel.profiles:  # a profile whose stages name workloads runs once, in order
            staged = cfg.profiles[pn].stage_workloads()
            for i, w in enumerate(staged):
                job = resolve(cfg, workload=w, endpoint=ep.name, url=url, topology=ep.topology,
                              model=model, max_context_tokens=ctx, profile=pn,
                              duration_scale=duration_scale, run_id=run_id,
                              results_dir=results_dir)
                out.append(replace(job, stage_index=i))
        for w in sel.workloads:
            for pn in sel.profiles:
                if cfg.profiles[pn].stage_workloads():
                    continue
                job = resolve(cfg, workload=w, endpoint=ep.name, url=url, topology=ep.topology,
                              model=model, max_context_tokens=ctx, profile=pn,
                              duration_scale=duration_scale, run_id=run_id,
                              results_dir=results_dir)
                if job.pacing == "closed":
                    out += [replace(job, stage_index=i) for i in range(len(job.stages))]
                else:
                    out.append(job)
    return out


def expected_s(job: Job) -> float:
    """Seconds of load the job is planned for."""
    if job.pacing == "closed":
        return job.stages[job.stage_index].duration_s
    return sum(s.duration_s for s in job.stages)
