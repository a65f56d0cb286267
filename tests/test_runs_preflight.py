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


# --- preflight never warms the cache it then measures (a fake llama-server that logs every body)

import os.path  # noqa: E402
from pathlib import Path  # noqa: E402

from kvbench.config import parse_config  # noqa: E402
from kvbench.workloads.registry import make_workload  # noqa: E402
from kvbench.workloads.tokenizer import get_tokenizer, render_chat_builtin  # noqa: E402

LLAMA_DATA = Path(__file__).resolve().parent / "data" / "llamacpp"
TOK = get_tokenizer()


class _Llama(BaseHTTPRequestHandler):
    """llama-server's dialect (tests/data/llamacpp): /tokenize takes ``content`` and answers a
    token list without a count ({"tokens": []} to any other body); usage counts with
    ``scale`` x the built-in tokenizer (1: the client's tokenizer is the model's); ``status``
    answers every request with that HTTP status instead."""

    metrics = (LLAMA_DATA / "01_start.metrics.txt").read_text()
    scale = 1.0
    status = 200

    def do_GET(self):
        if self.status != 200:
            return self._json({"error": {"message": "Invalid API Key"}}, self.status)
        if self.path == "/v1/models":
            return self._json(json.loads((LLAMA_DATA / "14_v1_models.body").read_text()))
        if self.path == "/metrics" and self.metrics:
            data = self.metrics.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, body))
        if self.status != 200:
            return self._json({"error": {"message": "Invalid API Key"}}, self.status)
        if self.path == "/tokenize":
            text = body.get("content")
            n = round(TOK.count(text) * self.scale) if isinstance(text, str) else 0
            return self._json({"tokens": list(range(n))})
        if self.path in ("/v1/completions", "/v1/chat/completions"):
            text = (render_chat_builtin(body["messages"]) if "messages" in body
                    else body["prompt"])
            n = round(TOK.count(text) * self.scale)
            return self._json({"choices": [{"text": "x", "finish_reason": "length"}],
                               "usage": {"prompt_tokens": n, "completion_tokens": 1}})
        self.send_error(404)

    def _json(self, obj, status=200):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def llama(monkeypatch):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Llama)
    srv.seen = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def workloads():
    cfg = parse_config({
        "endpoints": [{"name": "e", "kind": "openai", "url": "http://x", "model": "tiny-llama"}],
        "workloads": {
            "chat": {"kind": "chat", "requests": 6},
            "agent": {"kind": "agent", "sessions": 2},
            "rag": {"kind": "rag", "requests": 6, "api": "completions"},
            "longctx": {"kind": "longctx", "contracts": 2, "questions_per_contract": 3,
                        "api": "completions"},
        },
        "profiles": {"closed": {"pacing": "closed", "stages": [{"users": 1, "duration_s": 1}]}},
    }, "test.toml")
    return {n: make_workload(n, cfg) for n in cfg.workloads}


def texts(req_or_body) -> list[str]:
    """The prompt, or each message's content, of a request or a request body."""
    get = (lambda k: req_or_body.get(k)) if isinstance(req_or_body, dict) else (
        lambda k: getattr(req_or_body, k))
    if get("messages") is not None:
        return [m.get("content") or "" for m in get("messages")]
    return [get("prompt")]


def shares_a_prefix(sent: str, workload_text: str) -> bool:
    """True when ``sent`` begins with at least one whole word of ``workload_text``."""
    shared = os.path.commonprefix([sent, workload_text])
    return bool(shared.strip()) and (shared == workload_text or
                                     not workload_text[len(shared):][:1].isalnum() or
                                     " " in shared.strip())


def completions_sharing_a_prefix(seen, wls) -> int:
    """Completions the server received whose prompt (or first message) shares a prefix with
    a workload request's."""
    firsts = [texts(r)[0] for wl in wls.values() for r in wl.requests()]
    n = 0
    for path, body in seen:
        if path.endswith("/completions"):
            sent = texts(body)[0]
            n += any(shares_a_prefix(sent, w) for w in firsts)
    return n


@pytest.mark.parametrize("with_metrics", [True, False])
def test_preflight_never_sends_a_workload_prompt_as_a_completion(llama, monkeypatch,
                                                                 with_metrics, capsys):
    srv, url = llama
    monkeypatch.setattr(_Llama, "metrics", _Llama.metrics if with_metrics else "")
    wls = workloads()
    c = preflight.check(SimpleNamespace(name="llama", model="tiny-llama", engine="auto",
                                        metrics_url=None, max_context_tokens=None,
                                        api_key_env=None, headers=None), url, wls)
    assert c.engine == ("llamacpp" if with_metrics else "vllm")
    completions = [b for p, b in srv.seen if p.endswith("/completions")]
    assert completions_sharing_a_prefix(srv.seen, wls) == 0
    # chat requests cannot be tokenized by llama-server: each is checked with a probe
    assert len(completions) == 6  # 3 samples x 2 chat workloads
    for body in completions:
        assert texts(body)[0].startswith(preflight.PROBE_HEADER) and body["max_tokens"] == 1
    # completions-API workloads were counted by /tokenize (content), never sent as completions
    tokenized = [b["content"] for p, b in srv.seen if p == "/tokenize" and "content" in b]
    assert len(tokenized) == 6
    assert "warning" not in capsys.readouterr().err  # counts agree: no mismatch reported


def test_old_behaviour_would_have_sent_workload_prompts(llama):
    # the measure itself: a completion carrying a workload's own first message is counted
    srv, url = llama
    wls = workloads()
    req = next(iter(wls["chat"].requests()))
    srv.seen.append(("/v1/chat/completions", {"messages": list(req.messages)}))
    assert completions_sharing_a_prefix(srv.seen, wls) == 1


def test_probe_mismatch_is_reported_with_its_size(llama, monkeypatch, capsys):
    srv, url = llama
    monkeypatch.setattr(_Llama, "scale", 2.0)
    wls = {"chat": workloads()["chat"]}
    preflight.check(SimpleNamespace(name="llama", model="tiny-llama", engine="llamacpp",
                                    metrics_url=None, max_context_tokens=None,
                                    api_key_env=None, headers=None), url, wls)
    err = capsys.readouterr().err
    assert "counts prompt tokens up to 100.0% differently" in err and "suite.tokenizer" in err


def test_probe_shares_no_prefix_and_counts_with_the_clients_tokenizer():
    for wl in workloads().values():
        for i, req in enumerate(wl.requests()):
            if i == 3:
                break
            prompt, messages, n = preflight.probe_for(req, wl.tokenizer, i)
            probe = prompt if messages is None else messages[0]["content"]
            assert probe.startswith(f"{preflight.PROBE_HEADER} {i}:")
            assert n == (TOK.count(prompt) if messages is None else TOK.count_chat(messages))
            words = texts(req)[0].split()[:preflight.PROBE_MAX_WORDS]
            assert probe.split()[4:] == words[::-1]  # same vocabulary, reversed


@pytest.mark.parametrize("status", [401, 403])
def test_refused_credentials_stop_preflight_with_a_sentence(llama, monkeypatch, status):
    srv, url = llama
    monkeypatch.setattr(_Llama, "status", status)
    monkeypatch.setenv("LLAMA_KEY", "k")
    ep = SimpleNamespace(name="llama", model="tiny-llama", engine="llamacpp", metrics_url=None,
                         max_context_tokens=None, api_key_env="LLAMA_KEY", headers=None)
    with pytest.raises(UserError) as err:
        preflight.check(ep, url, {"chat": workloads()["chat"]})
    msg = str(err.value)
    assert msg.startswith(f"endpoint 'llama' at {url} answered HTTP {status}")
    assert "GET /v1/models" in msg and "$LLAMA_KEY was sent" in msg
    assert msg.endswith("check api_key_env / headers of its [[endpoints]] entry")


def test_refused_on_tokenize_or_completion_also_stops(llama, monkeypatch):
    # /v1/models open, the rest behind the key (a gateway that lists models publicly)
    srv, url = llama
    orig = _Llama.do_POST

    def post(self):
        self.status = 401
        orig(self)

    monkeypatch.setattr(_Llama, "do_POST", post)
    ep = SimpleNamespace(name="llama", model="tiny-llama", engine="llamacpp", metrics_url=None,
                         max_context_tokens=None, api_key_env=None, headers=None)
    with pytest.raises(UserError, match=r"answered HTTP 401 .* to POST /tokenize \(no API key "
                                        r"was sent \(api_key_env is not set\)\)"):
        preflight.check(ep, url, {"rag": workloads()["rag"]})
    assert srv.seen[-1][0] == "/tokenize"  # stopped at the first refusal
