"""Long contracts: each contract is one sticky session asked several questions.

A turn sends the whole contract and then the question (no history), so every question on a
contract reuses its tokens. ``requests()`` follows ``order``: "interleave" asks round robin
across contracts; "tile" asks all questions of contract 1, then contract 2, ... (as LMCache's
long-document QA benchmark does, so that a cache smaller than all contracts evicts).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from kvbench.core.errors import UserError
from kvbench.workloads.base import Request
from kvbench.workloads.common import GeneratedWorkload, rng_for, sample
from kvbench.workloads.prompt import Assembler, Piece
from kvbench.workloads.registry import BuildContext, register
from kvbench.workloads.specs import MAX_ACTIVE_SESSIONS, MAX_SESSION_TURNS, KindSpec, LengthDist


class LongctxSpec(KindSpec):
    kind: Literal["longctx"] = "longctx"
    # "interleave" keeps every contract's session active at once
    contracts: int = Field(default=4, gt=0, le=MAX_ACTIVE_SESSIONS)
    contract_tokens: LengthDist = LengthDist(dist="uniform", mean=32768, min=16384, max=32768)
    questions_per_contract: int = Field(default=4, gt=0, le=MAX_SESSION_TURNS)
    question_tokens: LengthDist = LengthDist(dist="lognormal", mean=32, sigma=0.3, min=8, max=128)
    output_tokens: LengthDist = LengthDist(dist="lognormal", mean=96, sigma=0.4, min=8, max=512)
    order: Literal["interleave", "tile"] = "interleave"
    think_time_s: LengthDist = LengthDist(dist="uniform", mean=0.2, min=0.0, max=0.5)

    sizable: ClassVar[bool] = True

    def planned_requests(self) -> int:
        return self.contracts * self.questions_per_contract

    def max_prompt_upper(self) -> float:
        return self.contract_tokens.upper + self.question_tokens.upper

    def max_output_upper(self) -> float:
        return self.output_tokens.upper


class ContractSession:
    def __init__(self, wl: "LongctxWorkload", index: int, questions: int):
        self.wl = wl
        self.index = index
        self.session_id = f"{wl.name}-c{index:04d}"
        self.questions = questions
        rng = rng_for(wl.seed, wl.name, "questions", index)
        self.q_lens = sample(wl.spec.question_tokens, rng, questions)
        self.outs = sample(wl.spec.output_tokens, rng, questions)
        self.thinks = sample(wl.spec.think_time_s, rng, questions, integer=False)
        self.turn = 0
        self._contract: Piece | None = None

    def next_request(self) -> Request | None:
        k = self.turn
        if k >= self.questions:
            self._contract = None  # let the text go once the session is over
            return None
        wl = self.wl
        if self._contract is None:
            self._contract = wl.contract(self.index)
        n = int(self.q_lens[k])
        q = Piece(wl.text.segment(f"{self.session_id}/question{k}", n), n)
        messages, prompt, total, shared = wl.asm.build([("user", [self._contract, q])],
                                                       shared=(0, 1))
        self.turn += 1
        return Request(
            request_id=f"{self.session_id}-q{k:03d}", request_class="longctx",
            max_tokens=int(self.outs[k]), prompt_tokens=total, shared_prefix_tokens=shared,
            session_id=self.session_id, turn=k, prompt=prompt, messages=messages,
            think_time_s=float(self.thinks[k]) if k else 0.0, workload=wl.name)

    def feed_response(self, text: str) -> None:
        pass  # each question stands alone on the contract


class LongctxWorkload(GeneratedWorkload):
    request_class = "longctx"

    def __init__(self, name: str, spec: LongctxSpec, tokenizer, seed: int,
                 n_requests: int | None = None):
        super().__init__(name, spec, tokenizer, seed)
        self.asm = Assembler(tokenizer, spec.api)
        self.flatten_order = "sequential" if spec.order == "tile" else "round_robin"
        self._lengths: list[int] = []
        self.n_contracts = self._size_contracts() if spec.working_set else spec.contracts
        per = spec.questions_per_contract
        if n_requests is not None:  # a mix asks for a number of requests: more questions each
            per = -(-n_requests // self.n_contracts)
        self.questions = [per] * self.n_contracts
        if n_requests is not None:
            extra = per * self.n_contracts - n_requests
            for i in range(extra):
                self.questions[self.n_contracts - 1 - i % self.n_contracts] -= 1

    def contract_tokens(self, index: int) -> int:
        while len(self._lengths) <= index:
            i = len(self._lengths)
            n = sample(self.spec.contract_tokens, rng_for(self.seed, self.name, "contract", i), 1)
            self._lengths.append(int(n[0]))
        return self._lengths[index]

    def contract(self, index: int) -> Piece:
        n = self.contract_tokens(index)
        return Piece(self.text.segment(f"{self.name}/contract{index}", n), n)

    def _size_contracts(self) -> int:
        ws = self.spec.working_set
        target = ws.multiple * ws.kv_capacity_tokens
        total, k = 0, 0
        while total < target:
            total += self.contract_tokens(k)
            k += 1
            if k > 1_000_000:
                raise UserError(f"workloads.{self.name}.working_set: needs over a million "
                                "contracts; lower multiple")
        return k

    def sessions(self):
        return (ContractSession(self, i, q) for i, q in enumerate(self.questions) if q > 0)

    def unique_contract_tokens(self) -> int:
        return int(np.sum([self.contract_tokens(i) for i in range(self.n_contracts)]))


def _build(name: str, spec: LongctxSpec, ctx: BuildContext) -> LongctxWorkload:
    return LongctxWorkload(name, spec, ctx.tokenizer, ctx.seed, ctx.n_requests)


register(spec=LongctxSpec, build=_build, request_class=LongctxWorkload.request_class)
