"""Reading bench.toml: TOML, then the typed schema, then the checks across sections. Every error
is one sentence naming the file, the field and the fix, raised as ``UserError``."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import ValidationError

from kvbench.config.bench import BenchConfig
from kvbench.config.endpoints import ENDPOINT_KINDS
from kvbench.core.errors import UserError
from kvbench.workloads import registry


def _loc(loc: tuple) -> str:
    """``workloads.x.top_k`` from pydantic's location, without the discriminator tag it adds
    after ``workloads.<name>`` and ``endpoints[i]`` (not a field the user wrote)."""
    tags = set(registry.kinds()) | set(ENDPOINT_KINDS)
    if len(loc) > 2 and loc[0] in ("workloads", "endpoints") and loc[2] in tags:
        loc = loc[:2] + loc[3:]
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


_FIXES = {
    "extra_forbidden": "remove it or check its spelling",
    "missing": "add it",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value",
    "union_tag_invalid": "use one of the kinds listed",
    "union_tag_not_found": "add a kind field",
}


def _one_sentence(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    where = _loc(first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    fix = _FIXES.get(first["type"], "")
    more = len(err.errors()) - 1
    tail = f" ({more} more problem{'s' if more > 1 else ''} after this one)" if more else ""
    return f"{path}: field {where}: {msg}{'; ' + fix if fix else ''}{tail}."


def parse_config(data: dict, path: Path | str = "bench.toml") -> BenchConfig:
    path = Path(path)
    try:
        cfg = BenchConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_one_sentence(path, err)) from None
    _cross_checks(cfg, path)
    return cfg


def load_config(path: Path | str = "bench.toml") -> BenchConfig:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found; pass --config with the path of "
                        "your bench.toml") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid TOML ({exc}); fix the syntax at that place") from None
    _relative_paths(data, path)
    return parse_config(data, path)


def _relative_paths(data: dict, path: Path) -> None:
    """Paths in a workload table (trace files) are relative to the config file, not to the
    current directory."""
    kinds = registry.kinds()
    for w in (data.get("workloads") or {}).values():
        kind = kinds.get(w.get("kind")) if isinstance(w, dict) else None
        for field in kind.spec.path_fields if kind else ():
            if isinstance(w.get(field), str) and not Path(w[field]).is_absolute():
                w[field] = str(path.parent / w[field])


def _cross_checks(cfg: BenchConfig, path: Path) -> None:
    names = [ep.name for ep in cfg.endpoints]
    for n in names:
        if names.count(n) > 1:
            raise UserError(f"{path}: field endpoints: the name {n!r} is used twice; "
                            "give each endpoint its own name.")
    for wname, spec in cfg.workloads.items():
        bad = spec.check_tables(wname, cfg.workloads)
        if bad is not None:
            raise UserError(f"{path}: field {bad[0]}: {bad[1]}.")
    for wname in cfg.suite.workloads or []:
        if wname not in cfg.workloads:
            raise UserError(f"{path}: field suite.workloads: {wname!r} is not defined; add a "
                            f"[workloads.{wname}] table or remove it from the list.")
    if cfg.suite.profile is not None and cfg.suite.profile not in cfg.profiles:
        raise UserError(f"{path}: field suite.profile: {cfg.suite.profile!r} is not defined; "
                        f"use one of {sorted(cfg.profiles)}.")
    for ep in cfg.endpoints:
        ctx = ep.max_context_tokens
        if ctx is None:
            continue
        for wname, spec in cfg.workloads.items():
            out_max = spec.max_output_upper()
            if out_max != float("inf") and out_max >= ctx:
                raise UserError(
                    f"{path}: field workloads.{wname}: max_tokens can reach {int(out_max)}, not "
                    f"below the context of endpoint {ep.name!r} ({ctx} tokens); lower the "
                    "output_tokens max.")
            total = spec.max_prompt_upper() + (0 if out_max == float("inf") else out_max)
            if total != float("inf") and total > ctx:
                raise UserError(
                    f"{path}: field workloads.{wname}: prompts plus outputs can reach "
                    f"{int(total)} tokens, more than the context of endpoint {ep.name!r} "
                    f"({ctx} tokens); lower the token maxima or raise max_context_tokens.")
    if cfg.endpoints and any(ep.kind == "builtin" for ep in cfg.endpoints):
        _validate_builtin_options(cfg, path)


def _validate_builtin_options(cfg: BenchConfig, path: Path) -> None:
    try:
        from kvbench.endpoints.config import validate_options
    except ImportError:  # the emulator's settings are checked when it starts
        return
    for i, ep in enumerate(cfg.endpoints):
        if ep.kind == "builtin":
            try:
                validate_options(ep.topology, ep.options)
            except ValidationError as err:
                first = err.errors()[0]
                raise UserError(
                    f"{path}: field endpoints[{i}].options.{_loc(first['loc'])}: "
                    f"{first['msg'].removeprefix('Value error, ')}; "
                    f"{_FIXES.get(first['type'], 'see kvbench serve --help')}.") from None
