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
