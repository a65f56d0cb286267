"""Agent: sessions of tool-using turns on one system prompt and tool schemas shared by all.

Turn 0 sends system (prompt + tool schemas) and the session's task. Turn k+1 sends turn k's
messages, the model's actual response (``feed_response``) as an assistant message, and a tool
result as a user message. ``shared_prefix_tokens`` is the system message on turn 0 and
everything up to the end of the previous response afterwards. A turn whose previous response
was never fed (the request failed) continues with an empty response.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from kvbench.workloads.base import Request
from kvbench.workloads.common import GeneratedWorkload, rng_for, sample
from kvbench.workloads.prompt import Assembler, Piece
from kvbench.workloads.registry import BuildContext, register
from kvbench.workloads.specs import (MAX_REQUESTS, MAX_SESSION_TURNS, MAX_TOKENS, KindSpec,
                                     LengthDist)


class AgentSpec(KindSpec):
    kind: Literal["agent"] = "agent"
    sessions: int = Field(default=16, gt=0, le=MAX_REQUESTS)
    turns: int = Field(default=6, gt=0, le=MAX_SESSION_TURNS)
    system_prompt_tokens: int = Field(default=512, ge=0, le=MAX_TOKENS)
    tool_schema_tokens: int = Field(default=1024, ge=0, le=MAX_TOKENS)
    task_tokens: LengthDist = LengthDist(dist="lognormal", mean=96, sigma=0.5, min=16, max=512)
    tool_result_tokens: LengthDist = LengthDist(dist="lognormal", mean=384, sigma=0.7, min=16,
                                                max=4096)
    output_tokens: LengthDist = LengthDist(dist="lognormal", mean=96, sigma=0.5, min=8, max=512)
    think_time_s: LengthDist = LengthDist(dist="uniform", mean=0.5, min=0.1, max=1.0)

    sizable: ClassVar[bool] = True

    def planned_requests(self) -> int:
        return self.sessions * self.turns

    def max_output_upper(self) -> float:
        return self.output_tokens.upper


class AgentSession:
    def __init__(self, wl: "AgentWorkload", index: int, turns: int | None = None):
        spec = wl.spec
        self.wl = wl
        self.index = index
        self.session_id = f"{wl.name}-s{index:05d}"
        self.turns = spec.turns if turns is None else turns
        rng = rng_for(wl.seed, wl.name, "session", index)
        t = spec.turns
        self.task_len = int(sample(spec.task_tokens, rng, 1)[0])
        self.tool_lens = sample(spec.tool_result_tokens, rng, t)
        self.outs = sample(spec.output_tokens, rng, t)
        self.thinks = sample(spec.think_time_s, rng, t, integer=False)
        self.turn = 0
        self.msgs: list[tuple[str, list[Piece]]] = [
            ("system", [wl.system, wl.tools]),
            ("user", [Piece(wl.text.segment(f"{self.session_id}/task", self.task_len),
                            self.task_len)]),
        ]
        self._awaiting = False

    def next_request(self) -> Request | None:
        if self.turn >= self.turns:
            return None
        wl = self.wl
        k = self.turn
        if k == 0:
            shared = (0, 2)
        else:
            if self._awaiting:  # the last response never came back
                self.feed_response("")
            shared = (len(self.msgs) - 1, 1)
            n = int(self.tool_lens[k])
            tool = wl.text.segment(f"{self.session_id}/tool{k}", n)
            self.msgs.append(("user", [Piece(tool, n)]))
        messages, prompt, total, shared_tokens = wl.asm.build(self.msgs, shared=shared)
        self.turn += 1
        self._awaiting = True
        return Request(
            request_id=f"{self.session_id}-t{k:03d}", request_class="agent",
            max_tokens=int(self.outs[k]), prompt_tokens=total,
            shared_prefix_tokens=shared_tokens, session_id=self.session_id, turn=k,
            prompt=prompt, messages=messages,
            think_time_s=float(self.thinks[k]) if k else 0.0, workload=wl.name,
            prefix_from_responses=k > 0)

    def feed_response(self, text: str) -> None:
        if not self._awaiting:
            return
        self._awaiting = False
        self.msgs.append(("assistant", [self.wl.asm.piece(text)]))


class AgentWorkload(GeneratedWorkload):
    request_class = "agent"
    flatten_order = "round_robin"
    window = 32  # sessions in flight at once in requests(): turns of one session stay close

    def __init__(self, name: str, spec: AgentSpec, tokenizer, seed: int,
                 n_requests: int | None = None):
        super().__init__(name, spec, tokenizer, seed)
        self.asm = Assembler(tokenizer, spec.api)
        self.n_sessions = spec.sessions
        self.last_turns = spec.turns
        if n_requests is not None:
            self.n_sessions = -(-n_requests // spec.turns)
            self.last_turns = n_requests - (self.n_sessions - 1) * spec.turns
        elif spec.working_set is not None:
            self.n_sessions = self._size_sessions()
        self.system = Piece(self.text.segment(f"{name}/system", spec.system_prompt_tokens),
                            spec.system_prompt_tokens)
        self.tools = Piece(self.text.segment(f"{name}/tools", spec.tool_schema_tokens),
                           spec.tool_schema_tokens)

    def _size_sessions(self) -> int:
        """Sessions whose transcripts (task, tool results, outputs) add up to the target."""
        ws = self.spec.working_set
        target = ws.multiple * ws.kv_capacity_tokens - self.spec.system_prompt_tokens \
            - self.spec.tool_schema_tokens
        total, s = 0, 0
        while total < target and s < 10_000_000:
            rng = rng_for(self.seed, self.name, "session", s)
            t = self.spec.turns
            total += int(sample(self.spec.task_tokens, rng, 1)[0])
            total += int(sample(self.spec.tool_result_tokens, rng, t)[1:].sum())
            total += int(sample(self.spec.output_tokens, rng, t).sum())
            s += 1
        return max(s, 1)

    def sessions(self):
        for i in range(self.n_sessions):
            last = i == self.n_sessions - 1
            yield AgentSession(self, i, self.last_turns if last else None)


def _build(name: str, spec: AgentSpec, ctx: BuildContext) -> AgentWorkload:
    return AgentWorkload(name, spec, ctx.tokenizer, ctx.seed, ctx.n_requests)


register(spec=AgentSpec, build=_build, request_class=AgentWorkload.request_class)
