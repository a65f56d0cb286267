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
