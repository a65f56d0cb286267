"""Secrets are never written: the secret values this process knows, and ``redact(text)``, which
replaces each of them wherever kvbench writes text (records' error texts, Locust's failures and
logs, reports, run.json, error messages).

Redaction is by value, not by name: a server that echoes a key in a 401 body ("Incorrect API key
provided: sk-...") or a header whose name looks harmless (``X-Password``) is caught all the same.
Secrets are registered where they become known: the API key read from ``api_key_env``, every
configured header value (and the credential after an auth scheme, ``Bearer <token>``), the
password of a URL's userinfo. A process that never learns of a secret cannot redact it, so each
place that reads one registers it (config validation, ``runs.auth``, a job loaded in a Locust
child).

Values shorter than ``MIN_CHARS`` (6) are not registered: a header like ``x-route: eu`` is no
secret, and replacing two letters everywhere would garble every text (nor is a piece of the
marker ``<redacted>`` itself). A secret cut by a truncation at a text's start or end still has
its remaining piece redacted when that piece is at least ``MIN_CHARS`` long. URL userinfo
(``scheme://user:pass@``) is stripped from any text whether registered or not.

Cost: ``redact`` is one precompiled regex alternation (rebuilt on ``add``), a no-op when nothing
is registered and the text holds no ``@``; callers run it on error texts, never per token.
"""

from __future__ import annotations

import html
import json
import logging
import re
import threading
from urllib.parse import quote, unquote, urlsplit

MARK = "<redacted>"
MIN_CHARS = 6
_PASSES = 8

_lock = threading.Lock()
_secrets: set[str] = set()
_ordered: tuple[str, ...] = ()  # _secrets, longest first (a snapshot: readers never lock)
_pattern: re.Pattern | None = None
_USERINFO = re.compile(r"(?<=://)[^/?#\s@]+@")
_SCHEME = re.compile(r"^[A-Za-z][\w.-]*\s+(\S+)$")  # "Bearer <token>", "Basic <b64>", ...


def add(value) -> None:
    """Register one secret value (and its stripped, JSON-, HTML- and URL-escaped forms)."""
    global _pattern, _ordered
    if isinstance(value, str) and value != value.strip():
        add(value.strip())  # a key exported with a newline is echoed without it
    if not isinstance(value, str) or len(value) < MIN_CHARS or value in MARK:
        return
    forms = {value, json.dumps(value)[1:-1], html.escape(value), quote(value, safe="")}
    with _lock:
        if forms <= _secrets:
            return
        _secrets.update(forms)
        # longest first, so a value containing another is replaced whole
        _ordered = tuple(sorted(_secrets, key=len, reverse=True))
        _pattern = re.compile("|".join(map(re.escape, _ordered)))


def add_header(value) -> None:
    """Register a header value, and the credential alone when it follows an auth scheme."""
    add(value)
    m = _SCHEME.match(value) if isinstance(value, str) else None
    if m:
        add(m.group(1))


def add_url(url) -> None:
    """Register the userinfo of a URL (``http://user:pass@host``): the password, raw and
    decoded, or a lone token (``https://TOKEN@host``)."""
    try:
        u = urlsplit(url) if isinstance(url, str) else None
    except ValueError:
        return
    if u is None or "@" not in u.netloc:
        return
    user, _, password = u.netloc.rsplit("@", 1)[0].partition(":")
    add(password or user)
    add(unquote(password or user))


def clear() -> None:
    """Forget every registered secret (tests)."""
    global _pattern, _ordered
    with _lock:
        _secrets.clear()
        _ordered, _pattern = (), None


def known() -> int:
    """How many secret forms are registered (for tests and diagnostics)."""
    return len(_secrets)


def redact(text):
    """``text`` with every registered secret, and any URL userinfo, replaced by ``MARK``;
    anything not a non-empty str is returned as is."""
    if not isinstance(text, str) or not text:
        return text
    pat = _pattern
    if pat is not None:
        for _ in range(_PASSES):  # again, should a secret re-form around a marker
            new = pat.sub(MARK, text)
            if new == text:
                break
            text = new
        text = _cut_ends(text)
    if "@" in text:
        text = _USERINFO.sub(MARK + "@", text)
    return text


def _cut_ends(text: str) -> str:
    """A secret cut by a truncation: its first part ending the text, or its last part
    starting it (at least ``MIN_CHARS`` long)."""
    for s in _ordered:
        if text[-MIN_CHARS:] in s:  # (one substring test rules out most secrets)
            for k in range(min(len(s) - 1, len(text)), MIN_CHARS - 1, -1):
                if text.endswith(s[:k]):
                    text = text[:-k] + MARK
                    break
        if text[:MIN_CHARS] in s:
            for k in range(min(len(s) - 1, len(text)), MIN_CHARS - 1, -1):
                if text.startswith(s[-k:]):
                    text = MARK + text[k:]
                    break
    return text


def redact_url(url):
    """A URL without its userinfo (and without any registered secret)."""
    return redact(url)


def redact_obj(obj):
    """A JSON-like value (dicts, lists, strings) with every string redacted (keys kept)."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj


def mask_headers(headers) -> dict:
    """Header names kept, every value replaced by ``MARK`` (any header may carry a secret)."""
    return {k: MARK for k in (headers or {})}


def public_config(cfg):
    """A resolved config (bench.toml as JSON) fit to write: every endpoint's header values
    masked, every known secret and URL userinfo redacted."""
    if not isinstance(cfg, dict):
        return redact_obj(cfg)
    eps = cfg.get("endpoints")
    if isinstance(eps, list):
        cfg = {**cfg, "endpoints": [{**ep, "headers": mask_headers(ep["headers"])}
                                    if isinstance(ep, dict) and isinstance(ep.get("headers"), dict)
                                    else ep for ep in eps]}
    return redact_obj(cfg)


class RedactFilter(logging.Filter):
    """A logging filter that redacts each record's message and traceback text; installed on
    handlers, so it sees every record they emit, propagated ones included."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _pattern is None:
            return True
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logging's to report
            return True
        red = redact(msg)
        if red != msg:
            record.msg, record.args = red, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install_log_filter(*names: str) -> None:
    """Add one ``RedactFilter`` to every handler of the named loggers (``""``: the root)."""
    for name in names:
        for h in logging.getLogger(name or None).handlers:
            if not any(isinstance(f, RedactFilter) for f in h.filters):
                h.addFilter(RedactFilter())
