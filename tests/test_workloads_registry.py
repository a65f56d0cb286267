"""A workload kind is one module that registers its spec, generator and request class. The kind
below ("echo") exists only in this test file: registering it is all it takes for a bench.toml
table to validate, build through the normal path (alone and in a mix) and generate requests."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from kvbench.config import load_config, parse_config
from kvbench.core.errors import UserError
from kvbench.workloads import registry
from kvbench.workloads.base import Request, SingleTurnSession
from kvbench.workloads.common import GeneratedWorkload
from kvbench.workloads.prompt import Assembler, Piece
from kvbench.workloads.registry import build_spec, make_workload, register
from kvbench.workloads.specs import KindSpec
from kvbench.workloads.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOK = get_tokenizer()


# ---- the example kind: everything it needs, in one place ---------------------------------
class EchoSpec(KindSpec):
    kind: Literal["echo"] = "echo"
    requests: int = Field(default=5, gt=0)
    prompt_tokens: int = Field(default=40, gt=8)
    output_tokens: int = Field(default=16, gt=0)

    def max_prompt_upper(self) -> float:
        return self.prompt_tokens

    def max_output_upper(self) -> float:
        return self.output_tokens


class EchoWorkload(GeneratedWorkload):
    """The same-length prompt, a fresh text each time."""

    request_class = "echo"

    def __init__(self, name, spec: EchoSpec, tokenizer, seed: int, n_requests=None):
        super().__init__(name, spec, tokenizer, seed)
        self.n = n_requests or spec.requests
        self.asm = Assembler(tokenizer, spec.api)

    def requests(self):
        over = self.asm.overhead(["user"])
        for i in range(self.n):
            body = self.spec.prompt_tokens - over
            text = self.text.segment(f"{self.name}/{i}", body)
            messages, prompt, total, _ = self.asm.build([("user", [Piece(text, body)])])
            rid = f"{self.name}-{i}"
            yield Request(request_id=rid, request_class="echo", max_tokens=self.spec.output_tokens,
                          prompt_tokens=total, shared_prefix_tokens=0, session_id=rid,
                          prompt=prompt, messages=messages, workload=self.name)

    def sessions(self):
        return (SingleTurnSession(r) for r in self.requests())


def _build_echo(name, spec, ctx):
    return EchoWorkload(name, spec, ctx.tokenizer, ctx.seed, ctx.n_requests)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def echo_kind():
    kind = register(spec=EchoSpec, build=_build_echo, request_class="echo")
    yield kind
    registry.unregister("echo")


def _config(extra: str) -> dict:
    return tomllib.loads((ROOT / "bench.toml").read_text() + "\n" + extra)


ECHO = "[workloads.hello]\nkind = \"echo\"\nrequests = 4\nprompt_tokens = 30\n"


def test_registered_kind_validates_builds_and_generates(echo_kind):
    cfg = parse_config(_config(ECHO), "bench.toml")
    spec = cfg.workloads["hello"]
    assert isinstance(spec, EchoSpec) and spec.requests == 4
    assert cfg.public_dump()["workloads"]["hello"]["prompt_tokens"] == 30  # dumped as itself
    wl = make_workload("hello", cfg, TOK)
    reqs = list(wl.requests())
    assert len(reqs) == 4 and {r.request_class for r in reqs} == {echo_kind.request_class}
    assert all(r.prompt_tokens == 30 == TOK.count_chat(r.messages) for r in reqs)
    assert "echo" in registry.request_classes()
    assert [r.request_id for r in build_spec("x", EchoSpec(requests=2), TOK, 0).requests()] \
        == ["x-0", "x-1"]


def test_registered_kind_joins_a_mix(echo_kind):
    cfg = parse_config(_config(ECHO + "[workloads.both]\nkind = \"mix\"\nrequests = 20\n"
                               "components = [{ workload = \"hello\", weight = 1 },"
                               " { workload = \"chat\", weight = 1 }]\n"))
    reqs = list(make_workload("both", cfg, TOK).requests())
    assert len(reqs) == 20 and {r.request_class for r in reqs} == {"echo", "chat"}


def test_registered_kind_errors_are_one_sentence(echo_kind, tmp_path):
    p = tmp_path / "bench.toml"
    p.write_text((ROOT / "bench.toml").read_text() + "\n" + ECHO + "promt_tokens = 3\n")
    with pytest.raises(UserError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: field workloads.hello.promt_tokens: ") and msg.count("\n") == 0
    # the context check asks the kind's own spec for its bounds
    big = _config(ECHO.replace("30", "200000"))  # over the built-in endpoints' 131072
    with pytest.raises(UserError, match="workloads.hello: prompts plus outputs can reach 200016"):
        parse_config(big)


def test_union_follows_the_registry():
    with pytest.raises(UserError, match="workloads.hello: Input tag 'echo'"):
        parse_config(_config(ECHO))  # not registered: not a kind
    register(spec=EchoSpec, build=_build_echo, request_class="echo")
    try:
        assert isinstance(parse_config(_config(ECHO)).workloads["hello"], EchoSpec)
        assert register(spec=EchoSpec, build=_build_echo, request_class="echo").spec is EchoSpec
    finally:
        registry.unregister("echo")
    with pytest.raises(UserError):
        parse_config(_config(ECHO))


def test_a_taken_kind_cannot_be_registered_again():
    class OtherRag(KindSpec):
        kind: Literal["rag"] = "rag"

    with pytest.raises(ValueError, match="'rag' is registered twice"):
        register(spec=OtherRag, build=_build_echo, request_class="rag")
    with pytest.raises(TypeError):
        register(spec=dict, build=_build_echo, request_class="x")


def test_builtin_kinds_are_discovered():
    assert {"rag", "agent", "longctx", "chat", "hogwild", "mix", "trace"} <= set(registry.kinds())
    assert set(registry.request_classes()) >= {"rag", "agent", "longctx", "chat", "hogwild",
                                               "trace"}
    assert "mix" not in registry.request_classes()  # a mix sends its parts' classes
