"""A loopback server answering every request with one fixed status (and /v1/models with a
model list), counting what it got; and a runner for a real ``locust -f`` in a given folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class StatusServer:
    """127.0.0.1, port 0: POST answers ``status`` (with a small JSON error); GET /v1/models
    lists ``models``."""

    def __init__(self, status: int, models=("served-model",)) -> None:
        self.posts = 0
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/").endswith("/v1/models"):
                    self._send(200, {"data": [{"id": m} for m in models]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                with outer.lock:
                    outer.posts += 1
                self._send(status, {"error": {"message": f"status {status}"}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def locust(cwd: Path, locustfile: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``locust -f loadgen/<locustfile>`` run in ``cwd`` (as a user runs it), headless."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBENCH_", "LOCUST_"))}
    return subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / locustfile), *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def free_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port  # nothing listens there now: a dead port
