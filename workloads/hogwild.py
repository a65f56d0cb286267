"""Hogwild!: N workers on one task write to one shared, growing transcript.

Each worker's prompt is the task, then every output any worker of that task has produced so
far (each under its worker's label, in the order the outputs arrived), then the worker's own
label to continue from. All workers of a task share one transcript object, so they must run in
one process; ``requests()`` sends a round of every worker, then appends the round's outputs
(workers in one round run concurrently). ``shared_prefix_tokens`` covers task and transcript.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvbench.workloads.base import Request
from kvbench.workloads.common import GeneratedWorkload, rng_for, sample
from kvbench.workloads.prompt import Assembler, Piece
from kvbench.workloads.registry import BuildContext, register
from kvbench.workloads.specs import (MAX_ACTIVE_SESSIONS, MAX_REQUESTS, MAX_SESSION_TURNS,
                                     KindSpec, LengthDist, const)


class HogwildSpec(KindSpec):
    kind: Literal["hogwild"] = "hogwild"
    tasks: int = Field(default=2, gt=0, le=MAX_REQUESTS)
    # each worker's prompt holds every worker's output (Hogwild! runs 2 to 4): past a few
    # hundred the shared transcript outgrows any context
    workers: int = Field(default=4, gt=0, le=256)
    steps_per_worker: int = Field(default=4, gt=0, le=MAX_SESSION_TURNS)
    task_tokens: LengthDist = const(512)
    step_output_tokens: LengthDist = LengthDist(dist="lognormal", mean=64, sigma=0.3, min=8,
                                                max=256)

    def planned_requests(self) -> int:
        return self.tasks * self.workers * self.steps_per_worker

    @model_validator(mode="after")
    def _sessions(self):
        # every worker of every task is one session, all active at once (round robin)
        if self.tasks * self.workers > MAX_ACTIVE_SESSIONS:
            raise ValueError(f"tasks x workers is {self.tasks * self.workers:,} sessions at "
                             f"once, over {MAX_ACTIVE_SESSIONS:,}; lower tasks or workers")
        return self

    def max_output_upper(self) -> float:
        return self.step_output_tokens.upper


class _Task:
    def __init__(self, wl: "HogwildWorkload", index: int):
        self.index = index
        n = int(sample(wl.spec.task_tokens, rng_for(wl.seed, wl.name, "task", index), 1)[0])
        self.task = Piece(wl.text.segment(f"{wl.name}/task{index}", n), n)
        self.transcript: list[Piece] = []


class HogwildSession:
    def __init__(self, wl: "HogwildWorkload", task: _Task, worker: int, steps: int):
        self.wl = wl
        self.task = task
        self.worker = worker
        self.steps = steps
        self.session_id = f"{wl.name}-t{task.index:04d}-w{worker:02d}"
        rng = rng_for(wl.seed, wl.name, "worker", task.index, worker)
        self.outs = sample(wl.spec.step_output_tokens, rng, steps)
        self.turn = 0
        self._awaiting = False

    def next_request(self) -> Request | None:
        k = self.turn
        if k >= self.steps:
            return None
        wl = self.wl
        self._awaiting = True
        parts = [self.task.task, *self.task.transcript, wl.label(self.worker)]
        messages, prompt, total, shared = wl.asm.build([("user", parts)],
                                                       shared=(0, len(parts) - 1))
        self.turn += 1
        return Request(
            request_id=f"{self.session_id}-s{k:03d}", request_class="hogwild",
            max_tokens=int(self.outs[k]), prompt_tokens=total, shared_prefix_tokens=shared,
            session_id=self.session_id, turn=k, prompt=prompt, messages=messages,
            workload=wl.name, prefix_from_responses=bool(self.task.transcript))

    def feed_response(self, text: str) -> None:
        if not self._awaiting:
            return
        self._awaiting = False
        label = self.wl.label(self.worker)
        self.task.transcript.extend([label, self.wl.asm.piece(text)])


class HogwildWorkload(GeneratedWorkload):
    request_class = "hogwild"
    flatten_order = "round_robin"

    def __init__(self, name: str, spec: HogwildSpec, tokenizer, seed: int,
                 n_requests: int | None = None):
        super().__init__(name, spec, tokenizer, seed)
        self.asm = Assembler(tokenizer, spec.api)
        per_task = spec.workers * spec.steps_per_worker
        self.n_tasks = spec.tasks if n_requests is None else -(-n_requests // per_task)
        self.n_requests = n_requests if n_requests is not None else self.n_tasks * per_task
        self._labels: dict[int, Piece] = {}

    def label(self, worker: int) -> Piece:
        p = self._labels.get(worker)
        if p is None:
            p = self._labels[worker] = self.asm.piece(f"\n\n[worker {worker + 1}]")
        return p

    def sessions(self):
        spec = self.spec
        left = self.n_requests
        for t in range(self.n_tasks):
            task = _Task(self, t)
            for w in range(spec.workers):
                # a mix may ask for fewer requests than whole tasks hold: trim the last steps
                steps = min(spec.steps_per_worker, left)
                if steps <= 0:
                    return
                left -= steps
                yield HogwildSession(self, task, w, steps)


def _build(name: str, spec: HogwildSpec, ctx: BuildContext) -> HogwildWorkload:
    return HogwildWorkload(name, spec, ctx.tokenizer, ctx.seed, ctx.n_requests)


register(spec=HogwildSpec, build=_build, request_class=HogwildWorkload.request_class)
