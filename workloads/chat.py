"""Chat: short single-turn prompts with lognormal prompt and output lengths (ShareGPT-like).
Any lengths can be configured; ``request_class`` names the class such a table's requests carry
("chat" by default), so a second chat table (long documents, say) gets SLOs of its own.

``prompt_tokens`` is the sampled length of the whole rendered prompt (template included) when
that length exceeds the template's own tokens; each prompt's text starts differently, so two
unrelated prompts share only the template's opening tokens.
"""

from __future__ import annotations

from typing import Iterator, Literal

from pydantic import Field, field_validator

from kvbench.workloads.base import Request, SingleTurnSession
from kvbench.workloads.common import GeneratedWorkload, rng_for, sample
from kvbench.workloads.prompt import Assembler, Piece
from kvbench.workloads.registry import BuildContext, register
from kvbench.workloads.specs import MAX_REQUESTS, KindSpec, LengthDist


class ChatSpec(KindSpec):
    kind: Literal["chat"] = "chat"
    requests: int = Field(default=200, gt=0, le=MAX_REQUESTS)
    prompt_tokens: LengthDist = LengthDist(dist="lognormal", mean=180, sigma=0.8, min=8,
                                           max=4096)
    output_tokens: LengthDist = LengthDist(dist="lognormal", mean=200, sigma=0.7, min=8,
                                           max=1024)
    # The class these requests carry, for [slo.<class>] and every per-class figure.
    request_class: str = Field(default="chat", pattern=r"^[a-z][a-z0-9_-]{0,31}$")

    @field_validator("request_class")
    @classmethod
    def _class(cls, v: str) -> str:
        if v in ("mix", "trace"):
            raise ValueError(f"request_class {v!r} is reserved; name the class after its "
                             "traffic, e.g. \"longdoc\"")
        return v

    def planned_requests(self) -> int:
        return self.requests

    def max_prompt_upper(self) -> float:
        return self.prompt_tokens.upper

    def max_output_upper(self) -> float:
        return self.output_tokens.upper


class ChatWorkload(GeneratedWorkload):
    request_class = "chat"

    def __init__(self, name: str, spec: ChatSpec, tokenizer, seed: int,
                 n_requests: int | None = None):
        super().__init__(name, spec, tokenizer, seed)
        self.n_requests = n_requests or spec.requests
        self.asm = Assembler(tokenizer, spec.api)
        self.template_tokens = self.asm.overhead(["user"])

    def build_requests(self) -> Iterator[Request]:
        n = self.n_requests
        lens = sample(self.spec.prompt_tokens, rng_for(self.seed, self.name, "prompt"), n)
        outs = sample(self.spec.output_tokens, rng_for(self.seed, self.name, "output"), n)
        over = self.template_tokens
        for i in range(n):
            body = max(int(lens[i]) - over, 1)
            text = self.text.segment(f"{self.name}/prompt{i}", body)
            messages, prompt, total, _ = self.asm.build([("user", [Piece(text, body)])])
            rid = f"{self.name}-{i:06d}"
            yield Request(request_id=rid, request_class=self.spec.request_class, max_tokens=int(outs[i]),
                          prompt_tokens=total, shared_prefix_tokens=0, session_id=rid,
                          prompt=prompt, messages=messages, workload=self.name)

    def sessions(self):
        return (SingleTurnSession(r) for r in self.build_requests())

    def requests(self):
        return self.build_requests()


def _build(name: str, spec: ChatSpec, ctx: BuildContext) -> ChatWorkload:
    return ChatWorkload(name, spec, ctx.tokenizer, ctx.seed, ctx.n_requests)


register(spec=ChatSpec, build=_build, request_class=ChatWorkload.request_class)
