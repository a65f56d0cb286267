"""The built-in tokenizer and token-exact text."""

from hypothesis import given, settings, strategies as st

from kvbench.workloads.text import TextFactory
from kvbench.workloads.tokenizer import BuiltinTokenizer, get_tokenizer


def test_builtin_rules():
    t = BuiltinTokenizer()
    assert t.count(" alpha beta.") == 3
    assert t.count("") == 0
    assert t.count("a  ") == 2  # trailing whitespace is one token
    assert t.encode("x y") == t.encode("x y")
    chat = [{"role": "user", "content": " hello"}]
    assert t.render_chat(chat) == "<|user|>\n hello\n<|assistant|>\n"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), key=st.text(min_size=0, max_size=12),
       lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=4))
def test_segments_exact_and_additive(seed, key, lengths):
    t = get_tokenizer()
    f = TextFactory(t, seed)
    segs = [f.segment(f"{key}/{i}", n) for i, n in enumerate(lengths)]
    for s, n in zip(segs, lengths):
        assert t.count(s) == n
    assert t.count("".join(segs)) == sum(lengths)


def test_same_seed_same_text_and_distinct_starts():
    t = get_tokenizer()
    a, b = TextFactory(t, 7), TextFactory(t, 7)
    assert a.segment("doc-1", 500) == b.segment("doc-1", 500)
    x, y = t.tokens(a.segment("doc-1", 100)), t.tokens(a.segment("doc-2", 100))
    assert x[0] != y[0] or x[1] != y[1] or x[2] != y[2]
