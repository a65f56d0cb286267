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
from kvbench.model import topologies
from kvbench.reports.measures.spec import DEFAULT_SLOS, GateConfig
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
    "float_type": "write a number, e.g. 3.5",
    "int_type": "write a whole number",
    "int_from_float": "write a whole number",
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


def problems(err: ValidationError) -> list[str]:
    """``field <where>: <what>; <fix>`` for each place pydantic found wrong, the first
    error of a place only."""
    out: dict[str, str] = {}
    for e in err.errors():
        where = _loc(e["loc"])
        fix = _FIXES.get(e["type"], "")
        out.setdefault(where, f"field {where}: {_message(e)}{'; ' + fix if fix else ''}")
    return list(out.values())


def joined(path: Path, found: list[str]) -> str:
    """One line naming the file and every problem found in it (``field ...: ...; fix``),
    the first as it would read alone, the others after it, each with its own fix."""
    if len(found) > 1:  # each the shorter, so that several still read as one line
        found = [_clip(x, 240) for x in found]
    return f"{path}: {' | '.join(found)}."


def one_sentence(path: Path, err: ValidationError) -> str:
    return joined(path, problems(err))


def parse_config(data: dict, path: Path | str = "bench.toml") -> BenchConfig:
    path = Path(path)
    try:
        cfg = BenchConfig.model_validate(data)
    except ValidationError as err:
        found = problems(err)
        if isinstance(data, dict):  # the sections checked apart, when they are whole
            found += _builtin_option_problems(data.get("endpoints"), skip=found)
            found += _gate_rule_problems(_gate_or_none(data.get("gate", {})))
        raise UserError(joined(path, found)) from None
    found = _cross_checks(cfg)
    if found:
        raise UserError(joined(path, found))
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


def load_config(path: Path | str = "bench.toml", under: Path | str | None = None) -> BenchConfig:
    """``path`` validated. ``under``: another config whose tables fill in those ``path``
    lacks (a twin file of ``[[endpoints]]`` and ``[twin]`` predicted under a suite's
    workloads), its ``[slo]`` tables winning over those of ``path``."""
    path = Path(path)
    data = _read(path)
    if under is not None:
        base = _read(Path(under))
        data = {**base, **data}
        if "slo" in base:
            data["slo"] = base["slo"]
    return parse_config(data, path)


def _read(path: Path) -> dict:
    """The TOML of ``path`` (paths in its workload tables made relative to it)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found; pass --config with the path of "
                        "your bench.toml") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the config ({exc.strerror}); pass --config with "
                        "the path of your bench.toml.") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid TOML ({_clip(exc, 200)}); fix the syntax at that "
                        "place.") from None
    _relative_paths(data, path)
    return data


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


def _cross_checks(cfg: BenchConfig) -> list[str]:
    """Every problem across sections (``field ...: ...; fix``); none: an empty list."""
    found: list[str] = []
    names = [ep.name for ep in cfg.endpoints]
    for n in sorted({n for n in names if names.count(n) > 1}):
        found.append(f"field endpoints: the name {n!r} is used twice; give each endpoint its "
                     "own name")
    for wname, spec in cfg.workloads.items():
        bad = spec.check_tables(wname, cfg.workloads)
        if bad is not None:
            found.append(f"field {bad[0]}: {bad[1]}")
    for wname in cfg.suite.workloads or []:
        if wname not in cfg.workloads:
            found.append(f"field suite.workloads: {wname!r} is not defined; add a "
                         f"[workloads.{wname}] table or remove it from the list")
    for pname, prof in cfg.profiles.items():
        for wname in dict.fromkeys(prof.stage_workloads()):
            if wname not in cfg.workloads:
                found.append(f"field profiles.{pname}.stages: workload {wname!r} is not "
                             f"defined; add a [workloads.{wname}] table or fix the stage")
    if cfg.suite.profile is not None and cfg.suite.profile not in cfg.profiles:
        found.append(f"field suite.profile: {cfg.suite.profile!r} is not defined; "
                     f"use one of {sorted(cfg.profiles)}")
    classes = _request_classes(cfg)
    for cls in cfg.slo:
        if cls not in classes:
            found.append(f"field slo: [slo.{_clip(cls, 40)}] names no request class "
                         f"of the configured workloads; use one of {sorted(classes)} or "
                         "remove the table")
    for ep in cfg.endpoints:
        found += _context_problems(cfg, ep)
    found += _gate_rule_problems(cfg.gate)
    found += _builtin_option_problems([ep.model_dump() for ep in cfg.endpoints])
    found += _twin_problems(cfg)
    return found


def _twin_problems(cfg: BenchConfig) -> list[str]:
    """``[twin] endpoint`` must name a built-in endpoint of the file."""
    twin = cfg.twin
    if twin is None or twin.endpoint is None:
        return []
    builtin = [ep.name for ep in cfg.endpoints if ep.kind == "builtin"]
    if twin.endpoint not in builtin:
        return [f"field twin.endpoint: {_clip(repr(twin.endpoint), 40)} is not a built-in "
                f"endpoint of this file; use one of {builtin} (the [[endpoints]] table of kind "
                "\"builtin\" the fit describes) or remove it"]
    return []


def _context_problems(cfg: BenchConfig, ep) -> list[str]:
    """Workloads whose prompts or outputs cannot fit the context of endpoint ``ep``."""
    ctx = ep.max_context_tokens
    found: list[str] = []
    for wname, spec in cfg.workloads.items() if ctx is not None else ():
        out_max = spec.max_output_upper()
        if out_max != float("inf") and out_max >= ctx:
            found.append(
                f"field workloads.{wname}: max_tokens can reach {int(out_max)}, not "
                f"below the context of endpoint {ep.name!r} ({ctx} tokens); lower the "
                "output_tokens max")
            continue
        total = spec.max_prompt_upper() + (0 if out_max == float("inf") else out_max)
        if total != float("inf") and total > ctx:
            found.append(
                f"field workloads.{wname}: prompts plus outputs can reach "
                f"{int(total)} tokens, more than the context of endpoint {ep.name!r} "
                f"({ctx} tokens); lower the token maxima or raise max_context_tokens")
    return found


# Metrics that are never below zero (latencies, rates, ratios, throughputs): a ceiling below
# zero is a rule no run can pass. Lateness may be negative (a request sent early).
def _never_negative(metric: str) -> bool:
    from kvbench.reports.measures.spec import metric_name

    try:
        key = metric_name(metric)
    except UserError:  # reported as the rule's own error
        return False
    return not key.startswith("lateness_")


def _gate_or_none(table) -> GateConfig | None:
    try:
        return GateConfig.model_validate(table)
    except ValidationError:  # its errors are among the config's
        return None


def _gate_rule_problems(gate: GateConfig | None) -> list[str]:
    """Gate rules no run could pass."""
    found = []
    for i, rule in enumerate(gate.rules if gate is not None else ()):
        if rule.max_value is not None and rule.max_value < 0 and _never_negative(rule.metric):
            found.append(f"field gate.rules[{i}].max_value: {rule.max_value:g} is below zero, "
                         f"which {rule.metric} never is, so the rule could never pass; give "
                         "the ceiling in the metric's own unit (error_rate = 0.005 is 0.5%)")
    return found


def _request_classes(cfg: BenchConfig) -> set[str]:
    """The request classes the config's workload tables produce (a mix's: its parts')."""
    classes = set()
    for spec in cfg.workloads.values():
        cls = registry.class_of(spec)
        if cls != "mix":
            classes.add(cls)
    return classes


def _builtin_option_problems(endpoints, skip=()) -> list[str]:
    """Problems of the built-in endpoints' ``options`` (``endpoints`` as written, or dumped),
    each place once, none already in ``skip``."""
    found: list[str] = []
    for i, ep in enumerate(endpoints if isinstance(endpoints, list) else ()):
        if not (isinstance(ep, dict) and ep.get("kind") == "builtin"
                and isinstance(ep.get("topology"), str)
                and isinstance(ep.get("options", {}), dict)):
            continue
        try:  # only for a built-in endpoint: a config of real endpoints never loads the emulator
            from kvbench.endpoints.config import validate_options
        except ImportError:  # the emulator's settings are checked when it starts
            return found
        try:
            validate_options(topologies.accept(ep["topology"]), ep.get("options", {}))
        except ValidationError as err:
            for e in err.errors():
                where = f"endpoints[{i}].options.{_loc(e['loc'])}"
                line = (f"field {where}: {_message(e)}; "
                        f"{_FIXES.get(e['type'], 'see kvbench serve --help')}")
                if not any(f"field {where}:" in x for x in (*skip, *found)):
                    found.append(line)
        except Exception:  # noqa: BLE001  an unknown topology: the endpoint's own error
            continue
    return found
