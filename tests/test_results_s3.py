"""Results on object storage, end to end against a real S3-compatible server started here on
127.0.0.1 (moto's server mode, a subprocess with its own socket; not an in-process mock):
``kvbench run --results-dir s3://...`` spools locally and uploads, its marker last; ``kvbench
report`` and ``kvbench gate`` read the S3 paths; no credential reaches an object; a SIGKILL of
``kvbench run`` leaves the run without its marker, and ``kvbench recover`` (or the next read)
uploads the spool."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyarrow import fs as pafs

from kvbench.core import objstore
from kvbench.core.store import load_results

ROOT = Path(__file__).resolve().parent.parent
SECRET = "kvbenchS3secretValue9f27"  # the secret access key the processes get
KEY_ID = "AKIAKVBENCHTESTKEY42"

CONFIG = """
[suite]
name = "s3t"
results_dir = "{results}"
workloads = ["chat"]
profile = "{profile}"

[[endpoints]]
name = "builtin"
kind = "builtin"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 40
prompt_tokens = {{ dist = "constant", mean = 32 }}
output_tokens = {{ dist = "constant", mean = 8 }}

[profiles.short]
pacing = "closed"
stages = [ {{ users = 2, duration_s = 2 }} ]

[profiles.long]
pacing = "closed"
stages = [ {{ users = 2, duration_s = 300 }} ]

[slo.chat]
ttft_ms = 60000
e2e_ms = 120000

[[gate.rules]]
metric = "error_rate"
max_value = 60000

[storage]
endpoint_url = "{endpoint}"
region = "us-east-1"
path_style = true
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        pytest.skip("moto[server] (the test extra) is not installed")
    port = _free_port()
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < end, "moto_server did not start"
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture()
def env(tmp_path, s3, monkeypatch):
    e = dict(os.environ, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET,
             AWS_REGION="us-east-1", XDG_CACHE_HOME=str(tmp_path / "cache"),
             AWS_EC2_METADATA_DISABLED="true")
    e.pop("KVBENCH_SPOOL_DIR", None)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "XDG_CACHE_HOME",
              "AWS_EC2_METADATA_DISABLED"):
        monkeypatch.setenv(k, e[k])
    return e


def _fs(endpoint):
    return objstore.filesystem(objstore.parse("s3://x-bucket-any", {"endpoint_url": endpoint}))


def _bucket(endpoint, name):
    port = endpoint.rpartition(":")[2]
    pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                      allow_bucket_creation=True).create_dir(name)
    return name


def _objects(endpoint, prefix) -> dict[str, bytes]:
    fs = _fs(endpoint)
    sel = pafs.FileSelector(prefix, recursive=True, allow_not_found=True)
    out = {}
    for info in fs.get_file_info(sel):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                out[info.path[len(prefix) + 1:]] = f.read()
    return out


def kvbench(env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvbench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _config(tmp_path, endpoint, results, profile="short"):
    cfg = tmp_path / "bench.toml"
    cfg.write_text(CONFIG.format(results=results, endpoint=endpoint, profile=profile))
    return cfg


def test_run_report_gate_on_s3(tmp_path, s3, env):
    bucket = _bucket(s3, "kvb-e2e")
    cfg = _config(tmp_path, s3, f"s3://{bucket}/nightly")
    for run_id in ("base", "cur"):
        p = kvbench(env, "run", "--config", str(cfg), "--run-id", run_id)
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        assert f"s3://{bucket}/nightly/{run_id}" in p.stdout
    objs = _objects(s3, f"{bucket}/nightly/cur")
    assert objstore.MARKER in objs and "run.json" in objs
    marker = json.loads(objs[objstore.MARKER])
    assert set(marker["files"]) == set(objs) - {objstore.MARKER}
    # the run's config copy names the store, never a key
    meta = json.loads(objs["run.json"])
    assert meta["config"]["suite"]["results_dir"] == f"s3://{bucket}/nightly"
    assert meta["config"]["storage"]["endpoint_url"] == s3
    for name, data in objs.items():
        assert SECRET.encode() not in data and KEY_ID.encode() not in data, name
    # the spool is gone once uploaded
    spool = tmp_path / "cache" / "kvbench" / "spool"
    assert not any(p.is_file() for p in spool.rglob("*")), list(spool.rglob("*"))

    # report straight from the bucket (options on the URL: no bench.toml needed)
    url = f"s3://{bucket}/nightly/cur?endpoint_url={s3}"
    out = tmp_path / "r.html"
    p = kvbench(env, "report", url, "-o", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert out.stat().st_size > 10_000 and "<html" in out.read_text()[:2000].lower()
    local = objstore.cache_root(objstore.split_run(url)[0]) / "cur"
    res = load_results(local)
    assert res.requests.num_rows == res.meta.counts["records_written"] > 0

    # the gate on two S3 runs: same load, generous rule: it passes (exit 0)
    p = kvbench(env, "gate", "--baseline", f"s3://{bucket}/nightly/base?endpoint_url={s3}",
                "--current", url)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "PASS" in p.stdout
    assert "gate.json" in _objects(s3, f"{bucket}/nightly/cur")
    # with the store as --results-dir (AWS_ENDPOINT_URL from the environment), a run id
    p = kvbench(dict(env, AWS_ENDPOINT_URL=s3), "gate", "--baseline", "base", "--current",
                f"s3://{bucket}/nightly/latest", "--results-dir", f"s3://{bucket}/nightly")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def test_bad_store_fails_before_any_load(tmp_path, s3, env):
    cfg = _config(tmp_path, s3, "s3://no-such-bucket-kvb/p")
    p = kvbench(env, "run", "--config", str(cfg))
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert "suite.results_dir" in line and "no-such-bucket-kvb" in line and "create it" in line
    assert "Traceback" not in p.stderr
    p = kvbench(env, "run", "--config", str(cfg), "--results-dir", "s3://AK:SK@bucket/p")
    assert p.returncode == 2 and "credentials" in p.stderr and "SK" not in p.stderr.replace(
        "SK@", "")
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.format(results="gs://bucket/p", endpoint=s3, profile="short"))
    p = kvbench(env, "run", "--config", str(bad))
    assert p.returncode == 2 and "results_dir" in p.stderr and "s3://" in p.stderr


def test_run_on_s3_without_marker_is_refused(tmp_path, s3, env):
    bucket = _bucket(s3, "kvb-partial")
    fs = _fs(s3)
    with fs.open_output_stream(f"{bucket}/p/half/requests-h-1.rows") as f:
        f.write(b"x")
    p = kvbench(env, "report", f"s3://{bucket}/p/half?endpoint_url={s3}")
    assert p.returncode == 2
    assert "no complete run" in p.stderr and objstore.MARKER in p.stderr


def test_sigkill_mid_run_then_recover_uploads_the_spool(tmp_path, s3, env):
    bucket = _bucket(s3, "kvb-kill")
    cfg = _config(tmp_path, s3, f"s3://{bucket}/p", profile="long")
    run = subprocess.Popen([sys.executable, "-m", "kvbench", "run", "--config", str(cfg),
                            "--run-id", "k"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    spool = tmp_path / "cache" / "kvbench" / "spool"
    try:
        end = time.monotonic() + 180
        # the load has written records and the uploader has sent something (the job file)
        while not (list(spool.rglob("requests-*.rows")) and
                   _objects(s3, f"{bucket}/p/k")):
            assert run.poll() is None and time.monotonic() < end, "no load or no upload"
            time.sleep(0.3)
        time.sleep(2)
        run.send_signal(signal.SIGKILL)
        run.wait(30)
    finally:
        if run.poll() is None:
            run.kill()
        time.sleep(1)
        try:  # the load's children follow their parent (parent-death signal); be sure
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(3)
    objs = _objects(s3, f"{bucket}/p/k")
    assert objs and objstore.MARKER not in objs and "run.json" not in objs
    # a shard its load process never closed stays in the spool: nothing half-written goes up
    assert not [k for k in objs if k.endswith(".rows")], sorted(objs)
    p = kvbench(env, "report", f"s3://{bucket}/p/k?endpoint_url={s3}", "-o",
                str(tmp_path / "r.html"))  # the next read uploads the spool first
    assert p.returncode == 0, p.stderr[-3000:]
    assert "from the local spool" in p.stderr
    objs = _objects(s3, f"{bucket}/p/k")
    assert objstore.MARKER in objs and "run.json" in objs
    meta = json.loads(objs["run.json"])
    assert meta["interrupted"] and meta["counts"]["records_written"] > 0
    p = kvbench(env, "recover", f"s3://{bucket}/p/k?endpoint_url={s3}")
    assert p.returncode == 0 and "nothing to do" in p.stderr


def test_kvbench_recover_uploads_a_spool(tmp_path, s3, env):
    """A spooled run whose upload never ended (copied from a finished run's folder)."""
    bucket = _bucket(s3, "kvb-recover")
    cfg = _config(tmp_path, s3, str(tmp_path / "local"))
    p = kvbench(env, "run", "--config", str(cfg), "--run-id", "r")
    assert p.returncode == 0, p.stderr[-2000:]
    loc = objstore.parse(f"s3://{bucket}/q", {"endpoint_url": s3})
    spool = objstore.spool_root(loc) / "r"
    shutil.copytree(tmp_path / "local" / "r", spool)
    p = kvbench(env, "recover", f"s3://{bucket}/q/r?endpoint_url={s3}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert objstore.complete(loc, "r") is not None and not spool.exists()
    got = load_results(objstore.fetch_run(loc, "r", tmp_path / "copy"))
    assert got.requests.num_rows == load_results(tmp_path / "local" / "r").requests.num_rows


@given(st.text(max_size=120))
@settings(max_examples=300, deadline=None)
def test_any_results_dir_text_is_accepted_whole_or_refused_in_words(text):
    """The URL parser: a ValueError with a reason, or a location that round-trips; a key
    never passes as an option."""
    from kvbench.core.paths import results_dir_problem

    url = "s3://" + text
    why = results_dir_problem(url, remote_ok=True)
    try:
        loc = objstore.parse(url, env={})
    except ValueError as exc:
        assert why and str(exc) and "\n" not in str(exc)
        return
    assert why is None
    assert objstore.parse(loc.url(), env={}).key() == loc.key()
    assert "@" not in loc.bucket and ".." not in loc.prefix.split("/")


@pytest.mark.parametrize("opt", ["aws_secret_access_key=x", "access_key=y", "token=z",
                                 "endpoint=http://h"])
def test_credentials_and_unknown_options_are_refused(opt):
    with pytest.raises(ValueError, match="unknown option"):
        objstore.parse(f"s3://bucket/p?{opt}", env={})


def test_uploader_sends_closed_shards_while_the_run_goes_on(tmp_path, s3, env):
    """A shard goes up once its load process's sidecar says closed; one still written stays
    in the spool until the end; the marker comes with the final upload only."""
    bucket = _bucket(s3, "kvb-uploader")
    loc = objstore.parse(f"s3://{bucket}/u", {"endpoint_url": s3})
    run = tmp_path / "spool" / "r"
    run.mkdir(parents=True)
    (run / "requests-hostA-11.rows").write_bytes(b"closed shard")
    (run / "proc-hostA-11.json").write_text(json.dumps({"closed_ns": 5}))
    (run / "requests-hostA-12.rows").write_bytes(b"open shard")
    (run / "proc-hostA-12.json").write_text(json.dumps({"closed_ns": None}))
    (run / "runner.json").write_text("{}")
    up = objstore.Uploader(run, loc, "r")
    assert up.step() == 3
    assert set(_objects(s3, f"{bucket}/u/r")) == {
        "requests-hostA-11.rows", "proc-hostA-11.json", "proc-hostA-12.json"}
    assert up.step() == 0  # nothing changed: nothing sent again
    (run / "requests-hostA-12.rows").write_bytes(b"open shard, now whole")
    (run / "requests-hostA-11.rows").unlink()  # folded into Parquet at the end
    (run / "requests.parquet").write_bytes(b"PAR1")
    up.finish()
    objs = _objects(s3, f"{bucket}/u/r")
    assert set(objs) == {"proc-hostA-11.json", "proc-hostA-12.json", "requests-hostA-12.rows",
                         "requests.parquet", objstore.MARKER}
    assert objs["requests-hostA-12.rows"] == b"open shard, now whole"
    assert objstore.read_latest(loc) == "r"
