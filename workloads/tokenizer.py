"""Tokenizers the workloads build prompts for, and the one the built-in endpoints share.

The built-in tokenizer, ``kvbench-words-v1``, needs no model files and is shared by the
generators and the built-in endpoints so that client and server counts agree exactly:

* a token is a run of ASCII letters/digits, or one other non-space character, each together
  with the whitespace before it; whitespace at the very end of a text is one more token;
* so ``" alpha beta."`` is 3 tokens (``" alpha"``, ``" beta"``, ``"."``);
* a chat conversation is rendered as ``<|role|>\\n{content}\\n`` per message followed by
  ``<|assistant|>\\n`` (the generation prompt), and counted on that text;
* token ids are CRC-32 of the token text (stable across processes and machines).

A HuggingFace ``tokenizer.json`` (a file, or a directory holding one) can be configured instead;
then prompts are sized with that tokenizer, and chat prompts are counted on the built-in chat
rendering unless the directory holds a ``tokenizer_config.json`` with a ``chat_template``.
"""

from __future__ import annotations

import json
import re
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Protocol, Sequence

from kvbench.core.errors import UserError

BUILTIN_NAME = "kvbench-words-v1"

_TOKEN_RE = re.compile(r"\s*[A-Za-z0-9]+|\s*[^\sA-Za-z0-9]|\s+")


class Tokenizer(Protocol):
    name: str

    def count(self, text: str) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[dict]) -> str: ...

    def count_chat(self, messages: Sequence[dict]) -> int: ...

    def single_token_words(self) -> list[str]: ...


def render_chat_builtin(messages: Sequence[dict]) -> str:
    """The built-in chat template: one header per message, then the generation prompt."""
    parts = [f"<|{m['role']}|>\n{_content_text(m.get('content'))}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI content parts: keep the text parts in order.
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


class BuiltinTokenizer:
    """``kvbench-words-v1``: see the module docstring for the exact rules."""

    name = BUILTIN_NAME

    def tokens(self, text: str) -> list[str]:
        return _TOKEN_RE.findall(text)

    def count(self, text: str) -> int:
        return len(_TOKEN_RE.findall(text))

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(t.encode()) for t in _TOKEN_RE.findall(text)]

    def render_chat(self, messages: Sequence[dict]) -> str:
        return render_chat_builtin(messages)

    def count_chat(self, messages: Sequence[dict]) -> int:
        return self.count(render_chat_builtin(messages))

    def single_token_words(self) -> list[str]:
        return list(_builtin_vocabulary())


@lru_cache(maxsize=1)
def _builtin_vocabulary() -> tuple[str, ...]:
    """4,096 pronounceable lowercase words, each one token (consonant-vowel syllables)."""
    cons = "bcdfghjklmnprstvz"
    vow = "aeiou"
    syll = [c + v for c in cons for v in vow]  # 85 syllables
    words = []
    for a in syll:
        for b in syll:
            words.append(a + b)
            if len(words) == 4096:
                return tuple(words)
    return tuple(words)


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as exc:  # pragma: no cover - dependency of the package
            raise UserError("the 'tokenizers' package is missing; reinstall kvbench") from exc
        self.path = path
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as exc:
            raise UserError(f"{path}: not a valid HuggingFace tokenizer.json ({exc}); "
                            "point tokenizer at the tokenizer.json of your model") from exc
        self.name = f"hf:{path}"
        self._template = None
        cfg = path.parent / "tokenizer_config.json"
        if cfg.exists():
            try:
                tmpl = json.loads(cfg.read_text()).get("chat_template")
            except (OSError, ValueError):
                tmpl = None
            if isinstance(tmpl, str):
                import jinja2

                env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
                self._template = env.from_string(tmpl)
        self._words: list[str] | None = None

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def render_chat(self, messages: Sequence[dict]) -> str:
        if self._template is None:
            return render_chat_builtin(messages)
        return self._template.render(messages=list(messages), add_generation_prompt=True,
                                     bos_token="", eos_token="")

    def count_chat(self, messages: Sequence[dict]) -> int:
        return self.count(self.render_chat(messages))

    def single_token_words(self) -> list[str]:
        """Lowercase alphabetic words w for which " w" is exactly one token, in vocab order."""
        if self._words is None:
            cands = []
            for piece in sorted(self._tok.get_vocab()):
                w = piece.lstrip("Ġ▁ ")
                if 3 <= len(w) <= 10 and w.isascii() and w.isalpha() and w.islower():
                    cands.append(w)
            words = []
            seen = set()
            for w in cands:
                if w in seen:
                    continue
                seen.add(w)
                if len(self._tok.encode(" " + w, add_special_tokens=False).ids) == 1:
                    words.append(w)
            if len(words) < 64:
                raise UserError(f"{self.path}: the tokenizer has only {len(words)} single-token "
                                "words, too few to build prompts of exact length; use another "
                                "tokenizer.json or tokenizer = \"builtin\"")
            self._words = words
        return list(self._words)


@lru_cache(maxsize=8)
def get_tokenizer(spec: str | None = None) -> Tokenizer:
    """``None`` or ``"builtin"`` gives the built-in tokenizer; else a path to tokenizer.json or
    to a directory holding one."""
    if spec in (None, "", "builtin", BUILTIN_NAME):
        return BuiltinTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise UserError(f"tokenizer file {path} does not exist; give the path of a local "
                        "tokenizer.json (or its directory), or use tokenizer = \"builtin\"")
    return HFTokenizer(path)
