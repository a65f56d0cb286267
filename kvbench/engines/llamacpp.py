"""llama.cpp ``llama-server`` (run with ``--metrics``); no KV-usage gauge (per-slot state is at
``/slots``).

Checked against a real llama-server (vendor/llama.cpp 0c1e570, tests/data/llamacpp):
``prompt_tokens_total`` counts only the prompt tokens the server computed ("excluding cached
tokens"), ``prompt_tokens_cached_total`` the reused ones; a 562-token prompt sent twice moved them
by +562/+0, then +1/+561, and each response's ``cached_tokens`` equalled the cached counter's
increase. So the hit ratio is cached / (cached + prompt_tokens_total)."""

from __future__ import annotations

from kvbench.engines.base import EngineAdapter, HttpCall, register


def tokenize_body(model: str, prompt: str | None, messages: list | None) -> dict | None:
    """llama-server's /tokenize takes plain text as ``content``; chat messages would need the
    model's chat template, so they are not tokenized here (None: the caller falls back)."""
    if messages is not None:
        return None
    return {"content": prompt}


def tokenize_count(reply: dict) -> int | None:
    """The reply is ``{"tokens": [...]}`` without a count."""
    tokens = reply.get("tokens")
    return len(tokens) if isinstance(tokens, list) else None


def slot_ids(reply) -> list[int]:
    """The slot ids in ``GET /slots``'s reply (a list of slot objects with an ``id``)."""
    if not isinstance(reply, list):
        return []
    return [int(s["id"]) for s in reply if isinstance(s, dict) and "id" in s]


LLAMACPP = register(EngineAdapter(
    name="llamacpp", title="llama.cpp llama-server", prefixes=("llamacpp:",),
    prefix_hits="llamacpp:prompt_tokens_cached_total",
    prefix_queries="llamacpp:prompt_tokens_total",
    queries_exclude_hits=True,
    default_block_tokens=1,  # a slot reuses its cached prompt token by token (the test above)
    prompt_tokens=None,  # prompt_tokens_total counts computed tokens only (cache misses)
    generation_tokens="llamacpp:tokens_predicted_total",
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    tokenize=HttpCall("POST", "/tokenize"), tokenize_body=tokenize_body,
    tokenize_count=tokenize_count,
    list_slots=HttpCall("GET", "/slots", "disabled by --no-slots"),
    slot_ids=slot_ids,
    reset_cache=HttpCall("POST", "/slots/{slot}?action=erase",
                         "needs --slot-save-path (501 without); a prefix the host-RAM prompt "
                         "cache still holds comes back after it unless --cache-ram 0"),
    notes=("metrics need --metrics", "prefix reuse is per slot (-np N slots)"),
))
