"""``kvbench predict``: what a built-in endpoint (a twin ``kvbench calibrate`` fitted, or any
``[[endpoints]]`` table of kind "builtin") would do under a workload, computed in virtual time
on its engine model (``kvbench.runs.virtual``), no load sent.

Per endpoint: the steady-state capacity at SLO (bisected as ``bench/bakeoff_sim.py --precise``
does, the same numbers for the same settings and seed), per GPU and per request class, and
latency (TTFT/TPOT p50/p99 per class) at a few offered rates up to past the capacity.

What-ifs: ``topology`` other than the endpoint's runs its options as that topology on the same
GPUs (disaggregated: split into prefill and decode GPUs; offloaded: the same replicas with a
DRAM/disk tier; routed: the replicas behind a router). Parameters the measured topology cannot
show (the P/D link, the tiers, the router) come from ``options`` or the emulator's defaults;
every option not fitted is listed as assumed, with its value and where it came from.

``save`` writes a prediction into a run folder (``prediction.json``): the file lives with the
run, so the report shows prediction beside measurement wherever both exist, with nothing to
pass it (``reports.analysis.diagnose.twin`` reads it).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from kvbench.core.errors import UserError
from kvbench.endpoints.config import EmulatorConfig, gpu_count, validate_options
from kvbench.model import topologies
from kvbench.runs import virtual

PREDICTION = ("every figure is a prediction of the built-in engine model in virtual time "
              "(kvbench.runs.virtual), not a measurement; no load was sent")

# What each trait of a topology adds that a topology without it never exercises, so a run of
# the one cannot fit it for the other: the options a what-if of that trait assumes.
UNOBSERVED = {
    "splits_prefill_decode": ("link", "rdma_gb_s", "tcp_gb_s", "pd_setup_ms",
                              "pd_us_per_block_layer"),
    "offloads_kv": ("offload", "dram_bytes", "disk_bytes", "dram_gb_s", "disk_gb_s",
                    "lmcache_chunk_tokens", "tier_us_per_load_unit", "offload_step_overhead",
                    "offload_request_overhead_ms"),
    "routes": ("router", "regions", "replicas_per_region", "cross_region_rtt_ms",
               "region_names"),
}
LAYOUT = ("replicas", "prefill_gpus", "decode_gpus", "regions", "replicas_per_region")


@dataclass
class Settings:
    """What to predict and how finely. Defaults keep the default config within a minute:
    one seed, 120 s judged per rate after 20 s, bisected to 5%."""

    workload: str | None = None  # None: the suite's first workload, else mix, else the first
    topology: str | None = None  # a what-if; None: each endpoint's own
    options: dict = field(default_factory=dict)  # over each endpoint's options
    endpoint: str | None = None  # only this built-in endpoint
    seed: int = 1
    seeds: int = 1
    seconds: float = 120.0
    warmup_s: float = 20.0
    target: float = 0.95
    precision: float = 0.05
    step: float = 1.25
    guess: float | None = None  # start rate; None: a coarse grid's estimate
    grid: tuple[float, ...] = (2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0)
    grid_s: float = 120.0
    loads: tuple[float, ...] = (0.5, 0.8, 1.0, 1.25)  # latency points, fractions of capacity
    warm: bool | None = None  # prime shared prefixes; None: the config's suite.cache is "warm"


def _fail(where: str, err: ValidationError) -> UserError:
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"]) or "options"
    msg = e["msg"].removeprefix("Value error, ")
    fix = ("remove it or check its spelling (kvbench serve --help lists the options)"
           if e["type"] == "extra_forbidden" else "fix that value")
    return UserError(f"{where}: option {loc}: {msg}; {fix}.")


def what_if(source: str, options: dict, target: str, given: dict) -> tuple[dict, str]:
    """``options`` of a ``source`` endpoint run as ``target`` on the same GPUs, ``given``
    (the user's options) winning over the layout chosen here; and how the GPUs were laid."""
    n = gpu_count(validate_options(source, options))[0]
    out = {k: v for k, v in options.items() if k not in LAYOUT}
    if target == "disaggregated":
        p = given.get("prefill_gpus", max(1, n // 2))
        out.update(prefill_gpus=p, decode_gpus=given.get("decode_gpus", max(1, n - p)))
    elif target == "routed":
        regions = given.get("regions", 1)
        out.update(regions=regions,
                   replicas_per_region=given.get("replicas_per_region", max(1, n // regions)))
    else:
        out["replicas"] = given.get("replicas", n)
    out.update(given)
    m = gpu_count(validate_options(target, out))
    how = f"the {n} GPU{'s' * (n != 1)} of {source} as {target}: {m[1]}"
    if m[0] != n:
        how += f" ({m[0]} GPUs: {target} needs at least that many)"
    return out, how


def unobserved(source: str, target: str) -> set[str]:
    """Options ``target`` uses that a run of ``source`` never exercises."""
    src, dst = topologies.get(source), topologies.get(target)
    return {o for trait, opts in UNOBSERVED.items()
            if getattr(dst, trait) and not getattr(src, trait) for o in opts}


def parameters(cfg: EmulatorConfig, fit, from_config: dict, from_user: dict,
               from_what_if: dict, hidden: set[str]) -> tuple[list[dict], list[dict]]:
    """The endpoint's options split into fitted (in the twin's ``fitted``) and assumed (every
    other option: its value and where it came from), each marked when the measured topology
    cannot show it."""
    fitted_names = set(fit.fitted) if fit is not None else set()
    fitted, assumed = [], []
    for name in EmulatorConfig.model_fields:
        if name == "topology":
            continue
        value = getattr(cfg, name)
        value = value.model_dump() if hasattr(value, "model_dump") else value
        if name in fitted_names:
            f = fit.fit.get(name)
            fitted.append({"option": name, "value": value,
                           "stderr": f.stderr if f else None,
                           "status": f.status if f else "fit"})
            continue
        source = ("--options" if name in from_user else "what-if layout" if name in from_what_if
                  else "given" if name in from_config else "default")
        assumed.append({"option": name, "value": value, "source": source,
                        "unobserved": name in hidden})
    for name in sorted(fitted_names - set(EmulatorConfig.model_fields)):
        f = fit.fit.get(name)  # a combination the fit could separate no further
        fitted.append({"option": name, "value": f.value if f else None,
                       "stderr": f.stderr if f else None,
                       "status": f.status if f else "fit", "engine_option": False})
    return fitted, assumed


def _twin_of(cfg, name: str):
    t = cfg.twin
    if t is None or (t.endpoint is not None and t.endpoint != name):
        return None
    return t


def endpoints(cfg, path, settings: Settings) -> list:
    """The built-in endpoints to predict; an error naming the file when there is none."""
    eps = list(cfg.endpoints)
    if settings.endpoint is not None:
        try:
            eps = [cfg.endpoint(settings.endpoint)]
        except KeyError:
            raise UserError(f"--endpoint {settings.endpoint}: no [[endpoints]] table of that "
                            f"name in {path}; use one of "
                            f"{[e.name for e in cfg.endpoints]}") from None
    out = [ep for ep in eps if ep.kind == "builtin"]
    if not out:
        ep = eps[0]
        raise UserError(f"{path}: endpoints[{cfg.endpoints.index(ep)}] ({ep.name!r}) is of kind "
                        f"{ep.kind!r}, and predict models built-in endpoints only; fit it with "
                        "kvbench calibrate RUN_DIR --endpoint NAME -o twin.toml and predict on "
                        "twin.toml (an [[endpoints]] table of kind \"builtin\")")
    return out


def plan(cfg, path, settings: Settings) -> list[dict]:
    """Per endpoint to predict: its topology, options and parameters, checked before any
    simulation (a bad topology or option fails here)."""
    if settings.topology is not None and settings.topology not in topologies.names():
        raise UserError(f"--topology {settings.topology}: not a topology; use one of "
                        f"{', '.join(topologies.names())}")
    out = []
    for ep in endpoints(cfg, path, settings):
        i = cfg.endpoints.index(ep)
        mine = dict(ep.options or {})
        opts = {**mine, **settings.options}
        topo = settings.topology or ep.topology
        try:
            validate_options(ep.topology, opts)
        except ValidationError as err:
            raise _fail(f"--options over endpoints[{i}].options of {path}", err) from None
        laid = {}
        how = None
        if topo != ep.topology:
            try:
                wopts, how = what_if(ep.topology, opts, topo, settings.options)
            except ValidationError as err:
                raise _fail(f"--topology {topo} of endpoints[{i}] ({ep.name}) in {path}",
                            err) from None
            laid = {k: v for k, v in wopts.items() if k not in opts or opts[k] != v}
            opts = wopts
        ecfg = validate_options(topo, opts)
        gpus, gpus_how = gpu_count(ecfg)
        fitted, assumed = parameters(ecfg, _twin_of(cfg, ep.name), mine, settings.options,
                                     laid, unobserved(ep.topology, topo))
        out.append({"endpoint": ep.name, "measured_topology": ep.topology, "topology": topo,
                    "what_if": topo != ep.topology, "what_if_layout": how, "options": opts,
                    "gpus": gpus, "gpus_how": gpus_how, "fitted": fitted, "assumed": assumed,
                    "twin": _twin_of(cfg, ep.name) is not None})
    return out


def _classes(cap: float, at_cap: dict | None, tried: list[dict], slo: dict,
             target: float) -> dict:
    """Per class: its share of the requests and of the capacity's rate, its attainment at
    the capacity, and the rates tried around where it alone breaks its SLO."""
    out = {}
    if at_cap is None:
        return out
    total = sum(x["n"] for x in at_cap["classes"].values()) or 1
    for cls, x in sorted(at_cap["classes"].items()):
        share = x["n"] / total
        passed = [p["rate"] for p in tried if cls in p["classes"]
                  and p["classes"][cls]["att"] >= target]
        failed = [p["rate"] for p in tried if cls in p["classes"]
                  and p["classes"][cls]["att"] < target]
        hi = min(failed) if failed else None
        lo = max([r for r in passed if hi is None or r < hi], default=None)
        out[cls] = {"share": share, "rate_at_capacity": cap * share,
                    "attainment_at_capacity": x["att"], "has_slo": cls in slo,
                    "slo": slo.get(cls, {}),
                    "own_limit": {"passes_at": lo, "fails_at": hi}}
    return out


def default_workload(cfg) -> str:
    """The suite's first workload, else ``mix`` where configured, else the first table."""
    if cfg.suite.workloads:
        return cfg.suite.workloads[0]
    return "mix" if "mix" in cfg.workloads else next(iter(cfg.workloads))


def predict(cfg, path, settings: Settings, say=lambda line: None) -> dict:
    """The whole prediction (see the module's docstring) as one JSON-ready dict."""
    t0 = time.monotonic()
    cpu0 = time.process_time()
    todo = plan(cfg, path, settings)
    name = settings.workload or default_workload(cfg)
    if name not in cfg.workloads:
        raise UserError(f"--workload {name}: not a [workloads.*] table of {path}; "
                        f"use one of {sorted(cfg.workloads)}")
    warm = settings.warm if settings.warm is not None else cfg.suite.cache == "warm"
    work = virtual.load_workload(cfg, name, warm)
    steady = virtual.Steady(work, warmup_s=settings.warmup_s, seconds=settings.seconds,
                            target=settings.target, precision=settings.precision,
                            step=settings.step, grid_s=settings.grid_s)
    seeds = list(range(settings.seed, settings.seed + settings.seeds))
    for e in todo:
        topo, opts = e["topology"], e["options"]
        if settings.guess is not None:
            guess, how = settings.guess, "given (--guess)"
        else:
            guess, how = virtual.quick_estimate(steady, topo, opts, list(settings.grid),
                                                settings.seed)
        say(f"{e['endpoint']} as {topo}: start at {guess:.3g} req/s ({how})")
        runs = [virtual.bisect(steady, topo, opts, s, guess) for s in seeds]
        summ = virtual.summary(topo, e["gpus"], runs, settings.target)
        cap = summ["median"]
        say(f"{e['endpoint']} as {topo}: capacity {cap if cap is None else round(cap, 3)} "
            "req/s (predicted)")
        latency = []
        for f in settings.loads if cap else ():
            p = virtual.probe(steady, topo, opts, float(cap * f), settings.seed)
            latency.append({"load": f, **p})
        first = next((r for r in runs if r["capacity"] is not None), None)
        at_cap = next((p for p in first["tried"] if p["rate"] == first["capacity"]), None) \
            if first else None
        tried = [p for r in runs for p in r["tried"]] + latency
        e.update(start={"rate": guess, "from": how}, capacity=summ,
                 classes=_classes(cap or 0.0, at_cap, tried, work.slo, settings.target),
                 latency=latency)
    return {"prediction": True, "note": PREDICTION, "config": str(path),
            "workload": name, "warm": warm, "slo": work.slo,
            "target": settings.target, "seeds": seeds, "seconds": settings.seconds,
            "warmup_s": settings.warmup_s, "precision": settings.precision,
            "requests": len(work.reqs), "endpoints": todo,
            "skipped": [ep.name for ep in cfg.endpoints if ep.kind != "builtin"
                        and settings.endpoint in (None, ep.name)],
            "wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - cpu0}


def run_workloads(run_dir) -> tuple[list[str], list[str]]:
    """(endpoints, workloads) a run folder measured, from its run.json; a user error naming
    the folder where it holds no run."""
    from kvbench.core.errors import DataError
    from kvbench.core.store import read_meta

    try:
        meta = read_meta(run_dir)
    except (DataError, OSError) as err:
        raise UserError(f"--save {run_dir}: not a run folder kvbench can read ({err}); give "
                        "the results folder of the run to compare with") from None
    eps = [str(e.name) for e in meta.endpoints if e.name]
    wls = list(dict.fromkeys(str(s.workload) for s in meta.stages if s.workload))
    return eps, wls


def measured_as(cfg, names: list[str], run_dir) -> dict[str, str]:
    """Per predicted endpoint of ``names``, the endpoint of the run in ``run_dir`` it
    predicts: the same name, else the twin's ``source_endpoint``, else the run's only
    endpoint (one predicted of one measured); a user error naming the endpoint where none is."""
    eps, _ = run_workloads(run_dir)
    t = cfg.twin
    source = dict(t.model_extra or {}).get("source_endpoint") if t is not None else None
    out = {}
    for name in names:
        if name in eps:
            out[name] = name
        elif source in eps and _twin_of(cfg, name) is not None:
            out[name] = source
        elif len(eps) == 1 and len(names) == 1:
            out[name] = eps[0]
        else:
            raise UserError(f"--save {run_dir}: endpoint {name!r} of the config is not one of "
                            f"the run's {eps}; pick the twin with --endpoint and set its "
                            "[twin] source_endpoint to the run's endpoint it models")
    return out


def save(res: dict, cfg, run_dir, measured: dict[str, str]) -> Path:
    """Write the prediction ``res`` into ``run_dir/prediction.json``, where ``kvbench report``
    sets it beside the run's measurement (``reports.analysis.diagnose.twin``), each endpoint
    naming the run's endpoint it predicts (``measured``: ``measured_as``). A prediction of
    the same workload and endpoints replaces the one saved before; others are kept."""
    from kvbench.reports.analysis.diagnose.twin import KIND, PREDICTION_FILE, read_predictions

    run_dir = Path(run_dir)
    t = cfg.twin
    extra = dict(t.model_extra or {}) if t is not None else {}
    for e in res["endpoints"]:
        e["measured_endpoint"] = measured[e["endpoint"]]
    res = {**res, "twin": {"path": res["config"], "endpoint": None if t is None
                           else t.endpoint, "fitted": [] if t is None else list(t.fitted),
                           **{k: extra.get(k) for k in ("source_run", "source_endpoint",
                                                        "reliable")}}}

    def key(p):
        return (p.get("workload"), sorted(e.get("measured_endpoint") or ""
                                          for e in p.get("endpoints", [])))

    kept = [p for p in read_predictions(run_dir) if key(p) != key(res)]
    path = run_dir / PREDICTION_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite({"kind": KIND, "predictions": [*kept, res]}), indent=1,
                              default=str, allow_nan=False), "utf-8")
    os.replace(tmp, path)
    return path


def finite(x):
    """``x`` with every NaN as None (JSON has no NaN)."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    return x
