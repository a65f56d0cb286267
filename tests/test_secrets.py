"""Redaction by value (kvbench.core.redact): a registered secret never survives in any text,
whole, escaped, behind an auth scheme or cut by a truncation; URL userinfo never survives; the
config, run.json's endpoints and the log handlers write no secret."""

from __future__ import annotations

import io
import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.core import redact
from kvbench.core.redact import MARK


@pytest.fixture(autouse=True)
def fresh():
    redact.clear()
    yield
    redact.clear()


secret_text = st.text(min_size=redact.MIN_CHARS, max_size=60).filter(lambda s: s not in MARK)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(secret=secret_text, others=st.lists(secret_text, max_size=3), before=st.text(),
       after=st.text(), times=st.integers(1, 3))
def test_a_registered_secret_embedded_in_any_text_never_survives(secret, others, before, after,
                                                                 times):
    redact.clear()
    for s in others:
        redact.add(s)
    redact.add(secret)
    text = before + (secret + after) * times
    out = redact.redact(text)
    assert secret not in out
    assert MARK in out


@settings(max_examples=200, deadline=None)
@given(secret=secret_text, before=st.text(max_size=40), cut=st.integers(redact.MIN_CHARS, 60))
def test_a_secret_cut_by_a_truncation_leaves_no_piece_of_min_chars(secret, before, cut):
    redact.clear()
    redact.add(secret)
    piece = secret[:cut]
    assert piece not in redact.redact(before + piece) or len(piece) < redact.MIN_CHARS
    tail = secret[-cut:]
    assert tail not in redact.redact(tail + before) or len(tail) < redact.MIN_CHARS


@settings(max_examples=200, deadline=None)
@given(token=st.text(st.characters(blacklist_categories=("Z", "C")), min_size=6, max_size=40)
       .filter(lambda s: s not in MARK),
       scheme=st.sampled_from(["Bearer", "Basic", "Token", "ApiKey"]), around=st.text())
def test_a_header_value_after_an_auth_scheme_is_redacted_alone_too(token, scheme, around):
    redact.add_header(f"{scheme} {token}")
    assert token not in redact.redact(f"{around}key {token} was refused{around}")
    assert token not in redact.redact(f"{scheme} {token}")


def test_escaped_forms_are_redacted():
    key = 'sk-a"b/c<d>&e f'
    redact.add(key)
    for form in (key, json.dumps(key)[1:-1], "sk-a%22b%2Fc%3Cd%3E%26e%20f",
                 "sk-a&quot;b/c&lt;d&gt;&amp;e f"):
        assert form not in redact.redact(f"body: {form}!"), form
    redact.add("sk-exported-with-newline\n")
    assert redact.redact("key sk-exported-with-newline.") == f"key {MARK}."


def test_short_values_are_not_secrets_and_nothing_registered_is_a_no_op():
    text = "x-route eu: sent to region eu"
    assert redact.redact(text) is text  # nothing registered, no @: the same object back
    redact.add("eu")
    redact.add_header("on")
    redact.add(None)
    assert redact.known() == 0 and redact.redact(text) is text
    redact.add("secret")  # six characters: a secret
    assert redact.redact("a secret word") == f"a {MARK} word"


@given(user=st.from_regex(r"[A-Za-z0-9._~-]{1,12}", fullmatch=True),
       password=st.from_regex(r"[A-Za-z0-9._~%!$&'()*+,;=-]{1,20}", fullmatch=True))
def test_url_userinfo_never_survives_registered_or_not(user, password):
    url = f"http://{user}:{password}@10.0.0.1:8000/v1"
    out = redact.redact(f"endpoint at {url} does not answer")
    assert f"{user}:{password}@" not in out and "@10.0.0.1:8000/v1" in out
    assert redact.redact_url(url) == f"http://{MARK}@10.0.0.1:8000/v1"


def test_url_password_is_registered_for_texts_without_the_url():
    redact.add_url("https://bench:hunter2-pw@gw.example/v1")
    redact.add_url("https://ghp_tokentoken@gw.example")
    out = redact.redact("nonnumeric port: 'hunter2-pw@gw.example'; token ghp_tokentoken")
    assert "hunter2-pw" not in out and "ghp_tokentoken" not in out


def test_redact_obj_keeps_keys_and_structure():
    redact.add("sk-live-123")
    obj = {"a": ["x sk-live-123", 3, None, {"b": "http://u:p@h/"}], "sk-live-123": 1.5}
    assert redact.redact_obj(obj) == {"a": [f"x {MARK}", 3, None, {"b": f"http://{MARK}@h/"}],
                                      "sk-live-123": 1.5}


def test_log_filter_redacts_messages_arguments_and_tracebacks():
    redact.add("sk-logged-key")
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("kvbench.test.secrets")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        redact.install_log_filter("kvbench.test.secrets")
        redact.install_log_filter("kvbench.test.secrets")  # once per handler
        assert len(handler.filters) == 1
        logger.error("refused: %s", "Bearer sk-logged-key")
        try:
            raise RuntimeError("HTTP 401: Incorrect API key provided: sk-logged-key")
        except RuntimeError:
            logger.exception("request failed")
    finally:
        logger.removeHandler(handler)
    out = buf.getvalue()
    assert "sk-logged-key" not in out
    assert f"refused: Bearer {MARK}" in out and f"provided: {MARK}" in out


def test_every_configured_secret_is_known_after_config_load_and_masked_in_its_dump(monkeypatch):
    from kvbench.config import parse_config

    monkeypatch.setenv("KVB_SECRETS_KEY", "sk-from-env-1")
    cfg = parse_config({
        "endpoints": [{"name": "vendor", "kind": "openai",
                       "url": "http://bench:url-pass-9@127.0.0.1:9", "model": "m",
                       "api_key_env": "KVB_SECRETS_KEY",
                       "headers": {"X-Password": "pw-inline-2", "X-Custom": "Bearer tok-inline-3",
                                   "x-route": "eu"}}],
        "workloads": {"chat": {"kind": "chat", "requests": 3}},
        "profiles": {"p": {"stages": [{"users": 1, "duration_s": 1}]}}})
    said = redact.redact("echo: sk-from-env-1 pw-inline-2 tok-inline-3 url-pass-9")
    assert said == f"echo: {MARK} {MARK} {MARK} {MARK}"
    dumped = json.dumps(cfg.public_dump())
    for v in ("sk-from-env-1", "pw-inline-2", "tok-inline-3", "url-pass-9", '"eu"'):
        assert v not in dumped
    ep = cfg.public_dump()["endpoints"][0]
    assert ep["headers"] == {"X-Password": MARK, "X-Custom": MARK, "x-route": MARK}


def test_a_job_file_loaded_in_a_child_registers_the_secrets_it_gets(tmp_path):
    from kvbench.config import parse_config
    from kvbench.runs.job import SECRET_HEADERS_ENV, Job, resolve

    cfg = parse_config({
        "endpoints": [{"name": "vendor", "kind": "openai", "url": "http://127.0.0.1:9",
                       "model": "m", "api_key_env": "KVB_SECRETS_KEY2",
                       "headers": {"X-Password": "pw-child-22"}}],
        "workloads": {"chat": {"kind": "chat", "requests": 3}},
        "profiles": {"p": {"stages": [{"users": 1, "duration_s": 1}]}}})
    job = resolve(cfg, workload="chat", endpoint="vendor", run_id="r", results_dir=tmp_path)
    path = job.save(tmp_path / "job.json")
    assert "pw-child-22" not in path.read_text()
    redact.clear()  # a fresh process: it knows only what the job and its environment give
    Job.load(path, environ={**job.secret_env(), "KVB_SECRETS_KEY2": "sk-child-key"})
    assert SECRET_HEADERS_ENV in job.secret_env()
    assert redact.redact("pw-child-22 sk-child-key") == f"{MARK} {MARK}"


def test_endpoint_record_and_report_appendix_strip_url_userinfo():
    from kvbench.core.redact import public_config
    from kvbench.runs.job import JobEndpoint

    rec = JobEndpoint(name="e", url="http://u:pw-in-url@127.0.0.1:9").record()
    assert rec.url == f"http://{MARK}@127.0.0.1:9"
    # a run.json written before redaction: the report masks its header values anyway
    old = {"endpoints": [{"name": "e", "headers": {"X-Custom": "Bearer old-secret"},
                          "url": "http://u:old-pw@h"}], "suite": {"name": "s"}}
    assert "old-secret" not in json.dumps(public_config(old))
    assert "old-pw" not in json.dumps(public_config(old))


def test_locust_child_log_is_scrubbed_of_what_it_printed_outside_logging(tmp_path):
    from kvbench.runs import locust as runs_locust

    key = "sk-printed-outside-logging-42"
    redact.add(key)
    log = tmp_path / "locust-x.log"
    log.write_text(f"Traceback (most recent call last):\n  RuntimeError: bad key {key}\n")
    runs_locust._scrub(log)
    text = log.read_text()
    assert key not in text and redact.MARK in text and "RuntimeError: bad key" in text
