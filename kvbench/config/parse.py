"""Reading bench.toml: TOML, then the typed schema, then the checks across sections. Every error
is one sentence naming the file, the field and the fix, raised as ``UserError``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pydantic import ValidationError

from kvbench.config.bench import BenchConfig
from kvbench.config.endpoints import ENDPOINT_KINDS
from kvbench.core.errors import UserError
from kvbench.reports.measures.spec import DEFAULT_SLOS
from kvbench.workloads import registry
from kvbench.workloads.specs import NAME_PATTERN

_SHOWN = 80  # characters of a user's value or key quoted in a message


def _clip(text: str, n: int = _SHOWN) -> str:
    """One line of at most ``n`` characters (a message quotes what the user wrote)."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _loc(loc: tuple) -> str:
    """``workloads.x.top_k`` from pydantic's location, without the discriminator tag it adds
    after ``workloads.<name>`` and ``endpoints[i]`` (not a field the user wrote), nor the
    ``[key]`` it adds when a table's name is what is wrong."""
    tags = set(registry.kinds()) | set(ENDPOINT_KINDS)
    if len(loc) > 2 and loc[0] in ("workloads", "endpoints") and loc[2] in tags:
        loc = loc[:2] + loc[3:]
    if loc and loc[-1] == "[key]":
        loc = loc[:-1]
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = _clip(part, 40)
            plain = re.fullmatch(r"[\w.-]+", part, re.ASCII)
            out += ("." if out else "") + (part if plain else repr(part))
    return out or "(top level)"


_FIXES = {
    "extra_forbidden": "remove it or check its spelling",
    "missing": "add it",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value",
    "less_than_equal": "use a smaller value",
    "finite_number": "write a number, not inf or nan",
    "string_too_long": "shorten it",
    "too_long": "list fewer items",
    "too_short": "list at least one",
    "string_pattern_mismatch": "use letters, digits, '_', '.' and '-' only, at most 64 "
                               "characters, starting with a letter or digit",
    "union_tag_invalid": "use one of the kinds listed",
    "union_tag_not_found": "add a kind field",
}


def _message(first: dict) -> str:
    """pydantic's message for one error, on one line, the user's input quoted short."""
    kind = first["type"]
    if kind == "string_pattern_mismatch" and first.get("ctx", {}).get("pattern") == NAME_PATTERN:
        return f"{_clip(repr(first['input']))} is not a plain name"
    if kind == "union_tag_invalid":
        ctx = first.get("ctx", {})
        return (f"Input tag {_clip(repr(ctx.get('tag')))} found using "
                f"{ctx.get('discriminator')} does not match any of the expected tags: "
                f"{ctx.get('expected_tags')}")
    msg = first["msg"].removeprefix("Value error, ")
    return _clip(msg, 600)


def one_sentence(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    where = _loc(first["loc"])
    fix = _FIXES.get(first["type"], "")
    more = len(err.errors()) - 1
    tail = f" ({more} more problem{'s' if more > 1 else ''} after this one)" if more else ""
    return f"{path}: field {where}: {_message(first)}{'; ' + fix if fix else ''}{tail}."


def parse_config(data: dict, path: Path | str = "bench.toml") -> BenchConfig:
    path = Path(path)
    try:
        cfg = BenchConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(one_sentence(path, err)) from None
    _cross_checks(cfg, path)
    return _with_default_slos(cfg)


def _with_default_slos(cfg: BenchConfig) -> BenchConfig:
    """The config with ``reports.spec.DEFAULT_SLOS`` for configured classes without an
    [slo.<class>] table (the ``trace`` class: 5 s TTFT, 100 ms TPOT)."""
    classes = _request_classes(cfg)
    add = {c: s for c, s in DEFAULT_SLOS.items() if c in classes and c not in cfg.slo}
    return cfg.model_copy(update={"slo": {**cfg.slo, **add}}) if add else cfg


def workload_classes(cfg: BenchConfig, name: str) -> set[str]:
    """The request classes workload ``name`` sends (a mix: its parts')."""
    spec = cfg.workloads[name]
    cls = registry.class_of(spec)
    if cls != "mix":
        return {cls}
    out: set[str] = set()
    for part in getattr(spec, "parts", lambda: [])():
        if part in cfg.workloads and part != name:
            out |= workload_classes(cfg, part)
    return out


def classes_without_slo(cfg: BenchConfig, workloads=None) -> list[str]:
    """Request classes of ``workloads`` (default: all configured) with no SLO: their goodput
    and SLO attainment are "no SLO" in reports."""
    names = list(workloads) if workloads is not None else list(cfg.workloads)
    classes = set().union(*(workload_classes(cfg, n) for n in names)) if names else set()
    return sorted(c for c in classes if c not in cfg.slo
                  or all(getattr(cfg.slo[c], k) is None for k in ("ttft_ms", "tpot_ms", "e2e_ms")))


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
        raise UserError(f"{path}: not valid TOML ({_clip(exc, 200)}); fix the syntax at that "
                        "place.") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the config ({exc.strerror}); pass --config with "
                        "the path of your bench.toml.") from None
    _relative_paths(data, path)
    return parse_config(data, path)


def _relative_paths(data: dict, path: Path) -> None:
    """Paths in a workload table (trace files) are relative to the config file, not to the
    current directory."""
    kinds = registry.kinds()
    tables = data.get("workloads")
    for w in tables.values() if isinstance(tables, dict) else ():
        kind = kinds.get(w.get("kind")) if isinstance(w, dict) and isinstance(
            w.get("kind"), str) else None
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
    classes = _request_classes(cfg)
    for cls in cfg.slo:
        if cls not in classes:
            raise UserError(f"{path}: field slo: [slo.{_clip(cls, 40)}] names no request class "
                            f"of the configured workloads; use one of {sorted(classes)} or "
                            "remove the table.")
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


def _request_classes(cfg: BenchConfig) -> set[str]:
    """The request classes the config's workload tables produce (a mix's: its parts')."""
    classes = set()
    for spec in cfg.workloads.values():
        cls = registry.class_of(spec)
        if cls != "mix":
            classes.add(cls)
    return classes


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
                    f"{_message(first)}; "
                    f"{_FIXES.get(first['type'], 'see kvbench serve --help')}.") from None
