"""LMCache agent traces (LMCache/lmcache-agent-trace): one JSONL file per agent session, each
record ``{"timestamp": Unix µs, "input": prompt, "output": response, "session_id"}``.

Records are sorted by timestamp within a session; records with an empty input or output are
skipped and counted (``skipped_records``). The prompts are the agents' real text, so a
session's next prompt already holds the original response: ``feed_response`` is ignored.
``max_tokens`` is the original response's token count; ``shared_prefix_tokens`` is the prefix
a request shares with its session's previous prompt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson

from kvbench.workloads.base import Request
from kvbench.workloads.prompt import merges
from kvbench.workloads.traces import BadLines, TraceWorkload, shown

MAX_UNIX_US = 4_102_444_800 * 10**6  # 2100-01-01 in Unix microseconds: later is damage


def common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix of two strings (compares 4 KiB slices, then narrows)."""
    n = min(len(a), len(b))
    i, step = 0, 4096
    while i < n:
        j = min(i + step, n)
        if a[i:j] == b[i:j]:
            i = j
            continue
        lo, hi = i, j  # the first difference lies in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo
    return n


class _Record:
    __slots__ = ("ts_us", "input", "output", "session", "line", "file")

    def __init__(self, ts_us, text_in, text_out, session, line, file):
        self.ts_us, self.input, self.output = ts_us, text_in, text_out
        self.session, self.line, self.file = session, line, file


class TraceSession:
    """One agent session replayed turn by turn."""

    def __init__(self, requests: list[Request]):
        self.session_id = requests[0].session_id
        self._requests = requests
        self.turns = len(requests)
        self._next = 0

    def next_request(self) -> Request | None:
        if self._next >= len(self._requests):
            return None
        self._next += 1
        return self._requests[self._next - 1]

    def feed_response(self, text: str) -> None:
        pass


class LMCacheAgentTrace(TraceWorkload):
    def __init__(self, name, spec, tokenizer, seed):
        super().__init__(name, spec, tokenizer, seed)
        files = sorted(self.path.glob("*.jsonl")) if self.path.is_dir() else [self.path]
        if not files:
            from kvbench.core.errors import UserError
            raise UserError(f"workloads.{name}.path: {self.path} holds no .jsonl session "
                            "files; point it at a directory of LMCache agent traces")
        records: list[_Record] = []
        skipped_lines = 0
        firsts = []
        for f in files:
            bad = BadLines(f, spec.skip_bad_lines)
            records.extend(self._read(f, bad))
            skipped_lines += bad.count
            if bad.first:
                firsts.append(bad.first)
        self.skipped_lines = skipped_lines
        if skipped_lines:
            self.notes.append(f"skipped {skipped_lines} malformed line(s), the first: "
                              f"{firsts[0]}")
        if self.skipped_records:
            self.notes.append(f"skipped {self.skipped_records} record(s) with an empty input "
                              "or output")
        records.sort(key=lambda r: (r.ts_us, r.file, r.line))
        if spec.limit is not None:
            records = records[: spec.limit]
        self._require_requests(len(records), self.path, firsts[0] if firsts else None)
        t0 = records[0].ts_us if records else 0
        trace_s = np.array([(r.ts_us - t0) / 1e6 for r in records], dtype=float)
        self.offsets_s, self.order = self._arrivals(trace_s)
        self._records = records
        self._built: list[Request] | None = None

    def _read(self, f: Path, bad: BadLines) -> list[_Record]:
        out = []
        with f.open("rb") as fh:
            for line_no, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    rec = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    bad(line_no, f"not valid JSON ({exc})")
                    continue
                if not isinstance(rec, dict):
                    bad(line_no, "not a JSON object")
                    continue
                ts, text_in, text_out = rec.get("timestamp"), rec.get("input"), rec.get("output")
                sid = rec.get("session_id", f.stem)
                if type(ts) not in (int, float) or not 0 <= ts <= MAX_UNIX_US:
                    bad(line_no, f"timestamp {shown(ts)} is not a number of Unix microseconds "
                                 "before 2100")
                    continue
                if not isinstance(sid, str) or not sid.strip() or len(sid) > 256:
                    bad(line_no, f"session_id {shown(sid)} is not a string of 1 to 256 "
                                 "characters (drop the key to use the file's name)")
                    continue
                if not isinstance(text_in, (str, type(None))) or \
                        not isinstance(text_out, (str, type(None))):
                    bad(line_no, "input and output must be strings")
                    continue
                if not text_in or not text_out:
                    self.skipped_records += 1
                    continue
                out.append(_Record(ts, text_in, text_out, str(sid), line_no, f.name))
        return out

    def _build_all(self) -> list[Request]:
        """All requests in send order (built once: the texts are the trace's own)."""
        if self._built is not None:
            return self._built
        prev: dict[str, str] = {}
        turns: dict[str, int] = {}
        out: list[Request | None] = [None] * len(self._records)
        for i in self.order.tolist():
            r = self._records[i]
            sid = f"{self.name}-{r.session}"
            k = turns.get(sid, 0)
            turns[sid] = k + 1
            p = prev.get(sid, "")
            cut = common_prefix_len(p, r.input)
            prev[sid] = r.input
            head, tail = r.input[:cut], r.input[cut:]
            pieces = [self.asm.piece(head), self.asm.piece(tail)]
            if self.spec.api == "chat":
                messages, prompt, total, shared = self.asm.build([("user", pieces)],
                                                                 shared=(0, 1))
            else:
                messages, prompt = None, r.input
                tok = self.tokenizer
                total = tok.count_prompt(r.input)
                shared = tok.leading_special_tokens + tok.count(head) - int(
                    self.asm.builtin and merges(head, tail))
            if cut == 0:
                shared = 0
            out[i] = Request(
                request_id=f"{sid}-t{k:04d}", request_class="trace",
                max_tokens=self._max_tokens(self.tokenizer.count(r.output)),
                prompt_tokens=total, shared_prefix_tokens=shared, session_id=sid, turn=k,
                prompt=prompt, messages=messages, arrival_offset_s=float(self.offsets_s[i]),
                workload=self.name)
        self._built = out
        return out

    def build_request(self, i: int) -> Request:
        return self._build_all()[i]

    def sessions(self):
        by_session: dict[str, list[Request]] = {}
        for i in self.order.tolist():
            req = self._build_all()[i]
            by_session.setdefault(req.session_id, []).append(req)
        return (TraceSession(reqs) for reqs in by_session.values())
