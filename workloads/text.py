"""Token-exact, seeded prompt text.

Every segment starts with whitespace and ends with a word, so for the built-in tokenizer
token counts add up exactly when segments are concatenated; for a HuggingFace tokenizer the
segment is checked with the tokenizer itself and trimmed or padded until it is exact.
A segment's first three words come from a hash of its key, so unrelated segments differ from
their first token on (peers' "random" prompts share long prefixes by accident).
"""

from __future__ import annotations

import hashlib

import numpy as np

from kvbench.workloads.tokenizer import BuiltinTokenizer, Tokenizer


def key_seed(*parts: object) -> int:
    """A 64-bit seed from any printable parts; stable across processes (unlike hash())."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


class TextFactory:
    """Builds segments of exact token length for one tokenizer and one suite seed."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.seed = seed
        self.words = tokenizer.single_token_words()
        self._exact_additive = isinstance(tokenizer, BuiltinTokenizer)

    def segment(self, key: str, n_tokens: int) -> str:
        """Exactly ``n_tokens`` tokens of text, identical for the same (seed, key, n_tokens)."""
        if n_tokens <= 0:
            return ""
        rng = np.random.default_rng(key_seed(self.seed, key))
        v = len(self.words)
        head = key_seed("head", self.seed, key)
        idx = [head % v, (head // v) % v, (head // (v * v)) % v]
        if n_tokens > 3:
            idx.extend(rng.integers(0, v, n_tokens - 3).tolist())
        words = self.words
        text = " " + " ".join([words[i] for i in idx[:n_tokens]])
        if self._exact_additive:
            return text
        return self._fit(text, n_tokens, rng)

    def _fit(self, text: str, n_tokens: int, rng: np.random.Generator) -> str:
        for _ in range(64):
            got = self.tokenizer.count(text)
            if got == n_tokens:
                return text
            if got > n_tokens:
                text = text.rsplit(" ", 1)[0] if text.count(" ") > 1 else text
                if self.tokenizer.count(text) < n_tokens:
                    break
            else:
                extra = rng.integers(0, len(self.words), n_tokens - got).tolist()
                text = text + " " + " ".join(self.words[i] for i in extra)
        raise ValueError(f"could not build a segment of exactly {n_tokens} tokens with "
                         f"{self.tokenizer.name}")

    def words_only(self, key: str, n_tokens: int) -> str:
        """Like :meth:`segment` but without the leading space (for a text's very start)."""
        return self.segment(key, n_tokens)[1:]
