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


# ---------------------------------------------------------------- a HuggingFace tokenizer

import json  # noqa: E402

import pytest  # noqa: E402

from kvbench.workloads.registry import build_spec  # noqa: E402
from kvbench.workloads.tokenizer import HFTokenizer, _builtin_vocabulary  # noqa: E402

# A Llama-like chat template: BOS through the template, block tags on their own lines (as
# transformers renders them: trim_blocks and lstrip_blocks).
TEMPLATE = ("{{ bos_token }}\n"
            "{% for m in messages %}\n"
            "    <|{{ m['role'] }}|> {{ m['content'] }}\n"
            "{% endfor %}\n"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    """A word-level tokenizer whose post-processor puts BOS first, as Llama's does, with a
    chat template that renders BOS itself; built here, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    d = tmp_path_factory.mktemp("tok")
    words = list(_builtin_vocabulary()[:200]) + ["alpha", "beta"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|user|>": 3, "<|assistant|>": 4,
             "<|system|>": 5}
    vocab.update({w: i for i, w in enumerate(words, len(vocab))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
        "chat_template": TEMPLATE}))
    return d


def _server_chat_ids(d, messages):
    """What vLLM (transformers' apply_chat_template) does with a chat request: render with the
    tokenizer's special tokens, then tokenize without adding special tokens again."""
    import jinja2
    from tokenizers import Tokenizer

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                            bos_token="<s>", eos_token="</s>")
    return Tokenizer.from_file(str(d / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids


def _server_completion_ids(d, prompt):
    """What vLLM's and llama.cpp's completions endpoints do: tokenize with special tokens."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(d / "tokenizer.json")).encode(prompt).ids


def test_chat_count_includes_the_templates_bos_once(llama_like):
    tok = HFTokenizer(llama_like / "tokenizer.json")
    msgs = [{"role": "user", "content": "alpha beta"}]
    # trim_blocks drops the newline after each block tag, as transformers renders
    assert tok.render_chat(msgs) == "<s>\n    <|user|> alpha beta\n<|assistant|>"
    server = _server_chat_ids(llama_like, msgs)
    assert server == [1, 3, *tok.encode("alpha beta"), 4]  # one BOS, from the template
    assert tok.count_chat(msgs) == len(server) == 5


def test_completions_prompt_gets_one_bos_from_the_server(llama_like):
    tok = HFTokenizer(llama_like / "tokenizer.json")
    msgs = [{"role": "user", "content": "alpha beta"}]
    prompt = tok.render_prompt(msgs)
    assert not prompt.startswith("<s>")  # the server adds it: no double BOS
    server = _server_completion_ids(llama_like, prompt)
    assert server.count(1) == 1 and tok.count_prompt(prompt) == len(server)
    assert tok.encode_prompt(prompt) == server


@pytest.mark.parametrize("kind, api", [("chat", "chat"), ("rag", "chat"), ("agent", "chat"),
                                       ("chat", "completions"), ("rag", "completions")])
def test_generated_prompts_count_as_the_server_counts(llama_like, kind, api):
    from kvbench.workloads.registry import kinds

    tok = HFTokenizer(llama_like / "tokenizer.json")
    spec = kinds()[kind].spec.model_validate(
        {"kind": kind, "api": api, **({"sessions": 2, "turns": 2} if kind == "agent"
                                      else {"requests": 6})})
    for r in build_spec("w", spec, tok, 3).requests():
        server = _server_chat_ids(llama_like, list(r.messages)) if api == "chat" \
            else _server_completion_ids(llama_like, r.prompt)
        assert r.prompt_tokens == len(server)
        assert server.count(1) == 1  # exactly one BOS reaches the model
        assert r.shared_prefix_tokens <= r.prompt_tokens


def test_a_template_that_refuses_roles_is_one_sentence(tmp_path, llama_like):
    d = tmp_path / "strict"
    d.mkdir()
    (d / "tokenizer.json").write_text((llama_like / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "chat_template": "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ bos_token }}"}))
    tok = HFTokenizer(d / "tokenizer.json")
    from kvbench.core.errors import UserError

    with pytest.raises(UserError, match="System role not supported"):
        tok.render_chat([{"role": "system", "content": "x"}])
