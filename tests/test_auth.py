"""API keys come from the environment, are sent as a bearer token, and never reach results."""

import pytest

from kvbench.errors import UserError
from loadgen.openai import auth_headers


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
