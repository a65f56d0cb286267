"""bench.toml values that load today but can never work (issue 32): a built-in endpoint of a
billion billion replicas, a GPU price of ``false``, a gate ceiling below zero on a rate, a
results folder that is a URL; and every problem of a config shown at once, not the first."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.config import load_config
from kvbench.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "bench.toml").read_text()


def _replaced(tmp_path, *pairs):
    text = TEXT
    for old, new in pairs:
        assert old in text, old
        text = text.replace(old, new, 1)
    p = tmp_path / "bench.toml"
    p.write_text(text)
    return p


def _refused(p) -> str:
    with pytest.raises(UserError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg and msg.count("\n") == 0 and msg.endswith("."), msg
    return msg


@pytest.mark.parametrize("option", ["replicas", "prefill_gpus", "decode_gpus", "regions",
                                    "replicas_per_region"])
@pytest.mark.parametrize("value", ["1e18", "1000000", "100001"])
def test_builtin_engine_counts_have_a_ceiling(tmp_path, option, value):
    """Before: replicas = 1e18 loaded, and the built-in server never listened."""
    p = _replaced(tmp_path, ("options = { replicas = 1 }", f"options = {{ {option} = {value} }}"))
    msg = _refused(p)
    assert msg.startswith(f"{p}: field endpoints[0].options.{option}: ")
    assert "smaller" in msg


def test_builtin_engine_counts_in_range_still_load(tmp_path):
    p = _replaced(tmp_path, ("options = { replicas = 1 }", "options = { replicas = 8 }"))
    assert load_config(p).endpoints[0].options["replicas"] == 8


@pytest.mark.parametrize("value", ["false", "true", '"4.0"'])
def test_gpu_hour_cost_is_a_number(tmp_path, value):
    """Before: gpu_hour_cost = false loaded as a price of 0.0 (and true as 1.0)."""
    p = _replaced(tmp_path, ("gpu_hour_cost = 4.0", f"gpu_hour_cost = {value}"))
    msg = _refused(p)
    assert msg.startswith(f"{p}: field endpoints[0].gpu_hour_cost: ")
    assert "number" in msg


@pytest.mark.parametrize("value", ["4", "4.5", "0"])
def test_gpu_hour_cost_numbers_still_load(tmp_path, value):
    p = _replaced(tmp_path, ("gpu_hour_cost = 4.0", f"gpu_hour_cost = {value}"))
    assert load_config(p).endpoints[0].gpu_hour_cost == float(value)


def test_gpu_hour_cost_of_an_openai_endpoint_is_a_number(tmp_path):
    p = tmp_path / "bench.toml"
    p.write_text(TEXT + '\n[[endpoints]]\nname = "mine"\nkind = "openai"\n'
                 'url = "http://127.0.0.1:8000"\nmax_context_tokens = 131072\n'
                 "gpu_hour_cost = false\n")
    assert "gpu_hour_cost" in _refused(p)


@pytest.mark.parametrize("metric", ["error_rate", "hit_ratio", "slo_attainment", "goodput_rps",
                                    "ttft_p50"])
def test_a_negative_ceiling_that_can_never_pass_is_refused(tmp_path, metric):
    """Before: max_value = -0.005 on error_rate loaded, a rule no run can pass."""
    p = _replaced(tmp_path, ('{ metric = "error_rate", class = "*", max_value = 0.005 }',
                             f'{{ metric = "{metric}", class = "*", max_value = -0.005 }}'))
    msg = _refused(p)
    assert msg.startswith(f"{p}: field gate.rules[")
    assert "max_value" in msg and "never" in msg


def test_a_zero_ceiling_on_error_rate_still_loads(tmp_path):
    p = _replaced(tmp_path, ("max_value = 0.005", "max_value = 0"))
    assert any(r.max_value == 0 for r in load_config(p).gate.rules)


def test_results_dir_with_a_url_scheme_is_refused(tmp_path):
    """Object storage is s3:// (S3 and the stores that speak its API); any other scheme is
    refused in the config's one sentence."""
    p = _replaced(tmp_path, ('results_dir = "results"', 'results_dir = "gs://bucket/prefix"'))
    msg = _refused(p)
    assert msg.startswith(f"{p}: field suite.results_dir: ") and "gs://" in msg


def test_every_problem_is_shown_not_only_the_first(tmp_path):
    """Before: the first problem, then "(2 more problems after this one)"."""
    p = _replaced(tmp_path, ("gpu_hour_cost = 4.0", "gpu_hour_cost = false"),
                  ('results_dir = "results"', 'results_dir = "gs://bucket"'),
                  ("options = { replicas = 1 }", "options = { replicas = 1, slowdown = 0 }"),
                  ("max_value = 0.005", "max_value = -0.005"))
    msg = _refused(p)
    assert "more problem" not in msg
    for field in ("suite.results_dir", "endpoints[0].gpu_hour_cost", "gate.rules[",
                  "endpoints[0].options.slowdown"):
        assert field in msg, (field, msg)


def test_every_problem_across_sections_is_shown(tmp_path):
    p = tmp_path / "bench.toml"
    p.write_text(TEXT + '\n[slo.nosuch]\nttft_ms = 100\n[slo.other]\nttft_ms = 100\n')
    msg = _refused(p)
    assert "[slo.nosuch]" in msg and "[slo.other]" in msg


def test_the_command_line_shows_them_on_one_line(tmp_path):
    p = _replaced(tmp_path, ("gpu_hour_cost = 4.0", "gpu_hour_cost = false"),
                  ('results_dir = "results"', 'results_dir = "gs://bucket"'))
    proc = subprocess.run([sys.executable, "-m", "kvbench", "workloads", "describe", "chat",
                           "--config", str(p)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "gpu_hour_cost" in proc.stderr and "results_dir" in proc.stderr
