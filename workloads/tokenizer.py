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
rendering unless the directory holds a ``tokenizer_config.json`` with a ``chat_template`` (or a
``chat_template.jinja``). Counts follow what vLLM, SGLang and llama.cpp do with a request:

* chat: the template is rendered as transformers' ``apply_chat_template`` renders it (its
  jinja settings, with the tokenizer's own ``bos_token``, ``eos_token``... from
  ``tokenizer_config.json``), and the rendered text is tokenized WITHOUT adding special tokens
  again (the BOS came through the template);
* completions: the prompt is tokenized WITH the special tokens the tokenizer's post-processor
  adds (a Llama tokenizer puts BOS first), and a template's leading BOS text is left out of a
  completions prompt where the post-processor adds it anyway (no double BOS).
"""

from __future__ import annotations

import json
import re
import zlib
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Protocol, Sequence

from kvbench.core.errors import UserError

BUILTIN_NAME = "kvbench-words-v1"

_TOKEN_RE = re.compile(r"\s*[A-Za-z0-9]+|\s*[^\sA-Za-z0-9]|\s+")


class Tokenizer(Protocol):
    name: str
    leading_special_tokens: int  # what a completions prompt starts with (BOS) before its text

    def count(self, text: str) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[dict]) -> str: ...

    def count_chat(self, messages: Sequence[dict]) -> int: ...

    def render_prompt(self, messages: Sequence[dict]) -> str: ...

    def count_prompt(self, text: str) -> int: ...

    def encode_prompt(self, text: str) -> list[int]: ...

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
    leading_special_tokens = 0

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

    def render_prompt(self, messages: Sequence[dict]) -> str:
        return render_chat_builtin(messages)

    def count_prompt(self, text: str) -> int:
        return self.count(text)

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

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
        config = _read_json(path.parent / "tokenizer_config.json")
        self.special_tokens = _special_tokens(config)
        tmpl = config.get("chat_template")
        jinja_file = path.parent / "chat_template.jinja"
        if jinja_file.exists():
            tmpl = jinja_file.read_text()
        if isinstance(tmpl, list):  # named templates: transformers uses "default"
            tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict)
                         and t.get("name") == "default"), None)
        self._template = _compile_template(tmpl, path) if isinstance(tmpl, str) else None
        # tokens the post-processor adds around a plain prompt (a Llama tokenizer: BOS first)
        probe = self._tok.encode("word", add_special_tokens=True).ids
        bare = self._tok.encode("word", add_special_tokens=False).ids
        at = next((i for i in range(len(probe) - len(bare) + 1)
                   if probe[i:i + len(bare)] == bare), 0)
        self._leading_ids = probe[:at]
        self._added = len(probe) - len(bare)
        self._words: list[str] | None = None

    def count(self, text: str) -> int:
        """Tokens of ``text`` with no special tokens added (a piece, or a rendered chat)."""
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def render_chat(self, messages: Sequence[dict]) -> str:
        """The text a server renders for a chat request: the model's template with its special
        tokens (BOS included), or the built-in rendering without a template."""
        if self._template is None:
            return render_chat_builtin(messages)
        import jinja2

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True,
                                         **self.special_tokens)
        except jinja2.TemplateError as exc:
            roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
            raise UserError(f"{self.path.parent}: the model's chat template refused messages "
                            f"with roles {roles} ({exc}); use api = \"completions\" for this "
                            "workload or another tokenizer") from None

    def count_chat(self, messages: Sequence[dict]) -> int:
        return self.count(self.render_chat(messages))

    def render_prompt(self, messages: Sequence[dict]) -> str:
        """A completions prompt for ``messages``: the chat rendering, less a leading BOS text
        that the server's tokenizer adds again."""
        text = self.render_chat(messages)
        if self._leading_ids:
            lead = self._tok.decode(self._leading_ids, skip_special_tokens=False)
            if lead and text.startswith(lead):
                text = text[len(lead):]
        return text

    def count_prompt(self, text: str) -> int:
        """Tokens a server counts for ``text`` sent as a completions prompt (special tokens
        added, as vLLM's and llama.cpp's completions endpoints do)."""
        return self.count(text) + self._added

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    @property
    def leading_special_tokens(self) -> int:
        """Special tokens a completions prompt starts with (BOS), before its text."""
        return len(self._leading_ids)

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


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _special_tokens(config: dict) -> dict:
    """The special tokens transformers hands a chat template (``special_tokens_map``), each as
    its text; tokenizer_config.json writes them as strings or as ``{"content": ...}``."""
    out = {}
    for key in _SPECIAL_KEYS:
        v = config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t
                                            for t in extra]
    return out


def _compile_template(text: str, path: Path):
    """A chat template compiled the way transformers compiles it (sandboxed, trim_blocks and
    lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
    non-ASCII)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.2's date
    try:
        return env.from_string(text)
    except jinja2.TemplateError as exc:
        raise UserError(f"{path.parent}: the chat template does not compile ({exc}); fix "
                        "chat_template in tokenizer_config.json") from None


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
