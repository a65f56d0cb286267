"""Checks before any load: the endpoint answers, the model is served, every prompt fits its
context, and the server counts prompt tokens as the client's tokenizer does (through the engine
adapter's tokenize call). Sends no load (at most a few one-token requests when the server has no
tokenize call)."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

from kvbench import engines
from kvbench.core.errors import UserError
from kvbench.runs.auth import auth_headers

SAMPLE_PROMPTS = 3
TOKEN_COUNT_TOLERANCE = 0.01  # relative; more means the client's tokenizer is not the model's
_HTTP_ERRORS = (urllib.error.URLError, OSError, KeyError, ValueError, TypeError)


@dataclass(frozen=True)
class Checked:
    """What preflight learnt of an endpoint."""

    model: str
    max_context_tokens: int | None
    engine: str  # the adapter whose tokenize call was used


def http_json(url: str, payload: dict | None = None, headers: dict | None = None,
              timeout: float = 30.0, method: str | None = None):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


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
        req = urllib.request.Request(metrics_url, headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode("utf-8", "replace")
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
        for i, req in enumerate(wl.requests()):
            total = req.prompt_tokens + req.max_tokens
            if total > longest:
                longest, longest_id = total, req.request_id
            if i < SAMPLE_PROMPTS:
                samples.append(req)
        if ctx and longest > ctx:
            raise UserError(f"workload {wname!r}: request {longest_id} needs {longest} tokens "
                            f"(prompt plus max_tokens), more than the {ctx}-token context of "
                            f"endpoint {ep.name!r}; lower the workload's token maxima")
    adapter = adapter_for(ep, url, headers)
    check_token_counts(ep, url, model, samples, headers, adapter)
    return Checked(model, ctx, adapter.name)


def server_prompt_tokens(url: str, model: str, req, headers: dict,
                         adapter: engines.EngineAdapter) -> int | None:
    """The server's prompt token count of ``req``: the engine's tokenize call, else the usage
    of a one-token completion; None when the server tells neither."""
    body = None
    if adapter.tokenize is not None and adapter.tokenize_body is not None:
        body = adapter.tokenize_body(model, req.prompt, req.messages)
    if body is not None:
        try:
            reply = http_json(url + adapter.tokenize.path, body, headers,
                              method=adapter.tokenize.method)
            n = adapter.tokenize_count(reply) if adapter.tokenize_count else reply["count"]
            if n is not None:
                return int(n)
        except _HTTP_ERRORS:
            pass
    body = {"model": model}
    if req.messages is not None:
        body["messages"] = list(req.messages)
    else:
        body["prompt"] = req.prompt
    path = "/v1/chat/completions" if req.messages is not None else "/v1/completions"
    try:
        out = http_json(url + path, {**body, "max_tokens": 1, "stream": False}, headers,
                        timeout=120)
        return int(out["usage"]["prompt_tokens"])
    except _HTTP_ERRORS:
        return None


def check_token_counts(ep, url, model, samples, headers, adapter) -> None:
    """Warn (stderr) when the server counts prompt tokens differently from the client."""
    worst = 0.0
    for req in samples:
        server = server_prompt_tokens(url, model, req, headers, adapter)
        if server is None:
            print(f"kvbench run: warning: endpoint {ep.name!r} reports no prompt token "
                  "counts (tokenize or usage); client counts are unchecked", file=sys.stderr)
            return
        if req.prompt_tokens:
            worst = max(worst, abs(server - req.prompt_tokens) / req.prompt_tokens)
    if worst > TOKEN_COUNT_TOLERANCE:
        print(f"kvbench run: warning: endpoint {ep.name!r} counts prompt tokens up to "
              f"{worst:.1%} differently from the client's tokenizer; configure suite.tokenizer "
              "with the model's tokenizer.json", file=sys.stderr)
