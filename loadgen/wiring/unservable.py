"""The failure stop: a run whose every request fails in a way load cannot cause (HTTP 404,
401 or 403, connection refused, a host name that does not resolve) stops after a short run of
them in a row (``--kvbench-stop-after-failures``, 0: never), with one sentence naming what
failed and the fix. Overload's own failures (429, 503, timeouts, disconnects) never count: a
capacity search provokes them on purpose. Any other outcome starts the count again."""

from __future__ import annotations

import json
import urllib.request

from kvbench.core import redact
from kvbench.runs.job import unreachable

AUTH = (401, 403)


def kind(res) -> str | None:
    """What about ``res`` load cannot cause ("404", "auth", "refused", "dns"), or None."""
    if res.status == "http_error":
        if res.http_status == 404:
            return "404"
        if res.http_status in AUTH:
            return "auth"
        return None
    if res.status == "disconnected" and res.error:
        if res.error.startswith("ConnectionRefusedError"):
            return "refused"
        if res.error.startswith("gaierror"):
            return "dns"
    return None


class FailureRun:
    """Counts requests that failed in a row for a reason load cannot cause."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, int(limit or 0))
        self.count = 0
        self.last: str | None = None

    def observe(self, res) -> bool:
        """True when this result completes a run of ``limit`` such failures."""
        if not self.limit or res.status == "cancelled":
            return False
        k = kind(res)
        if k is None:
            self.count, self.last = 0, None
            return False
        self.count += 1
        self.last = k
        return self.count == self.limit


def served_models(url: str, headers: dict, timeout_s: float = 5.0) -> list[str] | None:
    """The ids ``url``/v1/models lists (at most 64 KB read), or None."""
    try:
        rq = urllib.request.Request(url + "/v1/models", headers=headers)
        with urllib.request.urlopen(rq, timeout=timeout_s) as r:
            data = json.loads(r.read(65536))
        return [str(m["id"]) for m in data["data"]][:20]
    except Exception:  # noqa: BLE001 - a hint only
        return None


def sentence(ctx, res, path: str, n: int) -> str:
    """One sentence: what the last ``n`` requests got from the target, and the fix."""
    url = ctx.url
    shown = redact.redact_url(url)
    head = f"stopped after {n} requests in a row failed"
    k = kind(res)
    if k in ("refused", "dns"):
        return f"{head}: " + (unreachable(url, OSError(res.error)) or res.error)
    if k == "auth":
        env = ctx.job.endpoint.api_key_env
        key = (f"the key in ${env} (--kvbench-api-key-env)" if env else
               "no API key (set --kvbench-api-key-env to the variable holding it)")
        return (f"{head}: every one got HTTP {res.http_status} from {shown}{path}: the server "
                f"refused the credentials, {key}; check the key and its access")
    models = served_models(url, ctx.headers)
    if models and ctx.model not in models:
        return (f"{head}: every one got HTTP 404 from {shown}{path}: the model "
                f"--kvbench-model {ctx.model} is not served there (it lists "
                f"{', '.join(models)}); pass one of those")
    return (f"{head}: every one got HTTP 404 from {shown}{path}: check --host (the server's "
            "base URL, without /v1) and --kvbench-model")
