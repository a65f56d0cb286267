"""What results on object storage cost a run (issue 34, "Upload overhead"): the same open-loop
``kvbench run`` twice against the built-in colocated endpoint (``kvbench serve`` on 127.0.0.1, a
small ``time_scale`` so it answers fast), once with ``--results-dir`` a local folder and once
``s3://...`` on a local ``moto_server`` (started as ``tests/test_results_s3.py`` starts it; the
test extra installs it).

Printed per run: requests the endpoint served (its ``vllm:request_success_total``, read before
and after), the records of the run (read back from the bucket for the S3 run: ``fetch_run``
of the complete run), records lost (served - records ``ok``: must be 0), and the CPU seconds of
the load process(es) (``locust``: the parent's count of the children it waited for, from
``/proc/<pid>/stat``) and of the ``kvbench run`` parent alone (its own ``/proc`` times, sampled
every 0.2 s until it exits: the uploader is a thread of it), then the S3 run's ratios to the local one. The issue asks at most 5% more CPU in the load
process; the upload runs in the parent, whose cost is printed too.

    python bench/upload_overhead.py --rate 500 --seconds 60
    python bench/upload_overhead.py --rate 200 --seconds 30 --time-scale 0.01
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK = os.sysconf("SC_CLK_TCK")
KEY_ID, SECRET = "AKIAKVBENCHBENCHKEY1", "kvbenchBenchSecretNotReal01"

CONFIG = """
[suite]
name = "upl"
seed = 5
workloads = ["chat"]
profile = "open"

[[endpoints]]
name = "emu"
kind = "openai"
url = "{url}"
model = "{model}"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 2000
prompt_tokens = {{ dist = "constant", mean = {prompt} }}
output_tokens = {{ dist = "constant", mean = {output} }}

[profiles.open]
pacing = "poisson"
stages = [ {{ rate_rps = {rate}, duration_s = {seconds} }} ]

[storage]
endpoint_url = "{s3}"
region = "us-east-1"
path_style = true
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    end = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > end:
                raise SystemExit(f"{what} did not start")
            time.sleep(0.2)


def start_s3() -> tuple[subprocess.Popen, str]:
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        raise SystemExit("moto_server is not installed: pip install -e '.[test]'")
    port = free_port()
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, "moto_server")
    return proc, f"http://127.0.0.1:{port}"


def start_endpoint(time_scale: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbench", "serve", "--topology", "colocated", "--host",
         "127.0.0.1", "--port", str(port), "--options-json",
         json.dumps({"time_scale": time_scale})],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, "the built-in endpoint")
    return proc, f"http://127.0.0.1:{port}"


def served(url: str) -> int:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return int(sum(float(m) for m in re.findall(
        r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


def model_of(url: str) -> str:
    return json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())[
        "data"][0]["id"]


def proc_cpu(pid: int, children: bool = False) -> float | None:
    """CPU seconds of ``pid`` itself (user + system), or of its children it waited for."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    i = 13 if children else 11
    return (int(fields[i]) + int(fields[i + 1])) / CLK


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def run_once(cfg: Path, results: str, env: dict, timeout_s: float) -> dict:
    """One ``kvbench run``: the CPU of its load processes and of itself, its run id."""
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                             "--results-dir", results, "--run-id", "r"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    load_cpu: dict[int, float] = {}
    parent_cpu = waited = 0.0
    end = time.monotonic() + timeout_s
    out = []
    import threading

    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None and time.monotonic() < end:
        for pid in descendants(proc.pid):
            if "locust" in cmdline(pid):
                c = proc_cpu(pid)
                if c is not None:
                    load_cpu[pid] = c
        c, kids = proc_cpu(proc.pid), proc_cpu(proc.pid, children=True)
        if c is not None:
            parent_cpu = c  # its own threads only (children are counted apart)
            waited = kids  # its load processes once it waited for them: their whole CPU
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
        raise SystemExit("kvbench run did not end in time")
    reader.join(5)
    if proc.returncode != 0:
        raise SystemExit(f"kvbench run failed ({proc.returncode}):\n{''.join(out)[-3000:]}")
    # the parent's count of its waited-for children has the load processes' last moments,
    # which the 0.2 s samples may miss
    return {"load_cpu": max(sum(load_cpu.values()), waited), "load_procs": len(load_cpu),
            "parent_cpu": parent_cpu, "output": "".join(out)}


def count_records(run_dir: Path) -> tuple[int, int]:
    from kvbench.core.store import scan

    total = ok = 0
    for b in scan(run_dir, "requests", columns=["status"]):
        total += b.num_rows
        ok += sum(1 for s in b.column(0).to_pylist() if s == "ok")
    return total, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop requests/s")
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--time-scale", type=float, default=0.01)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=16, help="output tokens per request")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="upload-"))
    s3proc, s3 = start_s3()
    ep, url = start_endpoint(a.time_scale)
    env = dict(os.environ, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET,
               AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               XDG_CACHE_HOME=str(tmp / "cache"))
    env.pop("KVBENCH_SPOOL_DIR", None)
    try:
        from pyarrow import fs as pafs

        pafs.S3FileSystem(endpoint_override=s3.split("//", 1)[1], scheme="http",
                          region="us-east-1", allow_bucket_creation=True,
                          access_key=KEY_ID, secret_key=SECRET).create_dir("kvb-upload")
        cfg = tmp / "bench.toml"
        cfg.write_text(CONFIG.format(url=url, model=model_of(url), rate=a.rate,
                                     seconds=a.seconds, s3=s3, prompt=a.prompt,
                                     output=a.output))
        rows = {}
        for name, results in (("local", str(tmp / "results")),
                              ("s3", "s3://kvb-upload/bench")):
            before = served(url)
            r = run_once(cfg, results, env, timeout_s=a.seconds * 4 + 300)
            r["served"] = served(url) - before
            if name == "s3":
                import os as _os

                for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                          "XDG_CACHE_HOME"):
                    _os.environ[k] = env[k]
                from kvbench.core import objstore

                loc = objstore.parse("s3://kvb-upload/bench", {"endpoint_url": s3,
                                                               "region": "us-east-1",
                                                               "path_style": True})
                if objstore.complete(loc, "r") is None:
                    raise SystemExit("the S3 run has no _COMPLETE marker")
                run_dir = objstore.fetch_run(loc, "r", tmp / "fetched")
            else:
                run_dir = tmp / "results" / "r"
            r["records"], r["ok"] = count_records(run_dir)
            r["lost"] = r["served"] - r["ok"]
            rows[name] = r
            print(f"{name:5}: served {r['served']:,} ({r['served'] / a.seconds:.0f}/s), "
                  f"records {r['records']:,} (ok {r['ok']:,}), lost {r['lost']}, "
                  f"load process CPU {r['load_cpu']:.2f} s ({r['load_procs']} process), "
                  f"kvbench run parent CPU {r['parent_cpu']:.2f} s", flush=True)
        lo, hi = rows["local"], rows["s3"]
        print(f"rate asked {a.rate:g} req/s for {a.seconds} s, endpoint time_scale "
              f"{a.time_scale:g}, {a.prompt} prompt / {a.output} output tokens")
        print(f"S3 / local: load process CPU {hi['load_cpu'] / lo['load_cpu']:.3f} "
              f"(per record {hi['load_cpu'] / hi['records'] / (lo['load_cpu'] / lo['records']):.3f}),"
              f" parent CPU {hi['parent_cpu'] / lo['parent_cpu']:.3f} "
              f"(+{hi['parent_cpu'] - lo['parent_cpu']:.2f} s), records lost in the S3 run: "
              f"{hi['lost']}")
    finally:
        for p in (ep, s3proc):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
