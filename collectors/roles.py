"""GPU roles from bench.toml's ``[[collect.roles]]``: which host and GPU index serve which role."""

from __future__ import annotations

from fnmatch import fnmatchcase

from kvbench.collectors.spec import ROLES

__all__ = ["ROLES", "role_for"]


def role_for(roles, host: str | None, gpu: int | None) -> str:
    """The first mapping whose host pattern (``*`` and shell globs allowed) and GPU list (empty:
    all) match; ``"unknown"`` when none does."""
    for r in roles or ():
        if not fnmatchcase(host or "", r.host):
            continue
        if r.gpus and gpu not in r.gpus:
            continue
        return r.role
    return "unknown"
