"""API keys come from the environment, are sent as a bearer token, and never reach results."""

import pytest

from kvbench.core.errors import UserError
from kvbench.runs.auth import auth_headers


def test_key_from_environment(monkeypatch):
    monkeypatch.setenv("KVB_TEST_KEY", "sk-secret")
    h = auth_headers({"x-extra": "1"}, "KVB_TEST_KEY", "endpoint 'staging'")
    assert h == {"x-extra": "1", "Authorization": "Bearer sk-secret"}
    assert auth_headers(None, None, "endpoint 'x'") == {}


def test_missing_key_is_one_sentence_naming_the_variable(monkeypatch):
    monkeypatch.delenv("KVB_TEST_KEY", raising=False)
    with pytest.raises(UserError) as ei:
        auth_headers({}, "KVB_TEST_KEY", "endpoint 'staging'")
    msg = str(ei.value)
    assert "KVB_TEST_KEY" in msg and "'staging'" in msg and "\n" not in msg


def test_credentials_in_config_headers_are_masked_in_the_resolved_config():
    from pathlib import Path

    from kvbench.config import load_config, parse_config
    import tomllib

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "bench.toml").read_text())
    data["endpoints"].append({"name": "vendor", "kind": "openai", "url": "http://127.0.0.1:9",
                              "headers": {"Authorization": "Bearer sk-live",
                                          "x-route": "eu"}})
    dumped = parse_config(data).public_dump()
    vendor = [e for e in dumped["endpoints"] if e["name"] == "vendor"][0]
    assert vendor["headers"] == {"Authorization": "<redacted>", "x-route": "<redacted>"}
    assert "sk-live" not in str(dumped)
    assert load_config(root / "bench.toml").public_dump()["gate"]["rules"][0]["class"] == "*"


def test_job_file_holds_no_secret_and_the_child_gets_it_from_the_environment(tmp_path,
                                                                              monkeypatch):
    from kvbench.config import parse_config
    from kvbench.runs.job import SECRET_HEADERS_ENV, Job, resolve

    cfg = parse_config({
        "endpoints": [{"name": "vendor", "kind": "openai", "url": "http://127.0.0.1:9",
                       "model": "m", "api_key_env": "KVB_TEST_KEY",
                       "headers": {"X-Api-Key": "sk-live", "x-route": "eu"}}],
        "workloads": {"chat": {"kind": "chat", "requests": 3}},
        "profiles": {"p": {"stages": [{"users": 1, "duration_s": 1}]}}})
    job = resolve(cfg, workload="chat", endpoint="vendor", run_id="r", results_dir=tmp_path)
    path = job.save(tmp_path / "job.json")
    assert "sk-live" not in path.read_text() and "KVB_TEST_KEY" in path.read_text()
    monkeypatch.setenv("KVB_TEST_KEY", "sk-key")
    child = Job.load(path, environ={SECRET_HEADERS_ENV: job.secret_env()[SECRET_HEADERS_ENV]})
    assert child.headers() == {"x-route": "eu", "X-Api-Key": "sk-live",
                               "Authorization": "Bearer sk-key"}
    # every configured header value travels in the environment, never in the job file
    assert '"eu"' not in path.read_text()
    assert Job.load(path, environ={}).headers() == {"Authorization": "Bearer sk-key"}
