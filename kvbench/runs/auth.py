"""Request headers of an endpoint: its configured headers plus the API key from the environment
(used by preflight and by the Locust users alike)."""

from __future__ import annotations

import os

from kvbench.core import redact
from kvbench.core.errors import UserError


def auth_headers(headers: dict | None, key_env: str | None, who: str) -> dict:
    """The endpoint's extra headers plus ``Authorization: Bearer`` from the environment
    variable ``key_env`` (the key itself never reaches records, logs, job files or reports)."""
    out = dict(headers or {})
    for v in out.values():
        redact.add_header(v)  # any header may carry a secret: redacted wherever text is written
    if key_env:
        key = os.environ.get(key_env)
        if not key:
            raise UserError(f"{who}: environment variable {key_env} (its API key) is not set; "
                            "export it before starting the load")
        redact.add(key)
        out["Authorization"] = f"Bearer {key}"
    return out
