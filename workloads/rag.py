"""RAG: a system prompt, the top-k chunks of Zipf-popular documents, then a question.

A request takes the first chunks (in order) of one document drawn by Zipf popularity; when
``top_k`` exceeds ``chunks_per_document`` further distinct documents are drawn the same way.
So requests on the same first document carry its tokens identically, right after the shared
system prompt. ``shared_prefix_tokens`` covers the system prompt and all retrieved chunks.
"""

from __future__ import annotations

from typing import ClassVar, Iterator, Literal

import numpy as np
from pydantic import Field

from kvbench.core.errors import UserError
from kvbench.workloads.base import Request, SingleTurnSession
from kvbench.workloads.common import GeneratedWorkload, rng_for, sample, zipf_cdf
from kvbench.workloads.prompt import Assembler, Piece
from kvbench.workloads.registry import BuildContext, register
from kvbench.workloads.specs import MAX_REQUESTS, MAX_TOKENS, KindSpec, LengthDist, const


class RagSpec(KindSpec):
    kind: Literal["rag"] = "rag"
    requests: int = Field(default=200, gt=0, le=MAX_REQUESTS)
    documents: int = Field(default=100, gt=0, le=MAX_REQUESTS)
    # retrieval returns tens of chunks; 10,000 is far past any retriever's top_k
    chunks_per_document: int = Field(default=4, gt=0, le=10_000)
    chunk_tokens: LengthDist = const(256)
    top_k: int = Field(default=4, gt=0, le=10_000)
    zipf_s: float = Field(default=1.1, gt=0, le=100)  # popularity exponent over documents
    system_prompt_tokens: int = Field(default=128, ge=0, le=MAX_TOKENS)
    question_tokens: LengthDist = LengthDist(dist="lognormal", mean=24, sigma=0.4, min=4, max=128)
    output_tokens: LengthDist = LengthDist(dist="lognormal", mean=128, sigma=0.5, min=8, max=512)

    sizable: ClassVar[bool] = True

    def planned_requests(self) -> int:
        return self.requests

    def max_prompt_upper(self) -> float:
        return (self.system_prompt_tokens + self.top_k * self.chunk_tokens.upper
                + self.question_tokens.upper)

    def max_output_upper(self) -> float:
        return self.output_tokens.upper


class RagWorkload(GeneratedWorkload):
    request_class = "rag"

    def __init__(self, name: str, spec: RagSpec, tokenizer, seed: int,
                 n_requests: int | None = None):
        super().__init__(name, spec, tokenizer, seed)
        self.n_requests = n_requests or spec.requests
        self.asm = Assembler(tokenizer, spec.api)
        self.used_chunks = min(spec.top_k, spec.chunks_per_document)
        self._doc_lengths: dict[int, np.ndarray] = {}
        self.documents = self._size_documents()
        self._docs: dict[int, Piece] = {}
        self.system = self.asm.piece(
            self.text.segment(f"{name}/system", spec.system_prompt_tokens))

    def _chunk_lengths(self, d: int) -> np.ndarray:
        got = self._doc_lengths.get(d)
        if got is None:
            got = self._doc_lengths[d] = sample(
                self.spec.chunk_tokens, rng_for(self.seed, self.name, "doc", d),
                self.spec.chunks_per_document)
        return got

    def _size_documents(self) -> int:
        ws = self.spec.working_set
        if ws is None:
            return self.spec.documents
        target = ws.multiple * ws.kv_capacity_tokens - self.spec.system_prompt_tokens
        total, d = 0, 0
        while total < target:
            total += int(self._chunk_lengths(d)[: self.used_chunks].sum())
            d += 1
            if d > 10_000_000:
                raise UserError(f"workloads.{self.name}.working_set: needs over 10 million "
                                "documents; lower multiple or raise chunk_tokens")
        return max(d, 1)

    def document(self, d: int) -> Piece:
        """The retrieved chunks of document ``d`` as one piece (cached)."""
        doc = self._docs.get(d)
        if doc is None:
            lens = self._chunk_lengths(d)[: self.used_chunks]
            text = "".join(self.text.segment(f"{self.name}/doc{d}/chunk{c}", int(n))
                           for c, n in enumerate(lens))
            doc = self._docs[d] = Piece(text, int(lens.sum()))
        return doc

    def _doc_draws(self) -> Iterator[list[int]]:
        spec = self.spec
        need = min(-(-spec.top_k // spec.chunks_per_document), self.documents)
        cdf = zipf_cdf(self.documents, spec.zipf_s)
        rng = rng_for(self.seed, self.name, "popularity")
        batch = 4096
        while True:
            firsts = np.searchsorted(cdf, rng.random(batch), side="right")
            for first in firsts.tolist():
                first = min(first, self.documents - 1)
                docs = [first]
                while len(docs) < need:
                    d = min(int(np.searchsorted(cdf, rng.random(), side="right")),
                            self.documents - 1)
                    if d not in docs:
                        docs.append(d)
                yield docs

    def build_requests(self) -> Iterator[Request]:
        spec = self.spec
        n = self.n_requests
        q_lens = sample(spec.question_tokens, rng_for(self.seed, self.name, "question"), n)
        outs = sample(spec.output_tokens, rng_for(self.seed, self.name, "output"), n)
        draws = self._doc_draws()
        per_doc = spec.chunks_per_document
        sys_msgs = [("system", [self.system])] if spec.system_prompt_tokens else []
        u = len(sys_msgs)
        for i in range(n):
            docs = next(draws)
            parts = [self.document(d) for d in docs]
            left = spec.top_k - per_doc * (len(docs) - 1)
            if len(docs) > 1 and left < per_doc:  # only part of the last document
                lens = self._chunk_lengths(docs[-1])[:left]
                parts[-1] = self._partial(docs[-1], lens)
            q = self.text.segment(f"{self.name}/question{i}", int(q_lens[i]))
            parts.append(Piece(q, int(q_lens[i])))
            messages, prompt, total, shared = self.asm.build(
                sys_msgs + [("user", parts)], shared=(u, len(parts) - 1))
            yield Request(
                request_id=f"{self.name}-{i:06d}", request_class="rag",
                max_tokens=int(outs[i]), prompt_tokens=total, shared_prefix_tokens=shared,
                session_id=f"{self.name}-{i:06d}", prompt=prompt, messages=messages,
                workload=self.name)

    def _partial(self, d: int, lens) -> Piece:
        text = "".join(self.text.segment(f"{self.name}/doc{d}/chunk{c}", int(n))
                       for c, n in enumerate(lens))
        return Piece(text, int(sum(lens)))

    def sessions(self):
        return (SingleTurnSession(r) for r in self.build_requests())

    def requests(self):
        return self.build_requests()


def _build(name: str, spec: RagSpec, ctx: BuildContext) -> RagWorkload:
    return RagWorkload(name, spec, ctx.tokenizer, ctx.seed, ctx.n_requests)


register(spec=RagSpec, build=_build, request_class=RagWorkload.request_class)
