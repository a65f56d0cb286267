"""kvbench's tab in Locust's web UI, in headless Chromium, during a real Locust run (web UI on
127.0.0.1) against the built-in disaggregated endpoint with the collectors scraping its
/metrics: the tab and the /kvbench page render, update, log no console error and fetch nothing
but from the Locust web UI. Also a distributed run's master (two worker processes) serving the
workers' live summaries. Screenshots go to test-artifacts/ (ignored by git, like report.png)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbench.collectors.session import start_collectors
from kvbench.config import CollectConfig
from kvbench.runs import builtin
from kvbench.runs.locust import free_port
from browser import CHROMIUM, browser_or_skip

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[suite]
name = "live"
seed = 3

[[endpoints]]
name = "builtin-pd"
kind = "openai"
url = "{url}"
metrics_url = "{url}/metrics"
topology = "disaggregated"

[workloads.chat]
kind = "chat"
requests = 2000
prompt_tokens = {{ dist = "constant", mean = 300 }}
output_tokens = {{ dist = "constant", mean = 24 }}

[workloads.rag]
kind = "rag"
requests = 2000
documents = 8
chunk_tokens = {{ dist = "constant", mean = 200 }}
output_tokens = {{ dist = "constant", mean = 16 }}

[workloads.mix]
kind = "mix"
requests = 2000
components = [ {{ workload = "chat", weight = 1 }}, {{ workload = "rag", weight = 1 }} ]

[profiles.ladder]
pacing = "poisson"
stages = [ {{ rate_rps = 6.0, duration_s = 20 }}, {{ rate_rps = 12.0, duration_s = 20 }} ]

[slo.chat]
ttft_ms = 400
tpot_ms = 40

[slo.rag]
ttft_ms = 600
"""


@pytest.fixture(scope="module")
def endpoint():
    proc, url = builtin.start(SimpleNamespace(name="builtin-pd", topology="disaggregated",
                                              options={}))
    yield url
    builtin.stop(proc)


@pytest.fixture(scope="module")
def config(endpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "bench.toml"
    path.write_text(CONFIG.format(url=endpoint))
    return path


def start_locust(endpoint, config, results, run_id, port, *extra, seconds=40, users=1):
    return subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", "loadgen/mix.py", "--host", endpoint,
         "--web-host", "127.0.0.1", "--web-port", str(port), "--autostart", "-u", str(users),
         "-r", str(users),
         "-t", f"{seconds}s", "--kvbench-config", str(config), "--kvbench-results", str(results),
         "--kvbench-run-id", run_id, "--kvbench-endpoint", "builtin-pd",
         "--kvbench-pacing", "poisson", "--kvbench-rates", "6,12",
         "--kvbench-stage-duration", str(seconds // 2), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_for(fn, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while True:
        try:
            got = fn()
        except OSError:
            got = None
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(0.3)


def finish(proc):
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def test_kvbench_tab_in_chromium_during_a_run(endpoint, config, tmp_path):
    sync_api = browser_or_skip()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "live-tab"
    collectors = start_collectors(
        run_dir, CollectConfig(nvml=False, scrape_interval_s=0.5),
        [{"name": "builtin-pd", "url": endpoint, "metrics_url": f"{endpoint}/metrics",
          "topology": "disaggregated"}], log=lambda m: None)
    proc = start_locust(endpoint, config, tmp_path, "live-tab", port)
    errors, requests = [], []
    try:
        wait_for(lambda: get_json(f"{base}/kvbench/live.json")["rows"])
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM,
                                        args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1500, "height": 1000})
                page.on("console", lambda m: m.type == "error" and errors.append(m.text))
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("request", lambda r: requests.append(r.url))
                page.on("response", lambda r: r.status >= 400 and errors.append(
                    f"{r.status} {r.url}"))
                # Locust's own UI, its statistics (relabelled Aggregated row), then our tab
                page.goto(f"{base}/?tab=stats")
                page.wait_for_selector("text=Aggregated (mixes e2e, ttft, tpot", timeout=30_000)
                page.goto(f"{base}/?tab=kvbench")
                page.wait_for_selector("text=since start", timeout=30_000)
                assert page.locator("th", has_text="TTFT p50 ms").count() == 1
                assert page.locator("td", has_text="builtin-pd").count() >= 2
                page.screenshot(path=str(_art("live-locust-tab.png")), full_page=True)
                # the page with the charts: it refreshes itself and the numbers move
                page.goto(f"{base}/kvbench")
                page.wait_for_function("Number(document.body.dataset.refreshes || 0) >= 1",
                                       timeout=30_000)
                first = _requests_shown(page)
                page.wait_for_function(
                    "Number(document.body.dataset.refreshes) >= 4 && "
                    "document.querySelectorAll('#gpus tbody tr').length >= 2", timeout=40_000)
                assert _requests_shown(page) > first
                assert page.locator("#metrics tbody tr").count() >= 4  # 2 classes x 2 spans
                assert page.locator("svg polyline").count() >= 5
                roles = page.locator("#gpus tbody td.l").all_inner_texts()
                assert {"prefill", "decode"} <= set(roles), roles
                kv = page.locator("#engines tbody tr td:nth-child(3)").first.inner_text()
                assert kv.endswith("%"), kv
                page.screenshot(path=str(_art("live-tab.png")), full_page=True)
            finally:
                browser.close()
    finally:
        out = finish(proc)
        collectors.stop(compact=False)
    assert errors == [], errors
    assert requests and all(u.startswith(base + "/") for u in requests), \
        [u for u in requests if not u.startswith(base)]
    assert "Traceback" not in out, out[-3000:]


def _requests_shown(page) -> int:
    cells = page.locator("#metrics tbody tr.window td:nth-child(4)").all_inner_texts()
    return sum(int(c) for c in cells)


def _art(name: str) -> Path:
    art = ROOT / "test-artifacts"
    art.mkdir(exist_ok=True)
    return art / name


def test_master_of_a_distributed_run_serves_its_workers_summaries(endpoint, config, tmp_path):
    port = free_port()
    master = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_locust(endpoint, config, tmp_path, "live-dist", port, "--processes", "2",
                        "--master-bind-host", "127.0.0.1", "--master-bind-port", str(master),
                        "--master-port", str(master), seconds=20, users=2)
    try:
        d = wait_for(lambda: (lambda s: s if s["workers"] == 2 and sum(
            r["since"]["done"] for r in s["rows"]) >= 10 else None)(
                get_json(f"{base}/kvbench/live.json")), timeout_s=60)
        classes = {r["request_class"] for r in d["rows"]}
        assert classes == {"chat", "rag"}
        assert all(r["since"]["ttft"][0] is not None for r in d["rows"])
        stats = get_json(f"{base}/stats/requests")
        tab = stats["extended_stats"][0]
        assert tab["key"] == "kvbench" and len(tab["data"]) == 2 * len(d["rows"]) + 1
    finally:
        out = finish(proc)
    assert "Traceback" not in out, out[-3000:]



def test_kvbench_page_names_the_stage_and_its_table_fits_1400px(endpoint, config, tmp_path):
    """Before a start the page says "no stage yet" (it said "stage 0 (null users)"), then the
    stage counted from 1 with the users Locust runs, then "stopped"; at 1400 px the metrics
    table sits in a box that scrolls sideways and is not cut off by the window (issue 33)."""
    sync_api = browser_or_skip()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", "loadgen/mix.py", "--host", endpoint,
         "--web-host", "127.0.0.1", "--web-port", str(port), "--kvbench-config", str(config),
         "--kvbench-results", str(tmp_path), "--kvbench-run-id", "stage-label",
         "--kvbench-endpoint", "builtin-pd", "--kvbench-pacing", "closed"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    errors = []
    try:
        state = wait_for(lambda: get_json(f"{base}/kvbench/live.json")["state"])
        assert state["runner"] == "ready", state
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(f"{base}/kvbench")
                page.wait_for_function("Number(document.body.dataset.refreshes || 0) >= 1",
                                       timeout=30_000)
                header = page.locator("#state").inner_text()
                assert "no stage yet" in header and "null" not in header, header
                body = urllib.parse.urlencode({"user_count": 2, "spawn_rate": 2,
                                               "host": endpoint}).encode()
                urllib.request.urlopen(f"{base}/swarm", data=body, timeout=10).read()
                page.wait_for_function(
                    "document.getElementById('state').textContent.includes('2 users') && "
                    "document.querySelectorAll('#metrics tbody tr').length >= 2",
                    timeout=60_000)
                header = page.locator("#state").inner_text()
                assert "stage 1" in header and "null" not in header, header
                fit = page.evaluate("""() => {
                    const box = document.getElementById('metrics-box');
                    const table = document.getElementById('metrics');
                    return {overflow: getComputedStyle(box).overflowX,
                            boxRight: box.getBoundingClientRect().right,
                            window: document.documentElement.clientWidth,
                            pageScroll: document.documentElement.scrollWidth,
                            table: table.scrollWidth, box: box.clientWidth};
                }""")
                assert fit["overflow"] == "auto", fit
                assert fit["boxRight"] <= fit["window"], fit  # the box is not cut off
                assert fit["pageScroll"] <= fit["window"], fit  # nor is the page
                assert fit["table"] <= fit["box"], fit  # at 1400 px the table fits whole
                page.screenshot(path=str(_art("live-tab-1400.png")), full_page=True)
                urllib.request.urlopen(f"{base}/stop", data=b"", timeout=10).read()
                page.wait_for_function(
                    "document.getElementById('state').textContent.includes('stopped')",
                    timeout=60_000)
            finally:
                browser.close()
    finally:
        out = finish(proc)
    assert errors == [], errors
    assert "Traceback" not in out, out[-3000:]
