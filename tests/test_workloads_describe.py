"""describe(): hit ratios on hand-computed cases, and the ``kvbench workloads`` command."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kvbench.cli import main
from kvbench.workloads.base import Request
from kvbench.workloads.describe import PrefixCacheSim, block_keys, describe

ROOT = Path(__file__).resolve().parents[1]


def req(i: int, prompt: str, max_tokens: int = 4, cls: str = "chat") -> Request:
    from kvbench.workloads.tokenizer import get_tokenizer
    return Request(request_id=f"r{i}", request_class=cls, max_tokens=max_tokens,
                   prompt_tokens=get_tokenizer().count(prompt), shared_prefix_tokens=0,
                   session_id=f"r{i}", prompt=prompt)


def words(*names: str) -> str:
    return "".join(f" {n}" for n in names)


def test_hit_ratio_hand_computed():
    a = [f"a{i}" for i in range(8)]
    b = [f"b{i}" for i in range(8)]
    reqs = [
        req(0, words(*a, *b)),          # 16 tokens = 4 blocks of 4: all new
        req(1, words(*a, *b[:4], "x")),  # 13 tokens: blocks a0-3, a4-7, b0-3 hit; x partial
        req(2, words(*b, *a)),          # different start: nothing hits
        req(3, words(*a[:3])),          # 3 tokens: no full block, no hit
    ]
    d = describe(reqs, block_tokens=4)
    assert d["requests"] == 4
    assert d["total_prompt_tokens"] == 16 + 13 + 16 + 3
    assert d["theoretical_hit_ratio_unbounded"] == pytest.approx(12 / 48)
    assert d["unique_tokens"] == 48 - 12
    assert d["theoretical_hit_ratio_lru"] is None
    assert d["prompt_tokens_pcts"]["max"] == 16
    assert d["classes"] == {"chat": 4}
    # an LRU of 4 blocks: after request 0 it holds a's two blocks and b's two; request 1 hits
    # 3 blocks; request 2 inserts 4 new blocks, evicting everything
    d = describe(reqs, block_tokens=4, capacity_tokens=16)
    assert d["theoretical_hit_ratio_lru"] == pytest.approx(12 / 48)
    d = describe(reqs + [req(4, words(*a, *b))], block_tokens=4, capacity_tokens=16)
    assert d["theoretical_hit_ratio_unbounded"] == pytest.approx((12 + 16) / 64)
    assert d["theoretical_hit_ratio_lru"] == pytest.approx(12 / 64)


def test_lru_evicts_tails_first():
    sim = PrefixCacheSim(capacity_blocks=3)
    assert sim.add([1, 2, 3]) == (0, 0)
    assert sim.add([9]) == (0, 0)     # evicts block 3, the tail of the older prefix
    assert sim.add([1, 2, 3]) == (3, 2)


def test_block_keys_chain():
    k1 = block_keys(list("abcdefgh"), 4)
    k2 = block_keys(list("xbcdefgh"), 4)
    assert len(k1) == 2 and k1[1] != k2[1]  # equal second blocks, different prefixes
    assert block_keys(list("abcdefg"), 4) == k1[:1]


@settings(max_examples=50, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=24), min_size=1, max_size=12),
       bt=st.integers(1, 5))
def test_unbounded_hits_equal_longest_seen_block_prefix(seqs, bt):
    """Brute force: a request's hit is the longest earlier whole-block prefix it repeats."""
    sim = PrefixCacheSim(None)
    earlier: list[list[int]] = []
    for s in seqs:
        h, _ = sim.add(block_keys(s, bt))
        best = 0
        for e in earlier:
            k = 0
            while (k + 1) * bt <= min(len(s), len(e)) and s[:(k + 1) * bt] == e[:(k + 1) * bt]:
                k += 1
            best = max(best, k)
        assert h == best
        earlier.append(s)


def test_describe_generated_workload_matches_declared_structure():
    from kvbench.config import load_config
    from kvbench.workloads.registry import make_workload

    cfg = load_config(ROOT / "bench.toml")
    d = describe(make_workload("rag", cfg))
    # system prompt + 4 chunks of 256 make up ~95% of each prompt; Zipf over 40 documents
    # repeats most of them
    assert 0.5 < d["theoretical_hit_ratio_unbounded"] < d["shared_prefix_ratio"] < 1
    c = describe(make_workload("chat", cfg))
    assert c["theoretical_hit_ratio_unbounded"] == 0.0
    assert c["unique_tokens"] == c["total_prompt_tokens"]


def test_cli_describe_mix_default_config(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    t0 = time.process_time()  # CPU, not wall: a busy host stretches wall time (14.8 s seen)
    assert main(["workloads", "describe", "mix", "--json"]) == 0
    assert time.process_time() - t0 < 10
    out = json.loads(capsys.readouterr().out)
    d = out["mix"]
    assert d["requests"] == 3000
    assert set(d["classes"]) == {"chat", "rag", "agent", "longctx"}
    assert main(["workloads", "describe", "--capacity-tokens", "100000"]) == 0
    text = capsys.readouterr().out
    for name in ("rag", "agent", "longctx", "chat", "mix", "hit unbounded"):
        assert name in text


def test_describing_the_whole_config_passes_over_a_trace_not_on_this_machine(tmp_path, capsys):
    # a checkout without ../shared/traces: the other workloads are still described, the
    # missing trace is said; named on its own, it is an error naming the path
    cfg = tmp_path / "bench.toml"
    cfg.write_text('[[endpoints]]\nname = "e"\nkind = "builtin"\ntopology = "colocated"\n\n'
                   '[profiles.p]\nstages = [{ users = 1, duration_s = 1 }]\n\n'
                   '[workloads.chat]\nkind = "chat"\nrequests = 20\n\n'
                   '[workloads.agentic]\nkind = "trace"\nformat = "agentic"\n'
                   'path = "no-such-folder"\n')
    assert main(["workloads", "describe", "--config", str(cfg), "--json"]) == 0
    got = capsys.readouterr()
    assert set(json.loads(got.out)) == {"chat"}
    assert "workload agentic skipped" in got.err and "no-such-folder" in got.err
    assert main(["workloads", "describe", "agentic", "--config", str(cfg)]) == 2
    assert "no-such-folder does not exist" in capsys.readouterr().err


def test_cli_trace_and_errors(tmp_path, capsys):
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": 0, "input_length": 1024,
                                       "output_length": 3, "hash_ids": [1, 2]})
                           for _ in range(3)) + "\nnot json\n")
    assert main(["workloads", "describe", str(p), "--config", str(tmp_path / "none.toml")]) == 2
    assert f"{p}:4: not valid JSON" in capsys.readouterr().err
    assert main(["workloads", "describe", str(p), "--skip-bad-lines", "--json",
                 "--config", str(tmp_path / "none.toml")]) == 0
    d = json.loads(capsys.readouterr().out)[str(p)]
    assert d["requests"] == 3 and d["block_tokens"] == 512
    assert d["theoretical_hit_ratio_unbounded"] == pytest.approx(2 / 3)
    assert "skipped 1 malformed" in d["notes"][0]
    assert main(["workloads", "describe", "nosuch", "--config",
                 str(ROOT / "bench.toml")]) == 2
    assert "'nosuch' is not defined" in capsys.readouterr().err
    out = tmp_path / "g.jsonl"
    assert main(["workloads", "generate", "chat", "--config", str(ROOT / "bench.toml"),
                 "--out", str(out), "--limit", "5"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 5 and rows[0]["request_class"] == "chat"


def test_cli_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "kvbench", "workloads", "describe", "chat",
                        "--config", str(ROOT / "bench.toml")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "chat" in r.stdout and "120" in r.stdout
