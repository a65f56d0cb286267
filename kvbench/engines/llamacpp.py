"""llama.cpp ``llama-server`` (run with ``--metrics``). Names as served by the build in
``../shared/ENGINES.md``; no KV-usage gauge (per-slot state is at ``/slots``).

PROVISIONAL until checked against a real llama-server: ``prompt_tokens_total`` is taken to count
only the prompt tokens the server computed, so the queries are hits + that counter."""

from __future__ import annotations

from kvbench.engines.base import EngineAdapter, HttpCall, register


def tokenize_body(model: str, prompt: str | None, messages: list | None) -> dict:
    """llama-server's /tokenize takes plain text as ``content`` (no chat messages: render the
    chat template first)."""
    if messages is not None:
        raise ValueError("llama-server's /tokenize takes text, not chat messages; render the "
                         "chat template and tokenize the text")
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
    prompt_tokens="llamacpp:prompt_tokens_total",
    generation_tokens="llamacpp:tokens_predicted_total",
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    tokenize=HttpCall("POST", "/tokenize"), tokenize_body=tokenize_body,
    tokenize_count=tokenize_count,
    list_slots=HttpCall("GET", "/slots", "disabled by --no-slots"),
    slot_ids=slot_ids,
    reset_cache=HttpCall("POST", "/slots/{slot}?action=erase",
                         "erases one slot's prompt cache; called for every slot"),
    notes=("metrics need --metrics", "prefix reuse is per slot (-np N slots)"),
))
