"""Azure LLM inference trace 2023 (Splitwise, ISCA 2024): CSV ``TIMESTAMP,ContextTokens,
GeneratedTokens`` with wall-clock timestamps such as ``2023-11-16 18:17:03.9799600``.

Arrivals are offsets from the first row's timestamp. The trace carries no prefix information,
so every prompt is its own text of ``ContextTokens`` tokens (template included for chat).
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterator

import numpy as np

from kvbench.workloads.base import Request
from kvbench.workloads.prompt import Piece
from kvbench.workloads.specs import MAX_TOKENS
from kvbench.workloads.traces import BadLines, TraceWorkload

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_timestamp(text: str) -> float:
    """Seconds since the Unix epoch (read as UTC) of ``YYYY-MM-DD HH:MM:SS[.fffffff]``;
    fractions of any length down to 100 ns."""
    text = text.strip()
    head, _, frac = text.partition(".")
    if frac and not frac.isdigit():
        raise ValueError(f"bad fraction {frac!r}")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S") if len(head) == 19 \
        else datetime.fromisoformat(head)
    days = base.toordinal() - 719163  # date(1970, 1, 1).toordinal()
    secs = days * 86400 + base.hour * 3600 + base.minute * 60 + base.second
    return secs + (int(frac) / 10 ** len(frac) if frac else 0.0)


class AzureTrace(TraceWorkload):
    def __init__(self, name, spec, tokenizer, seed):
        super().__init__(name, spec, tokenizer, seed)
        bad = BadLines(self.path, spec.skip_bad_lines)
        ts, ctx, gen, lines = [], [], [], []
        limit = spec.limit
        day_cache: dict[str, float] = {}
        with self.path.open("r", encoding="utf-8", errors="replace", newline="") as fh:
            header = fh.readline().strip().lstrip("\ufeff")
            cols = [c.strip() for c in header.split(",")]
            missing = [c for c in COLUMNS if c not in cols]
            if not header:
                bad.skip = False
                bad(1, f"the trace is empty or starts with a blank line (expected the header "
                       f"{','.join(COLUMNS)})")
            if missing:
                bad.skip = False
                bad(1, f"the header lacks column(s) {', '.join(missing)} (expected "
                       f"{','.join(COLUMNS)})")
            it, ic, ig = (cols.index(c) for c in COLUMNS)
            width = len(cols)
            for line_no, line in enumerate(fh, 2):
                line = line.strip()
                if not line:
                    continue
                f = line.split(",")
                if len(f) != width:
                    bad(line_no, f"{len(f)} fields where the header has {width}")
                    continue
                stamp = f[it]
                try:
                    # the date part repeats on every row: parse each distinct day once
                    day, _, clock = stamp.strip().partition(" ")
                    base = day_cache.get(day)
                    if base is None:
                        base = day_cache[day] = parse_timestamp(day + " 00:00:00")
                    hh, mm, ss = clock.split(":")
                    t = base + int(hh) * 3600 + int(mm) * 60 + float(ss)
                    if not (0 <= int(hh) < 24 and 0 <= int(mm) < 60 and 0 <= float(ss) < 61):
                        raise ValueError("clock out of range")
                except ValueError:
                    bad(line_no, f"TIMESTAMP {stamp!r} is not 'YYYY-MM-DD HH:MM:SS.fffffff'")
                    continue
                try:
                    c, g = int(f[ic]), int(f[ig])
                except ValueError:
                    bad(line_no, f"ContextTokens {f[ic]!r} or GeneratedTokens {f[ig]!r} is "
                                 "not an integer")
                    continue
                if not (0 < c <= MAX_TOKENS and 0 <= g <= MAX_TOKENS):
                    bad(line_no, f"ContextTokens {c} must be from 1 to {MAX_TOKENS} and "
                                 f"GeneratedTokens {g} from 0 to {MAX_TOKENS}")
                    continue
                ts.append(t)
                ctx.append(c)
                gen.append(g)
                lines.append(line_no)
                if limit is not None and len(ts) >= limit:
                    break
        self._note_bad(bad)
        self._require_requests(len(ts), self.path, bad.first)
        t = np.array(ts, dtype=float)
        if len(t):
            t = t - t[0]
            if (t < 0).any():
                self.notes.append(f"{self.path}: timestamps are not in order; sorted them")
                t = t - t.min()
        self.context_tokens = np.array(ctx, dtype=np.int64)
        self.generated_tokens = np.array(gen, dtype=np.int64)
        self.lines = lines
        self.offsets_s, self.order = self._arrivals(t)
        self.template_tokens = 0 if spec.api == "completions" else self.asm.overhead(["user"])

    def build_request(self, i: int) -> Request:
        n = int(self.context_tokens[i])
        body = max(n - self.template_tokens, 1)
        text = self.text.segment(f"{self.name}/row{self.lines[i]}", body)
        if self.spec.api == "chat":
            messages, prompt, total, _ = self.asm.build([("user", [Piece(text, body)])])
        else:
            messages, prompt = None, text
            total = body if self.asm.builtin else self.tokenizer.count_prompt(text)
        rid = f"{self.name}-{self.lines[i]:06d}"
        return Request(
            request_id=rid, request_class="trace",
            max_tokens=self._max_tokens(int(self.generated_tokens[i])), prompt_tokens=total,
            shared_prefix_tokens=0, session_id=rid, prompt=prompt, messages=messages,
            arrival_offset_s=float(self.offsets_s[i]), workload=self.name)

    def describe_blocks(self, block_tokens: int = 16) -> Iterator[tuple]:
        """Per request: every full block is new text (the trace shares no prefixes)."""
        for i in self.order.tolist():
            n = int(self.context_tokens[i])
            key = self.lines[i]
            yield (n, self._max_tokens(int(self.generated_tokens[i])),
                   [(key, j) for j in range(n // block_tokens)], block_tokens)
