"""bench.toml validation: the default suite loads; bad input is one sentence naming file,
field and fix, before anything runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.config import load_config
from kvbench.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_default_suite_loads():
    cfg = load_config(ROOT / "bench.toml")
    assert {e.topology for e in cfg.endpoints} == {"colocated", "disaggregated", "offloaded"}
    assert cfg.workloads["mix"].kind == "mix"
    assert cfg.slo["rag"].ttft_ms > 0


def _write(tmp_path, text):
    base = (ROOT / "bench.toml").read_text()
    p = tmp_path / "bench.toml"
    p.write_text(base + "\n" + text)
    return p


@pytest.mark.parametrize("extra, field", [
    ("[workloads.typo]\nkind = \"rag\"\nrequestz = 3\n", "workloads.typo.requestz"),
    ("[workloads.neg]\nkind = \"chat\"\nrequests = -1\n", "workloads.neg.requests"),
    ("[profiles.bad]\npacing = \"poisson\"\nstages = [{ rate_rps = -2.0, duration_s = 5 }]\n",
     "profiles.bad.stages[0].rate_rps"),
    ("[workloads.huge]\nkind = \"chat\"\noutput_tokens = { dist = \"constant\", mean = 200000 }\n",
     "workloads.huge"),
    ("[workloads.wrongtype]\nkind = \"rag\"\ntop_k = \"four\"\n", "workloads.wrongtype.top_k"),
])
def test_bad_config_is_one_sentence(tmp_path, extra, field):
    p = _write(tmp_path, extra)
    with pytest.raises(UserError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg and field in msg
    assert msg.count("\n") == 0 and msg.endswith(".")


def test_unknown_kind_names_choices(tmp_path):
    p = _write(tmp_path, "[workloads.x]\nkind = \"ragg\"\n")
    with pytest.raises(UserError, match="workloads.x"):
        load_config(p)


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_cli_reports_error_without_traceback(tmp_path):
    p = _write(tmp_path, "[workloads.typo]\nkind = \"rag\"\nrequestz = 3\n")
    proc = subprocess.run([sys.executable, "-m", "kvbench", "workloads", "describe", "rag",
                           "--config", str(p)], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr


def test_openai_endpoint_engine_family(tmp_path):
    ep = ("[[endpoints]]\nname = \"mine\"\nkind = \"openai\"\nurl = \"http://127.0.0.1:8000\"\n"
          "max_context_tokens = 131072\n")
    cfg = load_config(_write(tmp_path, ep))
    assert cfg.endpoint("mine").engine == "auto"  # detected from /metrics
    assert load_config(_write(tmp_path, ep + "engine = \"llamacpp\"\n")).endpoint(
        "mine").engine == "llamacpp"
    p = _write(tmp_path, ep + "engine = \"vllmm\"\n")
    with pytest.raises(UserError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: field endpoints[3].engine: engine 'vllmm' is not a known")
    assert "\"auto\"" in msg and "llamacpp" in msg and msg.count("\n") == 0


def test_trace_path_is_relative_to_the_config(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"timestamp": 0, "input_length": 10, '
                                      '"output_length": 5, "hash_ids": [1]}\n')
    cfg = load_config(_write(tmp_path, "[workloads.tr]\nkind = \"trace\"\nformat = \"mooncake\"\n"
                                       "path = \"t.jsonl\"\n"))
    assert cfg.workloads["tr"].path == str(tmp_path / "t.jsonl")


@pytest.mark.parametrize("old, new, field", [
    ("requests = 3000\n", "requests = 240000000000\n", "workloads.mix.requests"),
    ("{ rate_rps = 2.0, duration_s = 10 }", "{ rate_rps = 2.0, duration_s = 1e18 }",
     "profiles.ladder.stages[0].duration_s"),
    ("{ rate_rps = 2.0,", "{ rate_rps = 9.2e18,", "profiles.ladder.stages[0].rate_rps"),
    ("ttft_ms = 500", "ttft_ms = inf", "slo.chat.ttft_ms"),
    ("tpot_ms = 50", "tpot_ms = nan", "slo.chat.tpot_ms"),
    ("[slo.rag]", "[slo.rga]", "slo"),
    ('metric = "ttft_p50"', 'metric = ""', "gate.rules[0].metric"),
    ('metric = "tpot_p50"', 'metric = "tpot_p5O"', "gate.rules[1].metric"),
    ("[workloads.chat]", "[workloads.\"os:system\"]", "workloads"),
    ('workload = "chat"', 'workload = "os:system"', "workloads.mix.components[0].workload"),
    ("sessions = 8\nturns = 4", "sessions = 8000000\nturns = 4000", "workloads.agent"),
    ("mean = 256 }", "mean = 256, sigma = 1e300 }", "workloads.rag.chunk_tokens.sigma"),
    ('workloads = ["mix", "longdoc"]', "workloads = -1", "suite.workloads"),
    ("max_in_flight = 256", "max_in_flight = 1e400", "profiles.ladder.max_in_flight"),
])
def test_absurd_or_unknown_values_are_one_sentence(tmp_path, old, new, field):
    text = (ROOT / "bench.toml").read_text()
    assert old in text
    p = tmp_path / "bench.toml"
    p.write_text(text.replace(old, new, 1))
    with pytest.raises(UserError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: field {field}") and msg.count("\n") == 0 and msg.endswith(".")


def test_unknown_slo_class_names_the_known_ones(tmp_path):
    with pytest.raises(UserError) as ei:
        load_config(_write(tmp_path, "[slo.chta]\nttft_ms = 100\n"))
    assert "[slo.chta]" in str(ei.value) and "'chat'" in str(ei.value)
    # a class becomes known with a workload that produces it (hogwild requests are "hogwild")
    cfg = load_config(_write(tmp_path, "[workloads.h]\nkind = \"hogwild\"\n"
                                       "[slo.hogwild]\nttft_ms = 100\n"))
    assert cfg.slo["hogwild"].ttft_ms == 100


def test_gate_metric_spellings_the_gate_accepts_still_load(tmp_path):
    text = (ROOT / "bench.toml").read_text().replace('metric = "ttft_p50"',
                                                     'metric = "ttft_p99.9"')
    p = tmp_path / "bench.toml"
    p.write_text(text)
    assert load_config(p).gate.rules[0].metric == "ttft_p99.9"


def test_bounds_leave_the_real_sizes_alone(tmp_path):
    big = ("[workloads.big]\nkind = \"chat\"\nrequests = 10000000\n"
           "prompt_tokens = { dist = \"lognormal\", mean = 2000, sigma = 1.5 }\n"
           "output_tokens = { dist = \"constant\", mean = 100 }\n"
           "[profiles.soak]\npacing = \"poisson\"\n"
           "stages = [{ rate_rps = 1000.0, duration_s = 604800 }]\n")
    cfg = load_config(_write(tmp_path, big))
    assert cfg.workloads["big"].requests == 10_000_000


@pytest.mark.parametrize("workloads", ["-1", "[1]", "{ x = [1] }", "{ x = { kind = [\"chat\"] } }",
                                       "{ x = { kind = { a = 1 } } }", "\"mix\""])
def test_workloads_of_the_wrong_type_are_one_sentence(tmp_path, workloads):
    p = tmp_path / "bench.toml"
    p.write_text(f"workloads = {workloads}\n"
                 "[[endpoints]]\nname = \"e\"\nkind = \"builtin\"\ntopology = \"colocated\"\n"
                 "[profiles.p]\nstages = [{ users = 1, duration_s = 1 }]\n")
    with pytest.raises(UserError) as ei:  # was a TypeError/AttributeError traceback
        load_config(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: field workloads") and "\n" not in msg and msg.endswith(".")


@pytest.mark.parametrize("value", ["0", "-1.2", "1000", "nan"])
def test_builtin_slowdown_out_of_range_is_one_sentence(tmp_path, value):
    text = (ROOT / "bench.toml").read_text()
    old = "options = { replicas = 1 }"  # the default suite's colocated endpoint
    assert old in text
    p = tmp_path / "bench.toml"
    p.write_text(text.replace(old, f"options = {{ replicas = 1, slowdown = {value} }}", 1))
    with pytest.raises(UserError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: field endpoints[0].options.slowdown: slowdown is ")
    assert "1.2 makes the endpoint 20% slower" in msg and msg.count("\n") == 0
    p.write_text(text.replace(old, "options = { replicas = 1, slowdown = 1.2 }", 1))
    assert load_config(p).endpoints[0].options["slowdown"] == 1.2


def test_a_chat_table_names_the_class_its_requests_carry(tmp_path):
    """A second chat table (long documents) gets SLOs of its own: its requests carry its
    request_class, a mix sends it as a class of its own, and a missing [slo.<class>] is
    named by the start-of-run warning."""
    from kvbench.config.parse import classes_without_slo
    from kvbench.workloads.registry import make_workload

    extra = ('[workloads.doc]\nkind = "chat"\nrequest_class = "doc"\nrequests = 20\n'
             'prompt_tokens = { dist = "constant", mean = 3000 }\n'
             '[workloads.both]\nkind = "mix"\nrequests = 40\n'
             'components = [{ workload = "chat", weight = 1 }, { workload = "doc", weight = 1 }]\n')
    cfg = load_config(_write(tmp_path, extra + "[slo.doc]\nttft_ms = 2000\n"))
    assert cfg.slo["doc"].ttft_ms == 2000
    assert {r.request_class for r in make_workload("doc", cfg).requests()} == {"doc"}
    assert {r.request_class for r in make_workload("both", cfg).requests()} == {"chat", "doc"}
    assert classes_without_slo(load_config(_write(tmp_path, extra)), ["both"]) == ["doc"]


@pytest.mark.parametrize("name", ["mix", "trace", "Long Docs", ""])
def test_a_reserved_or_malformed_class_name_is_one_sentence(tmp_path, name):
    p = _write(tmp_path, f'[workloads.doc]\nkind = "chat"\nrequest_class = "{name}"\n')
    with pytest.raises(UserError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg and "workloads.doc.request_class" in msg
    assert msg.count("\n") == 0 and msg.endswith(".")
