"""``kvbench run``: the bench.toml matrix (endpoints x workloads x load stages), headless through
Locust, with preflight checks before any load, then results, run.json and a short summary.

Locust runs in subprocesses (``python -m locust -f loadgen/<kind>.py --headless ...``), one per
endpoint and workload (per stage for closed loop), so gevent never enters this process; the
collectors run in this process's threads.
"""

from __future__ import annotations

import json
import math
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvbench.core.errors import UserError
from kvbench.runs.finalize import describe_sent_requests

LOCUSTFILES = {"longctx": "longctx.py", "rag": "rag.py", "agent": "agent.py", "mix": "mix.py",
               "trace": "trace.py"}
DRAIN_S = 30.0  # after the last open-loop stage, how long in-flight requests may finish
SAMPLE_PROMPTS = 3


def add_parser(p) -> None:
    p.add_argument("--config", default="bench.toml", help="bench.toml (default: ./bench.toml)")
    p.add_argument("--processes", type=int, default=1,
                   help="Locust load processes per run (each writes its own records shard)")
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
    from kvbench.core import store
    from kvbench.config import load_config

    cfg_path = Path(args.config)
    cfg = load_config(cfg_path)
    if args.processes < 1:
        raise UserError("--processes must be at least 1")
    if args.duration_scale <= 0:
        raise UserError("--duration-scale must be positive, e.g. 0.5")
    endpoints = _select(cfg.endpoints, args.endpoint, "endpoint", lambda e: e.name)
    wl_names = args.workload or cfg.suite.workloads or _default_workloads(cfg)
    for w in wl_names:
        if w not in cfg.workloads:
            raise UserError(f"--workload {w}: not a [workloads.*] table of {cfg_path}; use one "
                            f"of {sorted(cfg.workloads)}")
    prof_names = ([args.profile] if args.profile else
                  [cfg.suite.profile] if cfg.suite.profile else sorted(cfg.profiles))
    for pn in prof_names:
        if pn not in cfg.profiles:
            raise UserError(f"--profile {pn}: not a [profiles.*] table of {cfg_path}; use one "
                            f"of {sorted(cfg.profiles)}")
    results_dir = Path(args.results_dir or cfg.suite.results_dir)
    run_id = args.run_id or store.new_run_id(cfg.suite.name)
    run_dir = results_dir / run_id
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} already holds results; pick another --run-id")

    print(f"kvbench run {run_id}: {len(endpoints)} endpoint(s) x {len(wl_names)} workload(s) "
          f"x profile {', '.join(prof_names)}", flush=True)
    workloads = _build_workloads(cfg, wl_names)
    started_ns = time.time_ns()
    servers: list[subprocess.Popen] = []
    collectors = None
    meta_extra: dict = {"telemetry": {}, "incomplete": [], "clock_offsets_ns": {}}
    interrupted = False
    try:
        targets = []
        for ep in endpoints:
            if ep.kind == "builtin":
                proc, url = _start_builtin(ep)
                servers.append(proc)
            else:
                url = ep.url.rstrip("/")
            targets.append((ep, url))
        ep_info = []
        for ep, url in targets:
            model, ctx_tokens = _preflight(ep, url, workloads)
            ep_info.append({"name": ep.name, "topology": ep.topology, "url": url, "model": model,
                            "kind": ep.kind, "gpus": ep.gpus, "gpu_hour_cost": ep.gpu_hour_cost,
                            "max_context_tokens": ctx_tokens,
                            "metrics_url": getattr(ep, "metrics_url", None)})
        run_dir.mkdir(parents=True, exist_ok=True)
        collectors = _start_collectors(run_dir, cfg, ep_info, meta_extra)
        jobs = _jobs(cfg, ep_info, wl_names, prof_names, args.duration_scale)
        total_s = sum(j["expected_s"] for j in jobs)
        print(f"kvbench run: {len(jobs)} Locust run(s), about {total_s:.0f} s of load; records "
              f"in {run_dir}", flush=True)
        for k, job in enumerate(jobs, 1):
            print(f"[{k}/{len(jobs)}] {job['label']} ...", flush=True)
            t0 = time.monotonic()
            rc, err = _run_locust(job, cfg_path, run_id, results_dir, run_dir, args.processes)
            n = _records_so_far(run_dir)
            print(f"[{k}/{len(jobs)}] {job['label']}: done in {time.monotonic() - t0:.1f} s, "
                  f"{n} records so far", flush=True)
            if err:
                raise UserError(err)
            if rc not in (0, 1):  # 1: Locust saw failed requests, which the records hold
                meta_extra["incomplete"].append({"what": job["label"],
                                                 "why": f"locust exited with code {rc}"})
    except KeyboardInterrupt:
        interrupted = True
        meta_extra["incomplete"].append({"what": "the run", "why": "interrupted (Ctrl-C)"})
        print("kvbench run: interrupted; writing what was recorded", file=sys.stderr)
    finally:
        if collectors is not None:
            try:
                got = collectors.stop()
                meta_extra["telemetry"].update(got.get("telemetry", {}))
                meta_extra["incomplete"].extend(got.get("incomplete", []))
                meta_extra["clock_offsets_ns"].update(got.get("clock_offsets_ns", {}))
            except Exception as exc:  # noqa: BLE001 - results first
                meta_extra["telemetry"]["collectors"] = f"stop failed: {exc}"
        for proc in servers:
            _stop(proc)
    if not run_dir.exists():
        return 130 if interrupted else 0
    _finish(run_dir, run_id, cfg, started_ns, ep_info, workloads, meta_extra, results_dir)
    return 130 if interrupted else 0


# --------------------------------------------------------------------------- selection

def _select(items, names, what, key):
    if not names:
        return list(items)
    known = {key(i): i for i in items}
    for n in names:
        if n not in known:
            raise UserError(f"--{what} {n}: not in the config; use one of {sorted(known)}")
    return [known[n] for n in names]


def _default_workloads(cfg) -> list[str]:
    parts = {c.workload for s in cfg.workloads.values() if s.kind == "mix" for c in s.components}
    return [n for n in cfg.workloads if n not in parts]


def _build_workloads(cfg, names) -> dict:
    from kvbench.workloads.registry import make_workload

    return {n: make_workload(n, cfg) for n in names}


# --------------------------------------------------------------------------- endpoints

def _start_builtin(ep) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvbench", "serve", "--topology", ep.topology,
           "--host", "127.0.0.1", "--port", "0"]
    if ep.options:
        cmd += ["--options-json", json.dumps(ep.options)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=60)
    except queue.Empty:
        line = ""
    if "listening on" not in line:
        _stop(proc)
        err = (proc.stderr.read() or "").strip().splitlines()
        raise UserError(f"built-in endpoint {ep.name!r} ({ep.topology}) did not start: "
                        f"{err[-1] if err else 'no listening line within 60 s'}")
    url = line.split("listening on", 1)[1].split()[0]
    # keep draining stdout so the server never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _http_json(url: str, payload: dict | None = None, headers: dict | None = None,
               timeout: float = 30.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                           **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _auth(ep) -> dict:
    from kvbench.loadgen.openai import auth_headers

    return auth_headers(getattr(ep, "headers", None), getattr(ep, "api_key_env", None),
                        f"endpoint {ep.name!r}")


def _preflight(ep, url: str, workloads: dict) -> tuple[str, int | None]:
    """The endpoint answers, the model exists, prompts fit, token counts agree. Sends no load
    (at most a few one-token requests when the server has no /tokenize)."""
    headers = _auth(ep)
    try:
        models = _http_json(url + "/v1/models", headers=headers, timeout=15)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"endpoint {ep.name!r} at {url} does not answer GET /v1/models "
                        f"({reason}); start it or fix its url") from None
    listed = {m.get("id"): m for m in models.get("data", []) if isinstance(m, dict)}
    model = ep.model or next(iter(listed), None)
    if model is None or model not in listed:
        raise UserError(f"endpoint {ep.name!r}: model {model!r} is not served there (it lists "
                        f"{sorted(k for k in listed if k)}); set model in its [[endpoints]] entry")
    ctx = ep.max_context_tokens or listed[model].get("max_model_len")
    samples = []
    for wname, wl in workloads.items():
        longest, longest_id = 0, None
        for i, req in enumerate(wl.requests()):
            total = req.prompt_tokens + req.max_tokens
            if total > longest:
                longest, longest_id = total, req.request_id
            if i < SAMPLE_PROMPTS:
                samples.append(req)
        if ctx and longest > ctx:
            raise UserError(f"workload {wname!r}: request {longest_id} needs {longest} tokens "
                            f"(prompt plus max_tokens), more than the {ctx}-token context of "
                            f"endpoint {ep.name!r}; lower the workload's token maxima")
    _check_token_counts(ep, url, model, samples, headers)
    return model, ctx


def _check_token_counts(ep, url, model, samples, headers) -> None:
    worst = 0.0
    for req in samples:
        body = {"model": model}
        if req.messages is not None:
            body["messages"] = list(req.messages)
        else:
            body["prompt"] = req.prompt
        try:
            server = _http_json(url + "/tokenize", body, headers)["count"]
        except (urllib.error.URLError, OSError, KeyError, ValueError, TypeError):
            path = "/v1/chat/completions" if req.messages is not None else "/v1/completions"
            try:
                out = _http_json(url + path, {**body, "max_tokens": 1, "stream": False}, headers,
                                 timeout=120)
                server = out["usage"]["prompt_tokens"]
            except (urllib.error.URLError, OSError, KeyError, ValueError, TypeError):
                print(f"kvbench run: warning: endpoint {ep.name!r} reports no prompt token "
                      "counts (/tokenize or usage); client counts are unchecked",
                      file=sys.stderr)
                return
        if req.prompt_tokens:
            worst = max(worst, abs(server - req.prompt_tokens) / req.prompt_tokens)
    if worst > 0.01:
        print(f"kvbench run: warning: endpoint {ep.name!r} counts prompt tokens up to "
              f"{worst:.1%} differently from the client's tokenizer; configure suite.tokenizer "
              "with the model's tokenizer.json", file=sys.stderr)


def _start_collectors(run_dir, cfg, ep_info, meta_extra):
    try:
        from kvbench.collectors.session import start_collectors
    except ImportError as exc:
        meta_extra["telemetry"]["collectors"] = f"not available ({exc})"
        meta_extra["incomplete"].append({"what": "telemetry", "why": "collectors not installed"})
        return None
    eps = [{"name": e["name"], "url": e["url"], "topology": e["topology"],
            "metrics_url": e.get("metrics_url")} for e in ep_info]
    try:
        return start_collectors(run_dir, cfg.collect, eps)
    except Exception as exc:  # noqa: BLE001 - load still runs without telemetry
        meta_extra["telemetry"]["collectors"] = f"failed to start: {exc}"
        meta_extra["incomplete"].append({"what": "telemetry", "why": str(exc)[:200]})
        return None


# --------------------------------------------------------------------------- Locust runs

def _jobs(cfg, ep_info, wl_names, prof_names, scale) -> list[dict]:
    jobs = []
    for e in ep_info:
        for w in wl_names:
            kind = cfg.workloads[w].kind
            for pn in prof_names:
                prof = cfg.profiles[pn]
                base = {"endpoint": e, "workload": w, "profile": pn, "kind": kind, "prof": prof}
                if prof.pacing == "closed":
                    for i, st in enumerate(prof.stages):
                        d = st.duration_s * scale
                        jobs.append({**base, "stage": i, "users": st.users, "duration_s": d,
                                     "expected_s": d,
                                     "label": f"{e['name']} x {w} ({pn} stage {i + 1}/"
                                              f"{len(prof.stages)}: {st.users} users, {d:g} s)"})
                else:
                    durs = [st.duration_s * scale for st in prof.stages]
                    rates = ",".join(f"{st.rate_rps:g}" for st in prof.stages
                                     if st.rate_rps is not None)
                    label = (f"{e['name']} x {w} ({pn}: {prof.pacing}"
                             + (f" at {rates} req/s" if rates else "")
                             + f", {sum(durs):g} s)")
                    jobs.append({**base, "durations": durs, "rates": rates,
                                 "expected_s": sum(durs), "label": label})
    return jobs


def _run_locust(job, cfg_path, run_id, results_dir, run_dir, processes) -> tuple:
    import kvbench.loadgen as loadgen

    e = job["endpoint"]
    prof = job["prof"]
    locustfile = Path(loadgen.__file__).parent / LOCUSTFILES.get(job["kind"], "mix.py")
    cmd = [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless",
           "--host", e["url"], "--only-summary", "--loglevel", "WARNING",
           "--kvbench-config", str(cfg_path), "--kvbench-workload", job["workload"],
           "--kvbench-endpoint", e["name"], "--kvbench-topology", e["topology"],
           "--kvbench-model", e["model"], "--kvbench-profile", job["profile"],
           "--kvbench-run-id", run_id, "--kvbench-results", str(results_dir),
           "--kvbench-no-finalize"]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    if prof.pacing == "closed":
        users = job["users"]
        cmd += ["-u", str(users), "-r", str(users), "-t", f"{max(1, math.ceil(job['duration_s']))}s",
                "--kvbench-stage-index", str(job["stage"]), "--kvbench-pacing", "closed"]
        limit = job["duration_s"] + 60
    else:
        cap = sum(job["durations"]) + min(prof.request_timeout_s, DRAIN_S)
        cmd += ["-u", str(processes), "-r", str(processes), "-t", f"{math.ceil(cap)}s",
                "--kvbench-pacing", prof.pacing,
                "--kvbench-stage-duration", ",".join(f"{d:g}" for d in job["durations"])]
        if job["rates"]:
            cmd += ["--kvbench-rates", job["rates"]]
        limit = cap + 60
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in
                   f"{e['name']}-{job['workload']}-{job.get('stage', 'all')}")
    log_path = run_dir / f"locust-{safe}.log"
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(30)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)  # Locust flushes its records on SIGINT
            proc.wait(30)
            raise
    text = log_path.read_text(errors="replace")
    for line in text.splitlines():
        if "kvbench: error:" in line:
            return rc, line.split("kvbench: error:", 1)[1].strip()
    if rc not in (0, 1) and "Traceback" in text:
        tail = [ln for ln in text.splitlines() if ln.strip()][-1]
        return rc, f"Locust failed for {job['label']} ({tail.strip()[:200]}); see {log_path}"
    return rc, None


def _records_so_far(run_dir: Path) -> int:
    from kvbench.loadgen.sink import merge_proc_meta, read_proc_meta

    return merge_proc_meta(read_proc_meta(run_dir))["counts"]["records_written"]


# --------------------------------------------------------------------------- results

def _finish(run_dir, run_id, cfg, started_ns, ep_info, workloads, extra, results_dir) -> None:
    from kvbench.core import store
    from kvbench.loadgen.sink import merge_proc_meta, read_proc_meta

    merged = merge_proc_meta(read_proc_meta(run_dir))
    rows = store.compact(run_dir, "requests")
    for table in ("gpu", "engine"):
        store.compact(run_dir, table)
    described = {}
    for name, wl in workloads.items():
        try:
            from kvbench.workloads.describe import describe

            described[name] = describe(wl)
        except Exception as exc:  # noqa: BLE001 - a summary must not lose the run
            extra["incomplete"].append({"what": f"workload summary of {name}",
                                        "why": str(exc)[:200]})
    sent = {}
    try:
        sent = describe_sent_requests(run_dir, workloads, cfg.endpoints)
    except Exception as exc:  # noqa: BLE001 - a summary must not lose the run
        extra["incomplete"].append({"what": "summary of the requests sent",
                                    "why": str(exc)[:200]})
    incomplete = merged["incomplete"] + extra["incomplete"]
    if rows != merged["counts"]["records_written"]:
        incomplete.append({"what": "records", "why": f"{rows} compacted, "
                           f"{merged['counts']['records_written']} written"})
    metas = read_proc_meta(run_dir)
    meta = {
        "run_id": run_id, "suite": cfg.suite.name, "started_ns": started_ns,
        "ended_ns": time.time_ns(), "config": cfg.public_dump(),
        "versions": store.versions(), "git_commit": store.git_commit(Path.cwd()),
        "hosts": sorted({m.get("host") for m in metas if m.get("host")}),
        "endpoints": ep_info, "stages": merged["stages"],
        "clock_offsets_ns": extra["clock_offsets_ns"], "telemetry": extra["telemetry"],
        "incomplete": incomplete, "counts": merged["counts"], "workloads": described,
        "workloads_sent": sent,
    }
    store.write_run_json(run_dir, store.RunMeta.from_dict(meta))
    latest = results_dir / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(run_id)
    except OSError as exc:
        print(f"kvbench run: could not update {latest} ({exc})", file=sys.stderr)
    _summary(run_dir, merged["counts"])


def _summary(run_dir: Path, counts: dict) -> None:
    """A few numbers per endpoint, computed with the reports' metric definitions."""
    from kvbench.core.store import load_results
    from kvbench.reports import metrics as M

    res = load_results(run_dir)
    if res.requests.num_rows == 0:
        print(f"kvbench run: no requests recorded; results in {run_dir}")
        return
    frame = M.request_frame(res.requests, stages=res.meta.get("stages") or ())
    print(f"{'endpoint':<16} {'requests':>8} {'ok':>6} {'errors':>6} {'TTFT p50 ms':>12} "
          f"{'TPOT p50 ms':>12}")
    for ep in frame["endpoint"].cat.categories:
        sub = frame[frame["endpoint"] == ep]
        n_ok = int(sub["ok"].sum())
        print(f"{ep:<16} {len(sub):>8} {n_ok:>6} {len(sub) - n_ok:>6} "
              f"{M.statistic(sub, 'ttft_p50'):>12.1f} {M.statistic(sub, 'tpot_p50'):>12.1f}")
    print(f"kvbench run: {counts['records_written']} records of {counts['requests_started']} "
          f"requests started, {counts['dropped_at_cap']} dropped at the in-flight cap; "
          f"results in {run_dir}")
    print(f"next: kvbench report {run_dir} -o report.html")
