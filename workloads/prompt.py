"""Assemble chat messages (or a completions prompt) from text pieces and count them exactly.

For the built-in tokenizer the count is arithmetic on the pieces' own counts (the rule in
``concat_count``), so a 30k-token prompt costs nothing to count; for a HuggingFace tokenizer
the rendered text is counted with the tokenizer itself. Either way ``prompt_tokens`` equals the
count a server makes of exactly what is sent (chat: ``count_chat(messages)``, the template's
special tokens included; completions: ``count_prompt(prompt)``, with the BOS the server adds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvbench.workloads.tokenizer import BuiltinTokenizer, Tokenizer


def _alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


@dataclass(frozen=True, slots=True)
class Piece:
    """Text with its token count when counted alone."""

    text: str
    ntok: int


EMPTY = Piece("", 0)


def merges(left: str, right: str) -> bool:
    """Whether, for ``kvbench-words-v1``, the last token of ``left`` and the first of ``right``
    become one token when concatenated (trailing whitespace joins what follows; letters and
    digits run on)."""
    if not left or not right:
        return False
    a = left[-1]
    return a.isspace() or (_alnum(a) and _alnum(right[0]))


_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")


def concat_count(pieces: Sequence[Piece]) -> int:
    """``count("".join(texts))`` for the built-in tokenizer, from the pieces' own counts
    (the ``merges`` rule, inlined: this runs for every request)."""
    total = 0
    last = ""
    alnum = _ALNUM
    for p in pieces:
        t = p.text
        if not t:
            continue
        total += p.ntok
        if last and (last.isspace() or (last in alnum and t[0] in alnum)):
            total -= 1
        last = t[-1]
    return total


class Assembler:
    """Builds what a request sends from messages given as (role, [pieces]) and reports
    ``(messages, prompt, prompt_tokens, shared_prefix_tokens)``.

    The shared prefix runs from the start of the rendered prompt to the end of piece
    ``shared[1]`` (exclusive end index) of message ``shared[0]``; tokens are counted that lie
    wholly inside it.
    """

    def __init__(self, tokenizer: Tokenizer, api: str = "chat"):
        self.tokenizer = tokenizer
        self.api = api
        self.builtin = isinstance(tokenizer, BuiltinTokenizer)
        self._headers: dict[str, Piece] = {}
        self._nl = self.piece("\n")
        self._gen = self.piece("<|assistant|>\n")

    def piece(self, text: str) -> Piece:
        return Piece(text, self.tokenizer.count(text))

    def _header(self, role: str) -> Piece:
        h = self._headers.get(role)
        if h is None:
            h = self._headers[role] = self.piece(f"<|{role}|>\n")
        return h

    def build(self, msgs: Sequence[tuple[str, Sequence[Piece]]],
              shared: tuple[int, int] | None = None):
        messages = tuple({"role": role, "content": "".join(p.text for p in parts)}
                         for role, parts in msgs)
        prompt = None
        if self.builtin:
            flat: list[Piece] = []
            cut = 0
            for i, (role, parts) in enumerate(msgs):
                flat.append(self._header(role))
                for j, p in enumerate(parts):
                    if shared is not None and (i, j) == (shared[0], shared[1] - 1):
                        cut = len(flat) + 1
                    flat.append(p)
                if shared is not None and shared[1] == 0 and i == shared[0]:
                    cut = len(flat) - len(parts)
                flat.append(self._nl)
            flat.append(self._gen)
            total = concat_count(flat)
            shared_tokens = 0
            if shared is not None and cut:
                head = flat[:cut]
                shared_tokens = concat_count(head)
                before = "".join(p.text[-1:] for p in head if p.text)[-1:]
                after = next((p.text for p in flat[cut:] if p.text), "")
                if merges(before, after):
                    shared_tokens -= 1
            if self.api == "completions":
                prompt = self.tokenizer.render_chat(messages)
                messages = None
            return messages, prompt, total, shared_tokens
        tok = self.tokenizer
        completions = self.api == "completions"
        rendered = tok.render_prompt(messages) if completions else tok.render_chat(messages)
        total = tok.count_prompt(rendered) if completions else tok.count(rendered)
        lead = tok.leading_special_tokens if completions else 0
        shared_tokens = 0
        if shared is not None:
            i, j = shared
            content = messages[i]["content"]
            start = rendered.find(content) if content else -1
            upto = sum(len(p.text) for p in msgs[i][1][:j])
            if start >= 0:
                shared_tokens = min(total, lead + tok.count(rendered[:start + upto]))
            else:  # the template rewrote the content: count the pieces instead
                shared_tokens = sum(p.ntok for _, parts in msgs[:i] for p in parts) + sum(
                    p.ntok for p in msgs[i][1][:j])
        if completions:
            return None, rendered, total, shared_tokens
        return messages, None, total, shared_tokens

    def overhead(self, roles: Sequence[str]) -> int:
        """Template tokens around messages with these roles, each holding one plain word."""
        w = self.piece(" word")
        _, _, total, _ = self.build([(r, [w]) for r in roles])
        return total - len(roles)
