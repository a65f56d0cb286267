"""Mooncake (FAST'25) JSONL: ``{"timestamp": ms, "input_length", "output_length",
"hash_ids"}`` a line, each hash id naming one 512-token block that covers all blocks before it.

A block's text is built from its hash id alone (exactly 512 tokens), so equal ids give equal
text and equal id prefixes give exactly equal prompt prefixes; the last block is cut so the
prompt has ``input_length`` tokens (with the chat api the template's tokens are taken from the
content, so the rendered prompt still has ``input_length`` tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import numpy as np
import orjson

from kvbench.workloads.base import Request
from kvbench.workloads.prompt import Piece
from kvbench.workloads.specs import MAX_TOKENS
from kvbench.workloads.traces import MAX_SPAN_S, BadLines, TraceWorkload, shown

BLOCK_TOKENS = 512  # Mooncake's hash block (FAST25-release/README)
_CACHE_BLOCKS = 8192  # block texts kept (~3 KB each)


def _check(rec, line_no: int, bad: BadLines) -> tuple | None:
    if not isinstance(rec, dict):
        bad(line_no, "not a JSON object")
        return None
    try:
        ts, n_in, n_out, ids = (rec["timestamp"], rec["input_length"], rec["output_length"],
                                rec["hash_ids"])
    except KeyError as exc:
        bad(line_no, f"missing key {exc.args[0]!r}")
        return None
    if type(ts) not in (int, float) or not 0 <= ts <= MAX_SPAN_S * 1000:
        bad(line_no, f"timestamp {shown(ts)} is not a number of milliseconds from 0 to "
                     f"{MAX_SPAN_S * 1000:.0f} (a year)")
        return None
    if type(n_in) is not int or not 0 < n_in <= MAX_TOKENS:
        bad(line_no, f"input_length {shown(n_in)} is not an integer from 1 to {MAX_TOKENS}")
        return None
    if type(n_out) is not int or not 0 <= n_out <= MAX_TOKENS:
        bad(line_no, f"output_length {shown(n_out)} is not an integer from 0 to {MAX_TOKENS}")
        return None
    if not isinstance(ids, list) or not all(type(h) is int for h in ids):
        bad(line_no, "hash_ids is not a list of integers")
        return None
    need = -(-n_in // BLOCK_TOKENS)
    if len(ids) != need:
        bad(line_no, f"hash_ids has {len(ids)} ids but input_length {n_in} needs {need} "
                     f"blocks of {BLOCK_TOKENS} tokens")
        return None
    return ts, n_in, n_out, ids


class MooncakeTrace(TraceWorkload):
    def __init__(self, name, spec, tokenizer, seed):
        super().__init__(name, spec, tokenizer, seed)
        bad = BadLines(self.path, spec.skip_bad_lines)
        ts, n_in, n_out, ids, lines = [], [], [], [], []
        limit = spec.limit
        with self.path.open("rb") as fh:
            for line_no, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    rec = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    bad(line_no, f"not valid JSON ({exc})")
                    continue
                got = _check(rec, line_no, bad)
                if got is None:
                    continue
                ts.append(got[0])
                n_in.append(got[1])
                n_out.append(got[2])
                ids.append(got[3])
                lines.append(line_no)
                if limit is not None and len(ts) >= limit:
                    break
        self._note_bad(bad)
        self._require_requests(len(ts), self.path, bad.first)
        self.input_tokens = np.array(n_in, dtype=np.int64)
        self.output_tokens = np.array(n_out, dtype=np.int64)
        self.hash_ids = ids
        self.lines = lines
        self.offsets_s, self.order = self._arrivals(np.array(ts, dtype=float) / 1000.0)
        self.template_tokens = 0 if spec.api == "completions" else self.asm.overhead(["user"])
        self._shared_blocks = self._reused_blocks()
        self._blocks: OrderedDict[int, str] = OrderedDict()

    def _reused_blocks(self) -> np.ndarray:
        """Per request, the leading blocks an earlier request (in send order) already sent."""
        seen: set[int] = set()
        out = np.zeros(len(self.hash_ids), dtype=np.int64)
        for i in self.order.tolist():
            ids = self.hash_ids[i]
            k = 0
            for h in ids:
                if h not in seen:
                    break
                k += 1
            out[i] = k
            seen.update(ids)
        return out

    def block_text(self, h: int) -> str:
        """The 512-token text of hash id ``h`` (identical for equal ids)."""
        cache = self._blocks
        text = cache.get(h)
        if text is None:
            text = self.text.segment(f"{self.name}/block{h}", BLOCK_TOKENS)
            cache[h] = text
            if len(cache) > _CACHE_BLOCKS:
                cache.popitem(last=False)
        else:
            cache.move_to_end(h)
        return text

    def build_request(self, i: int) -> Request:
        n_in = int(self.input_tokens[i])
        body = max(n_in - self.template_tokens, 1)
        ids = self.hash_ids[i]
        full, rest = divmod(body, BLOCK_TOKENS)
        parts = [self.block_text(h) for h in ids[:full]]
        if rest:
            last = self.block_text(ids[min(full, len(ids) - 1)])
            parts.append(" ".join(last.split(" ", rest + 1)[: rest + 1]))
        text = "".join(parts)
        shared_body = min(int(self._shared_blocks[i]) * BLOCK_TOKENS, body)
        cut = len(text) if shared_body == body else sum(
            len(p) for p in parts[: shared_body // BLOCK_TOKENS])
        pieces = [Piece(text[:cut], shared_body), Piece(text[cut:], body - shared_body)]
        if self.spec.api == "chat":
            messages, prompt, total, shared = self.asm.build([("user", pieces)],
                                                             shared=(0, 1))
        else:
            messages, prompt, total, shared = self._plain(text, body, shared_body)
        if shared_body == 0:
            shared = 0
        rid = f"{self.name}-{self.lines[i]:06d}"
        return Request(
            request_id=rid, request_class="trace",
            max_tokens=self._max_tokens(int(self.output_tokens[i])), prompt_tokens=total,
            shared_prefix_tokens=shared, session_id=rid, prompt=prompt, messages=messages,
            arrival_offset_s=float(self.offsets_s[i]), workload=self.name)

    def _plain(self, text: str, body: int, shared_body: int):
        """Completions: the blocks' text itself, no template."""
        if self.asm.builtin:
            return None, text, body, shared_body
        tok = self.tokenizer
        return None, text, tok.count_prompt(text), tok.leading_special_tokens + shared_body

    def describe_blocks(self, block_tokens: int | None = None) -> Iterator[tuple]:
        """(prompt_tokens, max_tokens, block keys, block_tokens) per request in send order,
        straight from ``hash_ids`` (full 512-token blocks only), without building text."""
        for i in self.order.tolist():
            n_in = int(self.input_tokens[i])
            ids = self.hash_ids[i]
            yield (n_in, self._max_tokens(int(self.output_tokens[i])),
                   ids[: n_in // BLOCK_TOKENS], BLOCK_TOKENS)
