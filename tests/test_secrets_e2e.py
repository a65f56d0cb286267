"""Secrets are never written: a server that echoes the API key and every header in its 401 body,
driven through ``kvbench run``, a plain ``locust -f`` run (its log, CSVs and HTML) and
``kvbench report``; then every file written and every line printed is searched for the planted
values (Parquet decoded, not only its raw bytes). The count of hits must be 0."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest

ROOT = Path(__file__).resolve().parent.parent
KEY_ENV = "KVB_PLANTED_KEY"
_TAG = secrets.token_hex(6)
KEY = f"sk-plantedKEY-{_TAG}"  # api_key_env's value
PASSWORD = f"pw-planted2-{_TAG}"  # inline X-Password
CUSTOM = f"sk-planted3-{_TAG}"  # inline X-Custom: Bearer <CUSTOM>
URL_PASSWORD = f"planted4pw{_TAG}"  # http://user:<URL_PASSWORD>@host
PLANTED = {"api_key_env": KEY, "X-Password": PASSWORD, "X-Custom": CUSTOM,
           "url password": URL_PASSWORD}


class _Handler(BaseHTTPRequestHandler):
    """/v1/models and /tokenize answer (preflight passes); streaming completions get 401 with
    the key and the other header values echoed, as some gateways do; under /deny everything
    gets that 401."""

    protocol_version = "HTTP/1.1"
    denied = 0

    def log_message(self, *a):  # quiet
        pass

    def _send(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _deny(self) -> None:
        type(self).denied += 1
        h = self.headers
        self._send(401, {"error": {
            "message": f"Incorrect API key provided: {h.get('Authorization')}. "
                       f"x-password={h.get('X-Password')} x-custom={h.get('X-Custom')}",
            "type": "invalid_request_error", "code": "invalid_api_key"}})

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def do_GET(self):
        if self.path.startswith("/deny"):
            return self._deny()
        if self.path == "/v1/models":
            return self._send(200, {"data": [{"id": "m", "max_model_len": 200000}]})
        self._send(404, {"error": "not found"})

    def do_POST(self):
        body = self._body()
        if self.path.startswith("/deny") or body.get("stream"):
            return self._deny()
        from kvbench.workloads.tokenizer import get_tokenizer, render_chat_builtin

        text = (render_chat_builtin(body["messages"]) if "messages" in body
                else body.get("prompt") or "")
        n = get_tokenizer("builtin").count(text)
        if self.path == "/tokenize":
            return self._send(200, {"count": n, "tokens": list(range(n)),
                                    "max_model_len": 200000})
        self._send(200, {"id": "x", "object": "text_completion", "model": "m",
                         "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": n, "completion_tokens": 1,
                                   "total_tokens": n + 1}})


CONFIG = """
[suite]
name = "sec"
results_dir = "{results}"
workloads = ["chat"]
profile = "closed"

[[endpoints]]
name = "vendor"
kind = "openai"
url = "{url}"
metrics_url = "http://kvuser:{url_password}@{host}/metrics"
model = "m"
api_key_env = "{key_env}"
headers = {{ X-Password = "{password}", X-Custom = "Bearer {custom}", x-route = "eu" }}

[workloads.chat]
kind = "chat"
requests = 20
prompt_tokens = {{ dist = "constant", mean = 30 }}
output_tokens = {{ dist = "constant", mean = 4 }}

[workloads.longctx]
kind = "longctx"
contracts = 1
questions_per_contract = 2
contract_tokens = {{ dist = "constant", mean = 200 }}

[profiles.closed]
pacing = "closed"
stages = [ {{ users = 1, duration_s = 2 }} ]
"""


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _config(tmp: Path, name: str, url: str) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(CONFIG.format(results=tmp / "results", url=url, key_env=KEY_ENV,
                                  password=PASSWORD, custom=CUSTOM, url_password=URL_PASSWORD,
                                  host=url.split("://", 1)[1]))
    return path


def _env() -> dict:
    return {**os.environ, KEY_ENV: KEY, "PYTHONUNBUFFERED": "1"}


def _run(cmd: list, tmp: Path, name: str, timeout: float = 180) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=_env(),
                       timeout=timeout)
    (tmp / "out").mkdir(exist_ok=True)
    (tmp / "out" / f"{name}.stdout").write_text(p.stdout)
    (tmp / "out" / f"{name}.stderr").write_text(p.stderr)
    return p


def _texts(path: Path) -> list[str]:
    """The file's bytes as text, and for Parquet every value decoded too."""
    out = [path.read_bytes().decode("utf-8", "replace")]
    if path.suffix == ".parquet":
        try:
            t = pq.read_table(path)
        except Exception:  # noqa: BLE001 - a shard being written: its raw bytes still count
            return out
        out.append(json.dumps(t.to_pylist(), default=str))
    return out


def hits(tmp: Path) -> dict[str, dict[str, int]]:
    """file -> {planted name: occurrences} over every file under ``tmp``."""
    found: dict[str, dict[str, int]] = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file() and not p.is_symlink()):
        if path.suffix == ".toml":  # the config the user wrote holds the inline headers
            continue
        texts = _texts(path)
        for what, value in PLANTED.items():
            n = sum(t.count(value) for t in texts)
            if n:
                found.setdefault(str(path.relative_to(tmp)), {})[what] = n
    return found


def test_no_planted_secret_in_any_output_of_run_locust_and_report(server, tmp_path):
    cfg = _config(tmp_path, "bench", server)
    kv = [sys.executable, "-m", "kvbench"]
    run = _run(kv + ["run", "--config", str(cfg), "--run-id", "kvrun"], tmp_path, "kvbench-run")
    run_dir = tmp_path / "results" / "kvrun"
    # the same endpoint driven by a plain Locust run, with its own log, CSVs and HTML
    loc = tmp_path / "locust"
    loc.mkdir()
    lrun = _run([sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / "longctx.py"),
                 "--headless", "--host", server, "-u", "1", "-r", "1", "-t", "2s",
                 "--kvbench-config", str(cfg), "--kvbench-endpoint", "vendor",
                 "--kvbench-results", str(tmp_path / "results"), "--kvbench-run-id", "plain",
                 "--csv", str(loc / "stats"), "--csv-full-history", "--html",
                 str(loc / "locust.html"), "--logfile", str(loc / "locust.log")],
                tmp_path, "locust")
    assert (loc / "stats_failures.csv").exists(), lrun.stderr[-2000:]
    # and with no config at all: only the key, from --kvbench-api-key-env
    bare = tmp_path / "bare"
    bare.mkdir()
    brun = _run([sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / "longctx.py"),
                 "--headless", "--host", server, "-u", "1", "-r", "1", "-t", "2s",
                 "--kvbench-workload", "chat", "--kvbench-api-key-env", KEY_ENV,
                 "--kvbench-results", str(tmp_path / "results"), "--kvbench-run-id", "bare",
                 "--csv", str(bare / "stats"), "--html", str(bare / "locust.html")],
                tmp_path, "locust-bare")
    assert (bare / "stats_failures.csv").exists(), brun.stderr[-2000:]
    for rid in ("kvrun", "plain", "bare"):
        rep = _run(kv + ["report", str(tmp_path / "results" / rid), "-o",
                         str(tmp_path / f"report-{rid}.html")], tmp_path, f"report-{rid}")
        assert rep.returncode == 0, rep.stderr[-2000:]
    # preflight errors: everything denied, and a url with credentials
    deny = tmp_path / "deny.toml"
    deny.write_text(cfg.read_text().replace(f'url = "{server}"', f'url = "{server}/deny"'))
    _run(kv + ["run", "--config", str(deny), "--run-id", "deny"], tmp_path, "kvbench-deny")
    creds = tmp_path / "creds.toml"
    creds.write_text(cfg.read_text().replace(
        f'url = "{server}"', f'url = "http://kvuser:{URL_PASSWORD}@{server[7:]}"'))
    pc = _run(kv + ["run", "--config", str(creds), "--run-id", "creds"], tmp_path,
              "kvbench-creds")

    # the runs did reach the error path the secrets travel in
    # every request refused: the run stops on its run of 401s (issue 33), records kept
    assert run.returncode == 2 and "the server refused the credentials" in run.stderr, \
        run.stderr[-2000:]
    assert _Handler.denied > 10
    rows = read_run_table(run_dir, "requests").to_pylist()
    errors = [r["error"] for r in rows if r["status"] == "http_error"]
    assert errors and all(e.startswith("HTTP 401: Incorrect API key provided: Bearer ")
                          for e in errors)
    for d in (loc, bare):
        assert "Incorrect API key provided: Bearer <redacted>" in \
            (d / "stats_failures.csv").read_text()
    assert pc.returncode == 2 and "kvbench: error:" in pc.stderr  # preflight names the url
    assert "scrape of http://<redacted>@" in run.stderr  # its metrics_url has a password

    found = hits(tmp_path)
    table = "\n".join(f"  {f}: {h}" for f, h in found.items())
    assert not found, f"planted secrets written:\n{table}"
