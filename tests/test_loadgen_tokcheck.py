"""Plain locustfile runs check the tokenizer: the first responses' usage against the prompt
tokens the client planned, beyond 1% the run stops with the ratio and the fix (or warns once
with --kvbench-tokenizer-check warn). The server here counts 2.82x the built-in tokenizer, as a
Llama server did with the README's first Locust example."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from kvbench.core.store import read_table as read_run_table
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stream_server as testing

# Locust patches the whole process with gevent at import: not the test process
os.environ["LOCUST_SKIP_MONKEY_PATCH"] = "1"
try:
    from kvbench.loadgen.timing.tokcheck import CHECK_RESPONSES, TOLERANCE, TokenCheck
finally:
    del os.environ["LOCUST_SKIP_MONKEY_PATCH"]

ROOT = Path(__file__).resolve().parent.parent


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50_000), st.one_of(st.none(), st.integers(0, 150_000))),
                max_size=8), st.sampled_from(["stop", "warn"]))
def test_decides_once_on_the_first_responses_with_usage(pairs, mode):
    chk = TokenCheck("kvbench-words-v1", mode)
    errors = [chk.observe(p, s) for p, s in pairs]
    used = [(p, s) for p, s in pairs if p and s is not None][:CHECK_RESPONSES]
    if len(used) < CHECK_RESPONSES:
        assert not chk.decided and not any(errors)
        return
    ratio = sum(s for _, s in used) / sum(p for p, _ in used)
    assert chk.decided and chk.ratio == ratio
    bad = abs(ratio - 1) > TOLERANCE
    stops = [e for e in errors if e is not None]
    assert len(stops) == (1 if bad and mode == "stop" else 0)
    if stops:
        msg = str(stops[0])
        assert f"counted {ratio:.2f}x the prompt tokens the client planned" in msg
        assert "suite.tokenizer" in msg and "--kvbench-tokenizer-check warn" in msg


@pytest.fixture(scope="module")
def llama_like():
    proc, url = testing.start(ttft_ms=5, itl_ms=1, prompt_token_scale=2.82)
    yield url
    testing.stop(proc)


def plain_locust(url, results, *extra, run_time="60s"):
    return subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadgen/longctx.py", "--headless", "--host", url,
         "-u", "2", "-r", "2", "-t", run_time, "--only-summary", "--kvbench-model", "test-model",
         "--kvbench-results", str(results), "--kvbench-run-id", "plain", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_plain_run_stops_on_a_tokenizer_mismatch(llama_like, tmp_path):
    p = plain_locust(llama_like, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    lines = [ln for ln in out.splitlines() if "the server counted" in ln]
    assert len(lines) == 1, out
    assert "the server counted 2.82x the prompt tokens the client planned" in lines[0]
    assert "kvbench-words-v1" in lines[0] and "set suite.tokenizer" in lines[0]
    assert "Traceback" not in out
    t = read_run_table(tmp_path / "plain", "requests")
    # stopped at the first responses, not after a minute of load: the records say so
    ok = [r for r in t.to_pylist() if r["status"] == "ok"]
    assert CHECK_RESPONSES <= len(ok) <= CHECK_RESPONSES + 2
    for r in ok:
        assert r["prompt_tokens"] == round(2.82 * r["prompt_tokens_client"])


def test_plain_run_may_go_on_with_one_loud_warning(llama_like, tmp_path):
    p = plain_locust(llama_like, tmp_path, "--kvbench-tokenizer-check", "warn", run_time="3s")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    warnings = [ln for ln in out.splitlines() if "WARNING: the server counted 2.82x" in ln]
    assert len(warnings) == 1, out
    t = read_run_table(tmp_path / "plain", "requests")
    assert t.column("status").to_pylist().count("ok") > CHECK_RESPONSES
