"""Done-means of issue 15: the master (with the built-in endpoint) and 2 workers, each in its own
network namespace joined by veth pairs only (192.0.2.0/24, the documentation range), each with
its own results directory and no path in common: the master's run holds every request the
endpoint served, one row each, and was written from its own directory alone. Needs root and
``ip netns``; skipped with the reason where namespaces cannot be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

import distributed_helpers as H
from kvbench.core import store
from kvbench.core.rows import shard_files

MASTER_PORT = 15557
ENDPOINT_PORT = 18000


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _make_namespaces(tag: str) -> dict:
    """master <-veth-> w1, master <-veth-> w2; each worker routes through the master's end."""
    names = {k: f"kvb{tag}{k}" for k in ("m", "w1", "w2")}
    for ns in names.values():
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
    for i, w in enumerate(("w1", "w2")):
        a, b = f"kvb{tag}m{i}", f"kvb{tag}{w}"
        _ip("link", "add", a, "netns", names["m"], "type", "veth", "peer", "name", b, "netns",
            names[w])
        base = 4 * i
        _ip("-n", names["m"], "addr", "add", f"192.0.2.{base + 1}/30", "dev", a)
        _ip("-n", names[w], "addr", "add", f"192.0.2.{base + 2}/30", "dev", b)
        _ip("-n", names["m"], "link", "set", a, "up")
        _ip("-n", names[w], "link", "set", b, "up")
        _ip("-n", names[w], "route", "add", "default", "via", f"192.0.2.{base + 1}")
    return names


@pytest.fixture
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip (run the suite as root)")
    tag = uuid.uuid4().hex[:4]
    try:
        names = _make_namespaces(tag)
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in (f"kvb{tag}{k}" for k in ("m", "w1", "w2")):
            _ip("netns", "del", ns, check=False)
        err = getattr(exc, "stderr", "") or exc
        pytest.skip(f"cannot create network namespaces here ({str(err).strip()[:160]})")
    try:
        yield names
    finally:
        for ns in names.values():
            _ip("netns", "del", ns, check=False)  # its veth ends go with it


def _served_in(ns: str, url: str) -> int:
    code = ("import sys; sys.path.insert(0, 'tests'); import distributed_helpers as H; "
            f"print(H.served({url!r}))")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                         capture_output=True, text=True, cwd=H.ROOT, timeout=30)
    return int(out.stdout.strip())


def test_master_and_workers_in_their_own_namespaces(namespaces, tmp_path):
    dirs = {k: tmp_path / k for k in ("m", "w1", "w2")}
    for d in dirs.values():
        d.mkdir()
    ep = H.popen([sys.executable, "-m", "kvbench", "serve", "--topology", "colocated",
                  "--host", "0.0.0.0", "--port", str(ENDPOINT_PORT)], cwd=dirs["m"],
                 log=tmp_path / "endpoint.log", netns=namespaces["m"])
    procs = [ep]
    url = f"http://192.0.2.1:{ENDPOINT_PORT}"
    try:
        for _ in range(200):
            if "listening on" in (tmp_path / "endpoint.log").read_text():
                break
            time.sleep(0.1)
        else:
            pytest.fail((tmp_path / "endpoint.log").read_text()[-2000:])
        model = subprocess.run(
            ["ip", "netns", "exec", namespaces["m"], sys.executable, "-c",
             f"import sys; sys.path.insert(0, 'tests'); import distributed_helpers as H; "
             f"print(H.model_of({url!r}))"], capture_output=True, text=True, cwd=H.ROOT,
            timeout=30).stdout.strip()
        cfg = dirs["m"] / "bench.toml"
        cfg.write_text(H.CONFIG.format(url=url, model=model, rate=20, duration=3))
        cmd = H.master_cmd(cfg, dirs["m"] / "results", MASTER_PORT, 2, "--kvbench-workload",
                           "chat", "--kvbench-profile", "open", bind="0.0.0.0")
        # the master cannot read the workers' directories: in its own mount namespace (ip
        # netns exec makes one, not propagated back) each is covered by an empty tmpfs
        hide = " && ".join(f"mount -t tmpfs kvbench-hidden {dirs[w]}" for w in ("w1", "w2"))
        master = H.popen(["sh", "-c", f'{hide} && exec "$@"', "sh", *cmd], cwd=dirs["m"],
                         log=tmp_path / "master.log", netns=namespaces["m"])
        procs.append(master)
        for i, w in enumerate(("w1", "w2")):
            # each worker reaches the master at its own veth peer's address
            procs.append(H.popen(H.worker_cmd(f"192.0.2.{4 * i + 1}", MASTER_PORT), cwd=dirs[w],
                                 log=tmp_path / f"{w}.log", netns=namespaces[w],
                                 env={"KVBENCH_SPOOL": str(dirs[w] / "spool"),
                                      "TMPDIR": str(dirs[w])}))
        rc = master.wait(120)
        for p in procs[2:]:
            p.wait(60)
        log = (tmp_path / "master.log").read_text()
        assert rc == 0, log[-3000:]
        served = _served_in(namespaces["m"], url)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    run_dir = dirs["m"] / "results" / "dist"
    res = store.load_results(run_dir)
    ids = res.requests.column("request_id").to_pylist()
    assert len(ids) == len(set(ids)) == served > 30, (len(ids), served)
    assert set(res.requests.column("status").to_pylist()) == {"ok"}
    assert len(res.meta.workers) == 2
    assert all(a["closed"] and not a["lost"] for a in res.meta.workers.values())
    # the run is the master's directory alone: its records, run.json and one sidecar per
    # worker (written by the master from their messages); the workers kept nothing once
    # acknowledged, and never wrote into the master's directory
    names = sorted(p.name for p in run_dir.iterdir())
    assert names[-2:] == ["requests", "run.json"] and len(names) == 4, names
    assert all(n.startswith("proc-") for n in names[:2])
    for w in ("w1", "w2"):
        assert not shard_files(dirs[w], recursive=True) and not list(dirs[w].rglob("run.json"))
        assert not (dirs[w] / "results").exists()
