"""Fuzz of bench.toml: seeded mutations of the repository's default suite, each loaded through
the real loader. A mutation either loads (and then its workloads build their first requests in
bounded memory and time) or is rejected with one sentence naming the file; never a traceback.

Run alone for the figures: ``python tests/test_config_fuzz.py [SEED] [N]`` prints the counts.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTATIONS = 1200
MEMORY_CAP_BYTES = 3 << 30  # address space of the fuzzing process: a blow-up hits it at once
BUILD_SECONDS = 10  # one config's builds; beyond it counts as a hang
CLI_SAMPLES = 4  # loaded and rejected mutations also run through `kvbench workloads describe`

_HUGE = "x" * 200_000
_GARBAGE = [
    -1, 0, 1, -(2**63), 2**63 - 1, 240_000_000_000, 10**18, 1e18, 9.2e18, 1e308, -1e308, 1e-300,
    -0.0, math.inf, -math.inf, math.nan, True, False, "", " ", "-1", "1e30", "inf", _HUGE,
    "名前😀\u202e\u0000\x7f\n", "a:b", "os:system", "../../etc/passwd", "*", [], [1, 2],
    ["x"] * 3, {}, {"a": 1}, {"kind": "chat"}, [[{"x": [{}]}]], list(range(20_000)),
    dt.datetime(1979, 5, 27, 7, 32), dt.date(2000, 1, 1),
]


def _junk(rng: random.Random):
    return _copy(rng.choice(_GARBAGE))


def toml_text(data: dict) -> str:
    """TOML for ``data`` (tomllib only reads): every table and array written inline."""
    return "".join(f"{_key(k)} = {_value(v)}\n" for k, v in data.items())


def _key(k) -> str:
    return _string(str(k))


def _string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) \
            else repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (dt.date, dt.datetime)):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def _slots(node, out=None):
    """Every (container, key) below ``node``."""
    out = [] if out is None else out
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for k, v in items:
        out.append((node, k))
        if not (isinstance(v, list) and len(v) > 100):
            _slots(v, out)
    return out


def _typo(rng: random.Random, word: str) -> str:
    if not word:
        return "x"
    i = rng.randrange(len(word))
    op = rng.randrange(3)
    if op == 0:
        return word[:i] + word[i + 1:] or "y"
    if op == 1:
        return word[:i] + rng.choice("abcdez_:.") + word[i:]
    return word[:i] + word[i:][::-1]


def _number(rng: random.Random, v):
    choice = rng.randrange(5)
    if choice == 0:
        return -v if v else -1
    if choice == 1:
        return v * 10 ** rng.randrange(3, 20) if isinstance(v, int) else v * 10.0 ** rng.randrange(
            3, 300)
    if choice == 2:
        return rng.choice([math.inf, -math.inf, math.nan])
    if choice == 3:
        return float(v) if isinstance(v, int) else int(v) if math.isfinite(v) else 0
    return rng.choice([0, 1, 2**62, 1e-9])


def mutate(rng: random.Random, data: dict) -> dict:
    """One to three random damages of ``data`` (modified in place and returned)."""
    for _ in range(rng.randint(1, 3)):
        slots = _slots(data)
        node, key = rng.choice(slots)
        v = node[key]
        op = rng.randrange(9)
        if op == 0 and isinstance(node, dict):
            del node[key]
        elif op == 1:
            node[key] = _junk(rng)
        elif op == 2 and isinstance(v, (int, float)) and not isinstance(v, bool):
            node[key] = _number(rng, v)
        elif op == 3 and isinstance(node, dict):
            node[_typo(rng, str(key))] = node.pop(key)
        elif op == 4:
            node[key] = [v]
        elif op == 5 and isinstance(v, dict):
            v[rng.choice(["requestz", "kind", "", "名", "a" * 300])] = _junk(rng)
        elif op == 6:
            table = rng.choice(["workloads", "slo", "profiles", "gate", "collect", "suite",
                                "endpoints"])
            sub = data.setdefault(table, {})
            if isinstance(sub, dict):
                sub[_typo(rng, rng.choice(list(sub) or ["x"]))] = {
                    "kind": rng.choice(["chat", "rag", "agent", "longctx", "hogwild", "mix",
                                        "trace", "nope"]),
                    "requests": _junk(rng)}
        elif op == 7 and isinstance(v, str):
            node[key] = rng.choice([_typo(rng, v), v * 1000, v + ":factory", "", v.upper()])
        else:
            node[key] = _junk(rng)
    return data


def _text_damage(rng: random.Random, text: str) -> str:
    """Damage at the text level (TOML syntax, encodings)."""
    i = rng.randrange(len(text))
    op = rng.randrange(3)
    if op == 0:
        return text[:i]
    if op == 1:
        return text[:i] + rng.choice(["[", "]]", "=", "\"", "\x00", "\ud7ff", "[slo.chta]\n"]) \
            + text[i:]
    return text.replace(text[i:i + 6], "", 1)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def run_fuzz(seed: int, n: int) -> dict:
    """Counts of outcomes over ``n`` mutations (and the first few problems, for the message)."""
    from kvbench.config import load_config
    from kvbench.core.errors import UserError
    from kvbench.workloads.registry import make_workload

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP_BYTES, MEMORY_CAP_BYTES))
    signal.signal(signal.SIGALRM, _alarm)
    base_text = (ROOT / "bench.toml").read_text()
    base = tomllib.loads(base_text)
    assert tomllib.loads(toml_text(base)) == base  # the writer round-trips the default suite
    rng = random.Random(seed)
    counts = {"loaded": 0, "rejected": 0, "tracebacks": 0, "bad_messages": 0,
              "memory": 0, "hangs": 0, "build_rejected": 0, "non_finite": 0}
    problems: list[str] = []
    tmp_dir = tempfile.TemporaryDirectory(prefix="kvbench-fuzz-")
    tmp = Path(tmp_dir.name)
    samples: dict[str, list[str]] = {"loaded": [], "rejected": []}
    for i in range(n):
        if i % 10 == 9:
            text = _text_damage(rng, base_text)
        else:
            text = toml_text(mutate(rng, _copy(base)))
        path = tmp / f"bench-{i}.toml"
        path.write_text(text, encoding="utf-8")
        try:
            cfg = load_config(path)
        except UserError as exc:
            counts["rejected"] += 1
            if len(samples["rejected"]) < CLI_SAMPLES and i % 7 == 0:
                samples["rejected"].append(text)
            msg = str(exc)
            if "\n" in msg or str(path) not in msg or len(msg) > 1000 or not msg.endswith("."):
                counts["bad_messages"] += 1
                problems.append(f"#{i} message: {msg[:300]!r}")
            continue
        except Exception:  # noqa: BLE001 - what the fuzz counts
            counts["tracebacks"] += 1
            problems.append(f"#{i} traceback: {traceback.format_exc(limit=3)[-400:]}")
            continue
        counts["loaded"] += 1
        if len(samples["loaded"]) < CLI_SAMPLES:
            samples["loaded"].append(text)
        if not _finite(cfg.model_dump()):
            counts["non_finite"] += 1
            problems.append(f"#{i} loaded with an inf or nan")
        signal.alarm(BUILD_SECONDS)
        try:
            for name in cfg.workloads:
                list(itertools.islice(make_workload(name, cfg).requests(), 3))
        except UserError as exc:
            counts["build_rejected"] += 1
            problems.append(f"#{i} rejected at build: {exc}")
        except MemoryError:
            counts["memory"] += 1
            problems.append(f"#{i} memory blow-up building its workloads")
        except _Hang:
            counts["hangs"] += 1
            problems.append(f"#{i} took over {BUILD_SECONDS} s building its workloads")
        except Exception:  # noqa: BLE001
            counts["tracebacks"] += 1
            problems.append(f"#{i} build traceback: {traceback.format_exc(limit=3)[-400:]}")
        finally:
            signal.alarm(0)
    tmp_dir.cleanup()
    counts["problems"] = problems[:20]
    counts["samples"] = samples
    return counts


def _finite(node) -> bool:
    if isinstance(node, float):
        return math.isfinite(node)
    if isinstance(node, dict):
        return all(_finite(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return all(_finite(v) for v in node)
    return True


def _copy(data):
    if isinstance(data, dict):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_copy(v) for v in data]
    return data


def test_fuzzed_configs_load_or_are_one_sentence(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "11", str(MUTATIONS)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.splitlines()[-1])
    problems = "\n".join(counts.pop("problems"))
    samples = counts.pop("samples")
    assert counts["tracebacks"] == 0, problems
    assert counts["bad_messages"] == 0, problems
    assert counts["memory"] == 0 and counts["hangs"] == 0, problems
    assert counts["non_finite"] == 0, problems
    # the mutations reach both sides: most are rejected, some still load and build
    assert counts["rejected"] > MUTATIONS // 2 and counts["loaded"] > 20, counts
    assert time.monotonic() - t0 < 600
    # the command line says the same in one line, exit code 2, for a sample of each side
    for i, text in enumerate(samples["rejected"] + samples["loaded"]):
        path = tmp_path / f"cli-{i}.toml"
        path.write_text(text, encoding="utf-8")
        p = subprocess.run([sys.executable, "-m", "kvbench", "workloads", "describe", "--config",
                            str(path), "--limit", "3", "--json"], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
        assert "Traceback" not in p.stderr, p.stderr[-2000:]
        if i < len(samples["rejected"]):
            assert p.returncode == 2 and p.stderr.count("\n") == 1 and str(path) in p.stderr
        else:
            assert p.returncode in (0, 2), p.stderr  # 2: e.g. a tokenizer path that is absent


if __name__ == "__main__":
    out = run_fuzz(int(sys.argv[1]) if len(sys.argv) > 1 else 11,
                   int(sys.argv[2]) if len(sys.argv) > 2 else MUTATIONS)
    if "--figures" in sys.argv:
        out.pop("samples")
    print(json.dumps(out))
