"""The generators: determinism, exact token counts, and the prefix structure each promises."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings, strategies as st

from kvbench.config import load_config, parse_config
from kvbench.workloads.common import flatten, sample
from kvbench.workloads.prompt import Assembler, Piece, concat_count
from kvbench.workloads.registry import build_spec, make_workload
from kvbench.workloads.agent import AgentSpec
from kvbench.workloads.chat import ChatSpec
from kvbench.workloads.hogwild import HogwildSpec
from kvbench.workloads.longctx import LongctxSpec
from kvbench.workloads.rag import RagSpec
from kvbench.workloads.specs import LengthDist
from kvbench.workloads.tokenizer import get_tokenizer

TOK = get_tokenizer()
ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "rag": RagSpec(requests=40, documents=6, chunks_per_document=3, top_k=2,
                   chunk_tokens=LengthDist(dist="uniform", mean=60, min=20, max=90)),
    "agent": AgentSpec(sessions=3, turns=4, system_prompt_tokens=40, tool_schema_tokens=60),
    "longctx": LongctxSpec(contracts=3, questions_per_contract=3,
                           contract_tokens=LengthDist(dist="uniform", mean=900, min=500,
                                                      max=1200)),
    "chat": ChatSpec(requests=60),
    "hogwild": HogwildSpec(tasks=2, workers=3, steps_per_worker=2),
}


def _dump(reqs) -> bytes:
    return b"\n".join(orjson.dumps(asdict(r)) for r in reqs)


def _sent_count(r) -> int:
    return TOK.count_chat(r.messages) if r.messages is not None else TOK.count(r.prompt)


def _sent_text(r) -> str:
    return TOK.render_chat(r.messages) if r.messages is not None else r.prompt


@pytest.mark.parametrize("kind", sorted(SMALL))
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_deterministic_and_counts_exact(kind, api):
    spec = SMALL[kind].model_copy(update={"api": api})
    a = list(build_spec(kind, spec, TOK, 7).requests())
    b = list(build_spec(kind, spec, TOK, 7).requests())
    c = list(build_spec(kind, spec, TOK, 8).requests())
    assert a and _dump(a) == _dump(b)
    assert _dump(a) != _dump(c)
    for r in a:
        assert (r.messages is None) == (api == "completions")
        assert r.prompt_tokens == _sent_count(r)
        assert 0 <= r.shared_prefix_tokens <= r.prompt_tokens
        # the declared shared prefix is a token prefix of what is sent
        toks = TOK.tokens(_sent_text(r))
        assert len(toks) == r.prompt_tokens
        assert r.request_class == kind and r.workload == kind
    assert len({r.request_id for r in a}) == len(a)


@pytest.mark.parametrize("kind", ["rag", "agent", "longctx", "chat"])
def test_sessions_match_requests(kind):
    """Driving the sessions one by one sends what requests() lists (hogwild differs by
    design: requests() answers a round of workers at once; tested below)."""
    wl = build_spec(kind, SMALL[kind], TOK, 3)
    via_sessions = [r for s in wl.sessions()
                    for r in iter(lambda s=s: _next_answered(wl, s), None)]
    assert sorted(_dump([r]) for r in via_sessions) == \
        sorted(_dump([r]) for r in wl.requests())


def _next_answered(wl, s):
    r = s.next_request()
    if r is not None:
        s.feed_response(wl.synthetic_response(r))
    return r


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), mean=st.integers(20, 3000), sigma=st.floats(0, 1.2))
def test_chat_prompt_lengths_exact(seed, mean, sigma):
    dist = LengthDist(dist="lognormal", mean=mean, sigma=sigma, min=12, max=8000)
    wl = build_spec("chat", ChatSpec(requests=8, prompt_tokens=dist), TOK, seed)
    from kvbench.workloads.common import rng_for
    want = sample(dist, rng_for(seed, "chat", "prompt"), 8)
    got = [r.prompt_tokens for r in wl.requests()]
    assert got == want.tolist()
    assert all(r.prompt_tokens == _sent_count(r) for r in wl.requests())


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.text(alphabet=st.sampled_from(list("ab1 \n\t.,<|é")), max_size=8),
                      max_size=6))
def test_concat_count_matches_tokenizer(parts):
    pieces = [Piece(p, TOK.count(p)) for p in parts]
    assert concat_count(pieces) == TOK.count("".join(parts))


@settings(max_examples=150, deadline=None)
@given(contents=st.lists(st.lists(st.text(alphabet=st.sampled_from(list("xy7 \n.:")),
                                          max_size=6), min_size=1, max_size=3),
                         min_size=1, max_size=4),
       data=st.data())
def test_assembler_counts_and_shared_prefix(contents, data):
    asm = Assembler(TOK)
    roles = ["system", "user", "assistant", "user"]
    msgs = [(roles[i % 4], [asm.piece(t) for t in parts]) for i, parts in enumerate(contents)]
    i = data.draw(st.integers(0, len(msgs) - 1))
    j = data.draw(st.integers(0, len(msgs[i][1])))
    messages, prompt, total, shared = asm.build(msgs, shared=(i, j))
    rendered = TOK.render_chat(messages)
    assert total == TOK.count(rendered) == TOK.count_chat(messages)
    # the shared tokens are exactly those of the full prompt lying inside the prefix text
    prefix_text = TOK.render_chat(messages[:i])[: -len("<|assistant|>\n")] + \
        f"<|{msgs[i][0]}|>\n" + "".join(p.text for p in msgs[i][1][:j])
    assert rendered.startswith(prefix_text)
    full, pos, inside = TOK.tokens(rendered), 0, 0
    for t in full:
        pos += len(t)
        if pos <= len(prefix_text):
            inside += 1
    assert shared == inside


def test_rag_same_document_shares_its_tokens():
    spec = RagSpec(requests=120, documents=5, chunks_per_document=4, top_k=4, zipf_s=1.2)
    wl = build_spec("rag", spec, TOK, 1)
    reqs = list(wl.requests())
    by_doc: dict[str, list] = {}
    for r in reqs:
        by_doc.setdefault(r.messages[1]["content"][:60], []).append(r)
    assert 2 <= len(by_doc) <= 5
    sys_and_doc = None
    for group in by_doc.values():
        first = TOK.tokens(_sent_text(group[0]))
        n = group[0].shared_prefix_tokens
        assert n == 5 + 128 + 5 + 4 * 256  # headers, system prompt, the 4 chunks
        for r in group[1:]:
            assert TOK.tokens(_sent_text(r))[:n] == first[:n]
            assert r.shared_prefix_tokens == n
        sys_and_doc = first
    # different documents share only the system prompt (and the next header)
    heads = [TOK.tokens(_sent_text(g[0])) for g in by_doc.values()]
    for a in heads[1:]:
        common = next(k for k, (x, y) in enumerate(zip(a, heads[0])) if x != y)
        assert common < 5 + 128 + 5 + 16
    assert sys_and_doc is not None
    # Zipf: the most popular document is asked most
    counts = sorted((len(g) for g in by_doc.values()), reverse=True)
    assert counts[0] > counts[-1]


def test_rag_more_chunks_than_a_document():
    spec = RagSpec(requests=30, documents=8, chunks_per_document=2, top_k=5,
                   chunk_tokens=LengthDist(dist="constant", mean=50))
    for r in build_spec("rag", spec, TOK, 4).requests():
        assert r.prompt_tokens == _sent_count(r)
        assert r.shared_prefix_tokens == 5 + 128 + 5 + 5 * 50


def test_unrelated_chat_prompts_share_under_16_tokens():
    a = list(build_spec("chat", ChatSpec(requests=50), TOK, 11).requests())
    b = list(build_spec("chat2", ChatSpec(requests=50), TOK, 12).requests())
    toks = [TOK.tokens(_sent_text(r)) for r in a + b]
    worst = 0
    for i in range(len(toks)):
        for j in range(i + 1, len(toks)):
            x, y = toks[i], toks[j]
            k = 0
            while k < min(len(x), len(y)) and x[k] == y[k]:
                k += 1
            worst = max(worst, k)
    assert worst < 16


@settings(max_examples=25, deadline=None)
@given(responses=st.lists(st.text(max_size=40), min_size=3, max_size=3))
def test_agent_turn_builds_on_previous_prompt_and_response(responses):
    spec = AgentSpec(sessions=2, turns=4, system_prompt_tokens=30, tool_schema_tokens=50)
    wl = build_spec("agent", spec, TOK, 5)
    s1, s2 = list(wl.sessions())
    prev = s1.next_request()
    assert prev.shared_prefix_tokens == 5 + 30 + 50
    first2 = s2.next_request()
    # the system prompt and tool schemas are shared by all sessions
    assert first2.messages[0] == prev.messages[0]
    for k, resp in enumerate(responses, 1):
        s1.feed_response(resp)
        cur = s1.next_request()
        assert cur.turn == k and cur.think_time_s > 0
        assert cur.messages[: len(prev.messages)] == prev.messages
        assert cur.messages[len(prev.messages)] == {"role": "assistant", "content": resp}
        assert cur.messages[-1]["role"] == "user"
        assert cur.prompt_tokens == TOK.count_chat(cur.messages)
        # the rendered prompt starts with the previous prompt's messages and the response
        prefix = TOK.render_chat(prev.messages)[: -len("<|assistant|>\n")] + \
            "<|assistant|>\n" + resp
        assert TOK.render_chat(cur.messages).startswith(prefix)
        assert cur.shared_prefix_tokens >= prev.prompt_tokens - 1
        prev = cur
    s1.feed_response("x")
    assert s1.next_request() is None


def test_agent_missing_response_continues_empty():
    wl = build_spec("agent", AgentSpec(sessions=1, turns=2), TOK, 0)
    (s,) = wl.sessions()
    s.next_request()
    r = s.next_request()  # the first request failed: no feed_response
    assert r.messages[2] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("order", ["interleave", "tile"])
def test_longctx_orders_and_sharing(order):
    spec = SMALL["longctx"].model_copy(update={"order": order})
    reqs = list(build_spec("longctx", spec, TOK, 2).requests())
    seq = [r.session_id for r in reqs]
    contracts = sorted(set(seq))
    assert len(reqs) == 9 and len(contracts) == 3
    if order == "tile":
        assert seq == [c for c in contracts for _ in range(3)]
    else:
        assert seq == contracts * 3
    for c in contracts:
        group = [r for r in reqs if r.session_id == c]
        n = group[0].shared_prefix_tokens
        assert [r.turn for r in group] == [0, 1, 2]
        assert 500 + 5 <= n <= 1200 + 5
        t0 = TOK.tokens(_sent_text(group[0]))
        for r in group[1:]:
            assert TOK.tokens(_sent_text(r))[:n] == t0[:n]


def test_hogwild_workers_share_the_transcript():
    spec = HogwildSpec(tasks=1, workers=3, steps_per_worker=3,
                       task_tokens=LengthDist(dist="constant", mean=100))
    wl = build_spec("hw", spec, TOK, 0)
    sessions = list(wl.sessions())
    assert len(sessions) == 3
    outs = []
    for step in range(3):
        reqs = [s.next_request() for s in sessions]
        for w, r in enumerate(reqs):
            content = r.messages[0]["content"]
            assert r.request_class == "hogwild" and r.turn == step
            for o in outs:  # every output so far is in every worker's prompt
                assert o in content
            assert content.endswith(f"[worker {w + 1}]")
            assert r.prompt_tokens == TOK.count_chat(r.messages)
        for w, (s, r) in enumerate(zip(sessions, reqs)):
            out = f" output {step} of worker {w}"
            outs.append(out)
            s.feed_response(out)
    assert all(s.next_request() is None for s in sessions)


def test_mix_counts_classes_and_determinism():
    cfg = load_config(ROOT / "bench.toml")
    a = list(make_workload("mix", cfg).requests())
    b = list(make_workload("mix", cfg).requests())
    assert _dump(a) == _dump(b)
    assert len(a) == cfg.workloads["mix"].requests
    classes = {r.request_class for r in a}
    assert classes == {"chat", "rag", "agent", "longctx"}
    wl = make_workload("mix", cfg)
    assert wl.request_class == "mix"
    per = {c: sum(r.request_class == c for r in a) for c in classes}
    assert per["chat"] > per["longctx"]  # weights 4 : 1
    sess = list(wl.sessions())
    turns = 0
    for s in sess:
        while s.next_request() is not None:
            turns += 1
            s.feed_response("ok")
    assert turns == len(a)


def _cfg(workloads: dict) -> object:
    return parse_config({
        "endpoints": [{"name": "e", "kind": "openai", "url": "http://127.0.0.1:1",
                       "max_context_tokens": 200000}],
        "profiles": {"p": {"stages": [{"users": 1, "duration_s": 1}]}},
        "workloads": workloads,
    })


@pytest.mark.parametrize("multiple", [0.5, 2.0, 10.0])
def test_working_set_sizing(multiple):
    cap = 40_000
    cfg = _cfg({
        "rag": {"kind": "rag", "chunks_per_document": 4, "top_k": 4,
                "working_set": {"kv_capacity_tokens": cap, "multiple": multiple}},
        "lc": {"kind": "longctx",
               "contract_tokens": {"dist": "uniform", "mean": 8000, "min": 4000,
                                   "max": 12000},
               "working_set": {"kv_capacity_tokens": cap, "multiple": multiple}},
    })
    rag = make_workload("rag", cfg)
    corpus = 128 + sum(rag.document(d).ntok for d in range(rag.documents))
    assert multiple * cap <= corpus < multiple * cap + 4 * 256 + 128
    assert rag.documents == pytest.approx(multiple * cap / 1024, abs=1.5)
    lc = make_workload("lc", cfg)
    total = lc.unique_contract_tokens()
    assert multiple * cap <= total < multiple * cap + 12000


def test_working_set_rejected_where_meaningless():
    from kvbench.core.errors import UserError
    cfg = _cfg({"c": {"kind": "chat", "working_set": {"kv_capacity_tokens": 10,
                                                      "multiple": 2}}})
    with pytest.raises(UserError, match="working_set"):
        make_workload("c", cfg)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["constant", "uniform", "lognormal", "normal"]),
       mean=st.floats(1, 5000), sigma=st.floats(0, 2), lo=st.integers(0, 50),
       span=st.integers(0, 5000), seed=st.integers(0, 2**32))
def test_sampler_respects_bounds(kind, mean, sigma, lo, span, seed):
    dist = LengthDist(dist=kind, mean=mean, sigma=sigma, min=lo, max=lo + span + 1)
    x = sample(dist, np.random.default_rng(seed), 200)
    assert x.dtype == np.int64 and x.min() >= lo and x.max() <= lo + span + 1
    y = sample(dist, np.random.default_rng(seed), 200, integer=False)
    assert y.min() >= lo and y.max() <= lo + span + 1
    assert np.array_equal(x, sample(dist, np.random.default_rng(seed), 200))


def test_flatten_round_robin_window():
    class S:
        def __init__(self, i):
            self.session_id, self.i, self.k = f"s{i}", i, 0

        def next_request(self):
            if self.k == 2:
                return None
            self.k += 1
            return (self.i, self.k)

        def feed_response(self, text):
            pass

    got = list(flatten([S(i) for i in range(3)], "round_robin", lambda r: "", window=2))
    assert got == [(0, 1), (1, 1), (0, 2), (1, 2), (2, 1), (2, 2)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20000), rid=st.text(max_size=10))
def test_synthetic_response_exact_length(n, rid):
    wl = build_spec("agent", SMALL["agent"], TOK, 1)
    r = next(iter(wl.requests()))
    from dataclasses import replace
    fake = replace(r, max_tokens=n, request_id=rid)
    text = wl.synthetic_response(fake)
    assert TOK.count(text) == n and text == wl.synthetic_response(fake)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A small byte-level BPE tokenizer.json trained here (no model download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvbench.workloads.tokenizer import _builtin_vocabulary

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = list(_builtin_vocabulary())[:1500]
    tok.train_from_iterator([" ".join(words)] * 3 + ["<|user|>\n hello. world, 42!"], trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return get_tokenizer(str(path))


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_hf_tokenizer_counts_what_is_sent(kind, hf_tokenizer):
    wl = build_spec(kind, SMALL[kind], hf_tokenizer, 0)
    for r in list(wl.requests())[:12]:
        assert r.prompt_tokens == hf_tokenizer.count_chat(r.messages)
        assert 0 <= r.shared_prefix_tokens <= r.prompt_tokens
    chat = build_spec("chat", ChatSpec(requests=20), hf_tokenizer, 0)
    over = chat.template_tokens
    for r in chat.requests():
        assert r.prompt_tokens == hf_tokenizer.count_chat(r.messages)
        assert r.prompt_tokens >= over
