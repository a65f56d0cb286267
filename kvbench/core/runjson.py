"""run.json and the load processes' sidecars on disk: written whole (temp file and rename),
read back checked, as the typed run contract (``kvbench.core.contract``). No pyarrow here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvbench.core import contract
from kvbench.core.contract import SCHEMA_VERSION, ProcMeta, RunMeta
from kvbench.core.errors import DataError


def git_commit(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("kvbench", "locust", "aiohttp", "pyarrow", "pandas", "numpy", "nvidia-ml-py"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    import platform

    out["python"] = platform.python_version()
    return out




def write_run_json(run_dir: Path, meta: RunMeta) -> None:
    """Atomic write (temp file + rename), so a reader never sees half a run.json. Called only
    by ``kvbench.runs.finalize``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(meta.to_dict(), indent=2, sort_keys=True, default=str))
    os.replace(tmp, run_dir / "run.json")


def run_meta(data: dict, source: Path | str = "run.json") -> RunMeta:
    """The typed view of a run.json dict, its field types checked first: a wrong type is a
    ``DataError`` naming ``source``, the field and what was found."""
    check_run_json(data, source)
    return RunMeta.from_dict(data)


def read_meta(run_dir: Path | str) -> RunMeta:
    """run.json of a run directory, checked: present, readable, a JSON object of this schema
    version whose fields have their types (``check_run_json``)."""
    run_dir = Path(run_dir)
    meta_path = run_dir / "run.json"
    if not meta_path.exists():
        raise DataError(f"{run_dir}: no run.json there; give a results directory written by "
                        "kvbench run or a locustfile")
    try:
        data = json.loads(meta_path.read_bytes())
    except OSError as exc:
        raise DataError(f"{meta_path}: cannot be read ({exc.strerror or exc}); check the "
                        "file's permissions or restore it") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        what = "empty" if not meta_path.stat().st_size else f"not valid JSON ({exc})"
        raise DataError(f"{meta_path}: run.json is {what}; restore it from a copy, or rerun "
                        "the run") from None
    except RecursionError:  # brackets nested past the parser's depth: no run.json is
        raise DataError(f"{meta_path}: run.json is not valid JSON (nested too deeply to be a "
                        "run.json); restore it from a copy, or rerun the run") from None
    if not isinstance(data, dict):
        raise DataError(f"{meta_path}: run.json holds {_json_kind(data)}, not the JSON object "
                        "kvbench writes; restore it from a copy, or rerun the run")
    ver = data.get("schema_version")
    if ver != SCHEMA_VERSION:
        raise DataError(f"{meta_path}: results of schema version {ver!r}, this kvbench reads "
                        f"version {SCHEMA_VERSION}; use the kvbench version that wrote them")
    return run_meta(data, meta_path)


def _json_kind(value) -> str:
    """How a JSON value reads in a sentence: 'a list', 'the number 7', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        short = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {short!r}"
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# The types of run.json's fields that readers rely on (others pass through): checked by
# pydantic in strict mode, so "7" is not an int and true is not a number. Times are epoch ns
# within int64, as the records' own.


def check_run_json(data, source: Path | str = "run.json") -> None:
    """Raise a ``DataError`` naming ``source`` and the first field whose type is wrong (the
    contract's strict check: "7" is not an int, true is not a number, times are ns within
    int64)."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise DataError(f"{source}: holds {_json_kind(data)}, not a JSON object; restore it "
                        "from a copy, or rerun the run")
    try:
        contract.check(RunMeta, data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        msg = first["msg"]
        msg = msg[len("Input "):] if msg.startswith("Input ") else msg[0].lower() + msg[1:]
        more = len(exc.errors()) - 1
        raise DataError(f"{source}: field {loc} {msg}, found {_json_kind(first.get('input'))}"
                        f"{f' ({more} more problems)' if more else ''}; restore run.json from "
                        "a copy, or rerun the run") from None


def read_proc_meta(run_dir: Path | str) -> list[ProcMeta]:
    """The sidecars of every load process of a run. Each is written whole (temp file and
    rename), so one that is not a JSON object with counts, stages and incomplete of their
    types is damaged: a ``DataError`` naming it."""
    out = []
    for p in sorted(Path(run_dir).glob("proc-*.json")):
        try:
            data = json.loads(p.read_bytes())
        except OSError as exc:
            raise DataError(f"{p}: cannot be read ({exc.strerror or exc}); check its "
                            "permissions or remove it") from None
        except (ValueError, RecursionError) as exc:
            why = exc if isinstance(exc, ValueError) else "nested too deeply"
            raise DataError(f"{p}: a load process's sidecar that is not valid JSON ({why}); "
                            "remove it (its process's counts are then unknown)") from None
        problem = _proc_meta_problem(data)
        if problem:
            raise DataError(f"{p}: a load process's sidecar whose {problem}; remove it (its "
                            "process's counts are then unknown)")
        out.append(ProcMeta.from_dict(data))
    return out


def _proc_meta_problem(data) -> str | None:
    if not isinstance(data, dict):
        return f"content is {_json_kind(data)}, not an object"
    counts = data.get("counts", {})
    if not isinstance(counts, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in counts.values()):
        return "counts are not whole numbers by name"
    stages = data.get("stages", [])
    if not isinstance(stages, list) or not all(
            isinstance(st, dict) and all(isinstance(st.get(k), int) and not isinstance(
                st.get(k), bool) for k in ("t_start_ns", "t_end_ns")) for st in stages):
        return "stages are not a list of objects with integer t_start_ns and t_end_ns"
    if not isinstance(data.get("incomplete", []), list):
        return "incomplete is not a list"
    return None


