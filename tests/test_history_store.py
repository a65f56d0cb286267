"""The results store's history and its manifest (``kvbench.core.manifest``), local and on a real
S3-compatible server on 127.0.0.1 (moto's server mode, the fixture of test_results_s3): two
writers at once lose no entry; the retention keeps the newest passing run; ``kvbench history``
lists and trends an s3:// store, and ``kvbench gate --baseline last-pass`` (and last-pass:N)
resolve there from a machine with an empty cache."""

import json
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvbench.core import manifest as MF
from kvbench.core import objstore
from kvbench.core.contract import RunMeta
from kvbench.reports.analysis import history as H
from test_gate import _run
from test_results_s3 import _bucket, env, s3  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parent.parent
DAY = 86400 * 10**9
T0 = 1_780_000_000 * 10**9


def _rows(i: int) -> list[dict]:
    return [{"endpoint": "e", "request_class": "*", "metric": "goodput_rps", "value": i},
            {"endpoint": "e", "workload": "chat", "request_class": "*",
             "metric": "ttft_p99", "value": i / 10},
            {"endpoint": "e", "workload": "chat", "request_class": "*",
             "metric": "capacity_rps", "value": 2.0 * i}]


def _write_many(where, writer: int, n: int, verdict="pass") -> None:
    for i in range(n):
        run_id = f"w{writer}-r{i:03d}"
        meta = RunMeta(run_id=run_id, suite="nightly", started_ns=T0 + (i * 2 + writer) * DAY)
        H.record_run(where, meta, f"/nowhere/{run_id}", _rows(i), verdict)
        if i % 5 == 4:
            MF.rebuild_index(MF.Store.of(where))  # a compaction racing the other writer


def _proc(root: str, writer: int, n: int) -> None:
    _write_many(root, writer, n)


def test_two_local_writers_at_once_lose_no_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_proc, args=(str(tmp_path), w, 15)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        assert p.exitcode == 0
    got = H.entries(tmp_path, "nightly")
    assert sorted(e["run_id"] for e in got) == sorted(
        f"w{w}-r{i:03d}" for w in (0, 1) for i in range(15))
    assert [e["started_ns"] for e in got] == sorted(e["started_ns"] for e in got)
    # each run's history file is there and readable
    assert H.read_history(tmp_path).groupby("run_id").ngroups == 30


def test_two_s3_writers_at_once_lose_no_entry(s3, env):
    bucket = _bucket(s3, "kvb-hist-conc")
    loc = objstore.parse(f"s3://{bucket}/nightly", {"endpoint_url": s3})
    threads = [threading.Thread(target=_write_many, args=(loc, w, 10)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    got = H.entries(loc, "nightly")
    assert sorted(e["run_id"] for e in got) == sorted(
        f"w{w}-r{i:03d}" for w in (0, 1) for i in range(10))
    names = MF.Store.of(loc).list("history")
    assert sum(n.endswith(".parquet") for n in names) == 20
    assert any(n.startswith("_manifest/suite=nightly/") for n in names)


def test_a_new_verdict_is_a_new_entry_and_the_newest_wins(tmp_path):
    meta = RunMeta(run_id="r1", suite="s", started_ns=T0)
    H.record_run(tmp_path, meta, tmp_path / "r1", _rows(1), "accepted")
    time.sleep(0.01)
    H.record_run(tmp_path, meta, tmp_path / "r1", _rows(1), "fail")
    listing = MF.list_entries(MF.Store.of(tmp_path))
    assert len(listing.newest) == 1 and len(listing.superseded) == 1
    [e] = H.entries(tmp_path)
    assert e["verdict"] == "fail"
    assert e["figures"] == [{"endpoint": "e", "workload": "*", "goodput_rps": 1.0},
                            {"endpoint": "e", "workload": "chat", "capacity_rps": 2.0,
                             "ttft_p99": 0.1}]
    # the index is only a cache: a stale or damaged one changes nothing
    MF.rebuild_index(MF.Store.of(tmp_path))
    (tmp_path / MF.INDEX).write_text("{not json")
    assert H.entries(tmp_path)[0]["verdict"] == "fail"


def test_limit_reads_only_the_newest_entries(tmp_path, monkeypatch):
    _write_many(tmp_path, 0, 12)
    (tmp_path / MF.INDEX).unlink()
    read = []
    real = MF.read_entry
    monkeypatch.setattr(MF, "read_entry", lambda st, name: read.append(name) or real(st, name))
    got = H.entries(tmp_path, "nightly", limit=3)
    assert [e["run_id"] for e in got] == ["w0-r009", "w0-r010", "w0-r011"]
    assert len(read) == 3


def test_retention_keeps_the_newest_runs_and_the_last_pass(tmp_path):
    store = tmp_path / "store"
    for i in range(6):
        rid = f"n{i}"
        (store / rid).mkdir(parents=True)
        (store / rid / "run.json").write_text("{}")
        meta = RunMeta(run_id=rid, suite="s", started_ns=T0 + i * DAY)
        H.record_run(store, meta, store / rid, _rows(i), "pass" if i < 2 else "fail")
    dropped = MF.prune(MF.Store.of(store), keep_runs=2)
    assert sorted(e["run_id"] for e in dropped) == ["n0", "n2", "n3"]
    assert [e["run_id"] for e in H.entries(store)] == ["n1", "n4", "n5"]  # n1: last pass
    assert len(list((store / "history").rglob("*.parquet"))) == 3
    assert (store / "n0" / "run.json").exists()  # run folders only when asked
    dropped = MF.prune(MF.Store.of(store), keep_days=0.5, runs_too=True,
                       now_ns=T0 + 5 * DAY + 1)
    assert [e["run_id"] for e in dropped] == ["n4"]
    assert not (store / "n4").exists() and (store / "n5").exists()


def _kv(env, *args):
    return subprocess.run([sys.executable, "-m", "kvbench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_history_and_last_pass_on_s3_from_an_empty_cache(tmp_path, s3, env):
    bucket = _bucket(s3, "kvb-hist-e2e")
    loc = objstore.parse(f"s3://{bucket}/nightly", {"endpoint_url": s3})
    url = f"s3://{bucket}/nightly?endpoint_url={s3}"
    local = tmp_path / "made"
    for name, seed, slow in (("base", 11, 1.0), ("same", 12, 1.0), ("slow", 13, 1.3)):
        objstore.upload_run(_run(local, name, seed, slow=slow, n=1500), loc, name)

    def cache(i):  # another machine: nothing cached
        return dict(env, XDG_CACHE_HOME=str(tmp_path / f"cache{i}"), AWS_ENDPOINT_URL=s3)

    p = _kv(cache(1), "history", "--results-dir", url, "--accept", "base")
    assert p.returncode == 0 and "accepted" in p.stdout, p.stdout + p.stderr
    p = _kv(cache(2), "gate", "--baseline", "last-pass", "--current",
            f"s3://{bucket}/nightly/same", "--results-dir", f"s3://{bucket}/nightly")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "/base" in p.stdout.splitlines()[-1]
    p = _kv(cache(3), "gate", "--baseline", "last-pass", "--current",
            f"s3://{bucket}/nightly/slow", "--results-dir", f"s3://{bucket}/nightly")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "/same" in p.stdout.splitlines()[-1]  # the newest pass, gated on machine 2
    p = _kv(cache(4), "gate", "--baseline", "last-pass:2", "--current",
            f"s3://{bucket}/nightly/slow", "--results-dir", f"s3://{bucket}/nightly",
            "--no-history")
    assert p.returncode == 1, p.stdout + p.stderr
    last = p.stdout.splitlines()[-1]
    assert "/base" in last and "/same" in last
    # history lives in the store: nothing of it in any cache folder
    assert not list(tmp_path.glob("cache*/**/_manifest"))
    html = tmp_path / "h.html"
    p = _kv(cache(5), "history", "--results-dir", url, "--plot", str(html))
    assert p.returncode == 0, p.stderr
    verdicts = {ln.split()[2]: ln.split()[4] for ln in p.stdout.splitlines()[1:-1]}
    assert verdicts == {"base": "accepted", "same": "pass", "slow": "fail"}, p.stdout
    assert "kvbench history" in html.read_text() and "TPOT p99" in html.read_text()
    p = _kv(cache(5), "history", "--results-dir", url, "--trend")
    head, *lines = p.stdout.splitlines()
    assert head.split()[:7] == ["date", "run_id", "verdict", "endpoint", "workload",
                                "capacity_rps", "ttft_p99"], p.stdout
    assert {ln.split()[2] for ln in lines} == {"base", "same", "slow"} and len(lines) >= 3
    p = _kv(cache(6), "history", "--results-dir", url, "--prune", "--keep", "1")
    assert p.returncode == 0 and "pruned 1 run(s)" in p.stdout and "base" in p.stdout, p.stdout
    assert [e["run_id"] for e in H.entries(loc)] == ["same", "slow"]
    assert objstore.complete(loc, "base") is not None  # the run itself stays


def test_a_store_of_an_older_kvbench_gets_its_manifest(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    part = tmp_path / "history" / "suite=s" / "date=2026-05-28"
    part.mkdir(parents=True)
    pq.write_table(pa.table({"run_id": ["old"], "suite": ["s"], "started_ns": [T0],
                             "run_path": [str(tmp_path / "old")], "endpoint": ["e"],
                             "request_class": ["*"], "metric": ["ttft_p99"], "value": [0.5],
                             "verdict": ["pass"]}), part / "old.parquet")
    [e] = H.entries(tmp_path)
    assert e["run_id"] == "old" and e["verdict"] == "pass"
    assert H.recent_runs(tmp_path)["ttft_p99"].tolist() == [0.5]
    assert json.loads(next((tmp_path / MF.MANIFEST).rglob("*.json")).read_text())["run"] == str(
        tmp_path / "old")


def test_the_gate_applies_the_configs_retention_after_recording(tmp_path):
    from types import SimpleNamespace

    from kvbench.commands import gate as G

    for i in range(4):
        meta = RunMeta(run_id=f"g{i}", suite="s", started_ns=T0 + i * DAY)
        G._record(H, tmp_path, SimpleNamespace(meta=meta), tmp_path / f"g{i}", _rows(i),
                  "pass" if i == 0 else "fail", {"keep_runs": 2, "keep_days": None})
    assert [e["run_id"] for e in H.entries(tmp_path)] == ["g0", "g2", "g3"]
    assert json.loads((tmp_path / MF.INDEX).read_text())["version"] == MF.VERSION
