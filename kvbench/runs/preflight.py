"""Checks before any load: the endpoint answers (and accepts the credentials), the model is
served, every prompt fits its context, and the server counts prompt tokens as the client's
tokenizer does.

Preflight never warms the cache it is about to measure: workload prompts go only to a tokenize
call (the engine adapter's, then the other known dialects'), which computes nothing. Where the
server cannot tokenize a request (llama-server and chat messages, or no tokenize call at all) the
count comes from the usage of a one-token completion of a *probe*: the sample's words in reverse
order behind a ``kvbench preflight probe`` header, counted by the client's own tokenizer, so it
tests the same vocabulary and shares no prefix with any workload prompt."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from kvbench import engines
from kvbench.core.errors import UserError
from kvbench.runs.auth import auth_headers
from kvbench.workloads.tokenizer import get_tokenizer

SAMPLE_PROMPTS = 3
TOKEN_COUNT_TOLERANCE = 0.01  # relative; more means the client's tokenizer is not the model's
PROBE_MAX_WORDS = 2048  # a probe's length: enough for a ratio, cheap to prefill
PROBE_HEADER = "kvbench preflight probe"
_HTTP_ERRORS = (urllib.error.URLError, OSError, KeyError, ValueError, TypeError)


@dataclass(frozen=True)
class Checked:
    """What preflight learnt of an endpoint."""

    model: str
    max_context_tokens: int | None
    engine: str  # the adapter whose tokenize call was used


# the most a JSON answer to a preflight, cache or metadata call may hold: they are small (a
# model list, a few tokens' completion); a server that streams without end must not fill memory
MAX_JSON_BYTES = 1 << 20


def http_json(url: str, payload: dict | None = None, headers: dict | None = None,
              timeout: float = 30.0, method: str | None = None,
              max_bytes: int = MAX_JSON_BYTES):
    """One JSON call, bounded: its answer within ``timeout`` seconds in all (urllib's timeout
    alone covers only each wait for bytes, so a server that keeps sending never times out)
    and ``max_bytes`` at most. A breach raises ``TimeoutError`` or ``ValueError``, which the
    callers take as any failed call."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    deadline = time.monotonic() + timeout
    body = bytearray()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        while True:
            part = r.read1(65536)
            if not part:
                break
            body += part
            if len(body) > max_bytes:
                raise ValueError(f"{url} answered more than {max_bytes:,} bytes; a JSON "
                                 "answer here is a few KB (a server streaming without end?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} was still answering after {timeout:g} s")
    return json.loads(bytes(body))


def refused(ep, url: str, what: str, exc: urllib.error.HTTPError) -> UserError:
    """The sentence for a 401/403: stop before the whole run is sent into refusals."""
    env = getattr(ep, "api_key_env", None)
    sent = (f"the key from ${env} was sent" if env else
            "no API key was sent (api_key_env is not set)")
    return UserError(f"endpoint {ep.name!r} at {url} answered HTTP {exc.code} "
                     f"{exc.reason or ''} to {what} ({sent}); check api_key_env / headers of its "
                     "[[endpoints]] entry")


def _auth_check(ep, url: str, what: str, exc: BaseException) -> None:
    if isinstance(exc, urllib.error.HTTPError) and exc.code in (401, 403):
        raise refused(ep, url, what, exc) from None


def endpoint_headers(ep) -> dict:
    return auth_headers(getattr(ep, "headers", None), getattr(ep, "api_key_env", None),
                        f"endpoint {ep.name!r}")


def adapter_for(ep, url: str, headers: dict | None = None) -> engines.EngineAdapter:
    """The endpoint's ``engine`` when set, else detected from one GET of its /metrics, else
    vLLM's (the OpenAI-compatible servers mostly follow vLLM's tokenize call)."""
    name = getattr(ep, "engine", "auto") or "auto"
    if name != "auto":
        try:
            return engines.get(name)
        except KeyError as exc:
            raise UserError(f"endpoint {ep.name!r}: engine {name!r} is unknown; use auto or "
                            f"one of {sorted(a.name for a in engines.adapters())}") from exc
    metrics_url = getattr(ep, "metrics_url", None) or url + "/metrics"
    try:
        from kvbench.collectors.prometheus import get_bounded

        text = get_bounded(metrics_url, headers, timeout_s=10)
        found = engines.detect(_metric_names(text))
    except (urllib.error.URLError, OSError, ValueError):
        found = None
    return found or engines.get("vllm")


def _metric_names(text: str) -> set[str]:
    out = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            out.add(line.split("{", 1)[0].split(" ", 1)[0])
    return out


def check(ep, url: str, workloads: dict) -> Checked:
    """Preflight of one endpoint (a config endpoint spec) serving ``url`` for ``workloads``
    (name -> generator); raises ``UserError`` with the fix when a check fails."""
    headers = endpoint_headers(ep)
    try:
        models = http_json(url + "/v1/models", headers=headers, timeout=15)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _auth_check(ep, url, "GET /v1/models", exc)
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
        tok = getattr(wl, "tokenizer", None)
        for i, req in enumerate(wl.requests()):
            total = req.prompt_tokens + req.max_tokens
            if total > longest:
                longest, longest_id = total, req.request_id
            if i < SAMPLE_PROMPTS:
                samples.append((req, tok))
        if ctx and longest > ctx:
            raise UserError(f"workload {wname!r}: request {longest_id} needs {longest} tokens "
                            f"(prompt plus max_tokens), more than the {ctx}-token context of "
                            f"endpoint {ep.name!r}; lower the workload's token maxima")
    adapter = adapter_for(ep, url, headers)
    check_token_counts(ep, url, model, samples, headers, adapter)
    return Checked(model, ctx, adapter.name)


def _dialects(adapter: engines.EngineAdapter) -> list[engines.EngineAdapter]:
    """The adapter first, then one adapter per other tokenize request shape: an engine that
    was not recognised (no /metrics) may still speak one of them."""
    out = [adapter]
    for a in engines.adapters():
        if a.tokenize is None or a.tokenize_body is None or a is adapter:
            continue
        if all(a.tokenize_body is not b.tokenize_body or a.tokenize.path != b.tokenize.path
               for b in out):
            out.append(a)
    return out


def server_prompt_tokens(url: str, model: str, req, headers: dict,
                         adapter: engines.EngineAdapter, ep=None) -> int | None:
    """The server's prompt token count of ``req`` from a tokenize call (the engine's, then the
    other known dialects'); None when the server tokenizes it in none of them. Sends no
    completion: a workload prompt never reaches the cache here."""
    text = req.prompt if req.messages is None else None
    for a in _dialects(adapter):
        if a.tokenize is None or a.tokenize_body is None:
            continue
        body = a.tokenize_body(model, text, req.messages)
        if body is None:
            continue
        try:
            reply = http_json(url + a.tokenize.path, body, headers, method=a.tokenize.method)
            n = a.tokenize_count(reply) if a.tokenize_count else reply["count"]
        except _HTTP_ERRORS as exc:
            if ep is not None:
                _auth_check(ep, url, f"{a.tokenize.method} {a.tokenize.path}", exc)
            continue
        # 0 tokens for a non-empty prompt: a server that ignored the body's fields
        # (llama-server answers {"tokens": []} to a body without "content")
        if n is not None and isinstance(n, int) and (n > 0 or not (text or req.messages)):
            return n
    return None


def probe_for(req, tokenizer, index: int = 0):
    """A request shaped like ``req`` (same API, roles and vocabulary) that shares no prefix
    with any workload prompt: ``(prompt, messages, client_count)``."""
    tok = tokenizer or get_tokenizer()

    def words(text: str, budget: int) -> str:
        return " ".join(reversed(text.split()[:budget]))

    header = f"{PROBE_HEADER} {index}:"
    if req.messages is None:
        prompt = f"{header} {words(req.prompt or '', PROBE_MAX_WORDS)}"
        return prompt, None, tok.count(prompt)
    msgs, budget = [], PROBE_MAX_WORDS
    for m in req.messages:
        content = m.get("content")
        text = content if isinstance(content, str) else " ".join(
            p.get("text", "") for p in content or () if isinstance(p, dict))
        body = words(text, budget)
        budget = max(0, budget - len(text.split()))
        msgs.append({"role": m.get("role", "user"),
                     "content": f"{header} {body}" if not msgs else body})
    return None, msgs, tok.count_chat(msgs)


def probe_prompt_tokens(url: str, model: str, prompt, messages, headers: dict,
                        ep=None) -> int | None:
    """The usage's prompt tokens of a one-token completion of a probe (never a workload
    prompt: see ``probe_for``); None when the server reports none."""
    body = {"model": model, "max_tokens": 1, "stream": False}
    if messages is not None:
        body["messages"] = messages
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    try:
        out = http_json(url + path, body, headers, timeout=120)
        return int(out["usage"]["prompt_tokens"])
    except _HTTP_ERRORS as exc:
        if ep is not None:
            _auth_check(ep, url, f"POST {path}", exc)
        return None


def check_token_counts(ep, url, model, samples, headers, adapter) -> None:
    """Warn (stderr) when the server counts prompt tokens differently from the client.
    ``samples`` are ``(request, tokenizer)`` pairs (tokenizer None: the built-in one)."""
    worst = 0.0
    for i, sample in enumerate(samples):
        req, tok = sample if isinstance(sample, tuple) else (sample, None)
        server = server_prompt_tokens(url, model, req, headers, adapter, ep)
        client = req.prompt_tokens
        if server is None:
            prompt, messages, client = probe_for(req, tok, i)
            server = probe_prompt_tokens(url, model, prompt, messages, headers, ep)
        if server is None:
            print(f"kvbench run: warning: endpoint {ep.name!r} reports no prompt token "
                  "counts (tokenize or usage); client counts are unchecked", file=sys.stderr)
            return
        if client:
            worst = max(worst, abs(server - client) / client)
    if worst > TOKEN_COUNT_TOLERANCE:
        print(f"kvbench run: warning: endpoint {ep.name!r} counts prompt tokens up to "
              f"{worst:.1%} differently from the client's tokenizer; configure suite.tokenizer "
              "with the model's tokenizer.json", file=sys.stderr)
