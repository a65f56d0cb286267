"""``kvbench calibrate RUN_DIR --endpoint NAME -o twin.toml``: fit the built-in engine model to a
run of ``[profiles.calibrate]`` (the fit is ``kvbench.reports.analysis.calibrate``) and write
the twin: an ``[[endpoints]]`` table of kind "builtin" with the fitted options, and a ``[twin]``
table with each parameter's value, standard error, status and residuals."""

from __future__ import annotations

import sys
from pathlib import Path

from kvbench.core.errors import UserError


def add_parser(p) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="results of kvbench run --profile calibrate (results/<run_id>)")
    p.add_argument("--endpoint", default=None,
                   help="the endpoint of the run to fit (default: the run's only endpoint)")
    p.add_argument("-o", "--output", type=Path, default=Path("twin.toml"),
                   help="the twin file to write (default twin.toml)")
    p.add_argument("--name", default=None, help="the twin endpoint's name (default NAME-twin)")
    p.add_argument("--probe-kv", action="store_true",
                   help="find the KV capacity by the eviction stage even where the engine's "
                        "/metrics publishes its cache config (a check of the probe)")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(float(f"{v:.6g}")) if v == v and abs(v) != float("inf") else '"nan"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    return f'"{s}"'


def _param_table(prefix: str, p) -> list[str]:
    lines = [f"[{prefix}.{p.name}]", f"value = {_toml_value(float(p.value))}",
             f"stderr = {_toml_value(float(p.stderr))}", f"status = {_toml_value(p.status)}",
             f"unit = {_toml_value(p.unit)}", f"samples = {p.n}"]
    if p.rms is not None:
        lines.append(f"residual_rms_ms = {_toml_value(float(p.rms))}")
    if p.status == "bound":
        lines.append(f"at_least = {_toml_value(float(p.value))}")
    if p.note:
        lines.append(f"note = {_toml_value(p.note)}")
    return lines + [""]


def render_twin(fit, *, name: str, endpoint: str, source_run: str, base_options: dict,
                defaults: dict) -> str:
    opts = {**base_options, **fit.options(defaults)}
    import json

    lines = ["# A calibrated twin (kvbench calibrate): the built-in engine model with options",
             f"# fitted to run {source_run} of endpoint {endpoint!r}. Use the [[endpoints]]",
             "# table below in any bench.toml (kvbench run starts it), or serve it alone:",
             "# kvbench serve --topology colocated --port 0 --options-json "
             f"'{json.dumps(opts, separators=(',', ':'))}'",
             "", "[twin]", f"endpoint = {_toml_value(name)}",  # the [[endpoints]] below
             f"source_endpoint = {_toml_value(endpoint)}",
             f"source_run = {_toml_value(source_run)}",
             f"fitted = {_toml_value(sorted(fit.params))}",
             f"reliable = {_toml_value(fit.unreliable is None)}"]
    if fit.unreliable:
        lines.append(f"unreliable = {_toml_value(fit.unreliable)}")
    if fit.notes:
        lines.append(f"notes = {_toml_value(fit.notes)}")
    if fit.missing:
        lines.append(f"missing = {_toml_value(fit.missing)}")
    lines.append("")
    for p in fit.params.values():
        lines += _param_table("twin.fit", p)
    for p in fit.extra.values():
        lines += _param_table("twin.terms", p)
    lines += ["[[endpoints]]", f"name = {_toml_value(name)}", 'kind = "builtin"',
              'topology = "colocated"',
              "options = { " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in opts.items())
              + " }", ""]
    return "\n".join(lines)


def report(fit, out=sys.stdout) -> None:
    print(f"{'parameter':30s} {'value':>14s} {'± stderr':>12s}  {'status':8s} residual RMS",
          file=out)
    for p in list(fit.params.values()) + list(fit.extra.values()):
        val = f"at least {p.value:.4g}" if p.status == "bound" else f"{p.value:.4g}"
        rms = f"{p.rms:.3g} ms" if p.rms is not None else "-"
        print(f"{p.name:30s} {val:>14s} {'± ' + format(p.stderr, '.3g'):>12s}  {p.status:8s} "
              f"{rms}  {p.unit}", file=out)
    for n in fit.notes:
        print(f"note: {n}", file=out)
    for m in fit.missing:
        print(f"missing: {m}", file=out)
    if fit.unreliable:
        print(f"UNRELIABLE: {fit.unreliable}", file=out)


def prefix_keys(config: dict, requests) -> dict:
    """request id -> its shared prefix's identity (a document), for the single-turn workloads
    of the run whose requests share prefixes: rebuilt from the run's own config and seed (the
    records keep no prompt text). The key is the text right after what every prompt of the
    workload shares (a system prompt), where the documents begin."""
    import hashlib
    import os

    import pyarrow.compute as pc

    from kvbench.workloads.registry import make_from_specs, tables_adapter
    from kvbench.workloads.tokenizer import get_tokenizer

    shared = requests.filter(pc.greater(pc.fill_null(requests.column("shared_prefix_tokens"),
                                                     0), 0))
    names = sorted(set(x for x in shared.column("workload").to_pylist() if x))
    tables = (config or {}).get("workloads") or {}
    suite = (config or {}).get("suite") or {}
    out: dict = {}
    for name in names:
        spec = tables.get(name)
        if not spec or spec.get("kind") != "rag":  # sticky sessions key by session id
            continue
        try:
            specs = tables_adapter().validate_python({name: spec})
            wl = make_from_specs(name, specs, int(suite.get("seed", 0)),
                                 get_tokenizer(suite.get("tokenizer", "builtin")))
            reqs = list(wl.requests())
        except Exception:  # noqa: BLE001 - a run from another version: no keys, say nothing
            continue
        prompts = [r.prompt or str(r.messages) for r in reqs]
        lcp = len(os.path.commonprefix(prompts)) if len(prompts) > 1 else 0
        for r, text in zip(reqs, prompts):
            out[r.request_id] = hashlib.sha1(text[lcp:lcp + 512].encode()).hexdigest()
    return out


def base_options(cfg_ep: dict) -> dict:
    """The twin's options that are no fit: a built-in source endpoint's model, dtypes,
    hardware, block size and replicas; any other endpoint is fitted whole, as one engine
    (replicas 1: left out, the colocated topology's default of 2 doubled every capacity)."""
    if cfg_ep.get("kind") != "builtin":
        return {"replicas": 1}
    src = dict(cfg_ep.get("options") or {})
    return {k: src[k] for k in ("model", "weight_dtype", "kv_dtype", "hardware",
                                "block_tokens", "replicas") if k in src}


def run(args) -> int:
    from kvbench.endpoints.config import EmulatorConfig
    from kvbench.core.runjson import read_meta
    from kvbench.core.shards import read_table
    from kvbench.reports.analysis import calibrate as C

    run_dir = args.run_dir
    if not (run_dir / "run.json").is_file():
        raise UserError(f"{run_dir}: no run.json; give a results folder of kvbench run "
                        "--profile calibrate")
    meta = read_meta(run_dir)
    names = [e.name for e in meta.endpoints]
    endpoint = args.endpoint or (names[0] if len(names) == 1 else None)
    if endpoint is None:
        raise UserError(f"{run_dir} holds endpoints {names}; pick one with --endpoint")
    if names and endpoint not in names:
        raise UserError(f"--endpoint {endpoint}: not in {run_dir} (it has {names})")
    requests = read_table(run_dir, "requests")
    engine = read_table(run_dir, "engine")
    cfg_ep = next((e for e in (meta.config or {}).get("endpoints", []) or []
                   if e.get("name") == endpoint), {}) or {}
    base = base_options(cfg_ep)
    fit = C.fit(requests, engine, endpoint, model=base.get("model", "llama-3-70b"),
                weight_dtype=base.get("weight_dtype", "fp8"),
                prefix_keys=prefix_keys(meta.config, requests), use_metrics=not args.probe_kv)
    if not fit.params:
        raise UserError(fit.missing[0] if fit.missing else
                        f"{run_dir}: nothing to fit for endpoint {endpoint!r}")
    text = render_twin(fit, name=args.name or f"{endpoint}-twin", endpoint=endpoint,
                       source_run=meta.run_id or run_dir.name, base_options=base,
                       defaults=EmulatorConfig().model_dump())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    report(fit)
    print(f"wrote {args.output}")
    return 0
