"""Preflight's engine adapter: the endpoint's ``engine`` when set, else detected from one GET of
its /metrics, else vLLM's; the token-count check goes through the adapter's tokenize call."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from kvbench.core.errors import UserError
from kvbench.runs import preflight


class _Handler(BaseHTTPRequestHandler):
    metrics = "kvbench:kv_blocks_used 3\nvllm:num_requests_running 0\n"

    def do_GET(self):
        if self.path != "/metrics" or not self.metrics:
            self.send_error(404)
            return
        self._reply(self.metrics.encode(), "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, body))
        if self.path == "/tokenize":
            self._reply(json.dumps({"count": len(body["prompt"].split())}).encode(),
                        "application/json")
        else:
            self.send_error(404)

    def _reply(self, data: bytes, ctype: str):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def ep(**kw):
    return SimpleNamespace(name="e", metrics_url=None, **kw)


def test_adapter_from_config_then_metrics_then_vllm(server, monkeypatch):
    srv, url = server
    assert preflight.adapter_for(ep(engine="vllm"), url).name == "vllm"
    assert preflight.adapter_for(ep(), url).name == "builtin"  # kvbench: names win
    monkeypatch.setattr(_Handler, "metrics", "")
    assert preflight.adapter_for(ep(engine="auto"), url).name == "vllm"
    with pytest.raises(UserError, match="engine 'nope' is unknown"):
        preflight.adapter_for(ep(engine="nope"), url)


def test_prompt_tokens_through_the_adapters_tokenize_call(server):
    srv, url = server
    adapter = preflight.adapter_for(ep(), url)
    req = SimpleNamespace(prompt="one two three", messages=None)
    assert preflight.server_prompt_tokens(url, "m", req, {}, adapter) == 3
    assert srv.seen == [("/tokenize", {"model": "m", "prompt": "one two three"})]
