"""``kvbench predict``: a built-in endpoint's (a calibrated twin's) capacity at SLO and latency
in virtual time (kvbench.runs.predict over kvbench.runs.virtual). On the repository's
bench.toml it gives bench/bakeoff_sim.py --precise's steady state exactly for the same settings
and seed; a what-if topology returns a capacity and lists the options the measured topology
cannot show as assumed; bad input is one sentence naming the file, the field and the fix.
Short virtual durations keep each test to seconds."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.config import load_config
from kvbench.core.errors import UserError
from kvbench.endpoints.config import EmulatorConfig
from kvbench.runs import predict as pr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kvbench_cli import tiny_chat_config  # noqa: E402

PROFILE = """[profiles.p]
pacing = "poisson"
stages = [{ rate_rps = 1.0, duration_s = 1 }]
"""

TWIN = """
[twin]
endpoint = "tiny"
fitted = ["prefill_tok_per_ms", "max_num_seqs", "prefill_and_frontend_us_per_token"]
source = "results/run-1"     # what a calibration adds beside the fields predict reads

[twin.fit.prefill_tok_per_ms]
value = 40.0
stderr = 0.5
status = "fit"

[twin.fit.max_num_seqs]
value = 4
status = "bound"

[twin.fit.prefill_and_frontend_us_per_token]
value = 27.0
stderr = 0.3
status = "fit"
"""


def tiny(tmp_path, extra: str = "") -> Path:
    cfg = tmp_path / "twin.toml"
    cfg.write_text(tiny_chat_config("tiny", 4, PROFILE, 100.0)
                   .replace("time_scale = 0.5", "time_scale = 0.2")
                   .replace("@RESULTS@", str(tmp_path / "results")) + extra)
    return cfg


def predict_json(capsys, *args) -> dict:
    assert main(["predict", *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_predict_on_the_default_config_equals_bakeoff_sims_steady_state(tmp_path, capsys):
    """The same harness, workload, warm prefixes, options and bisection: the same numbers."""
    common = ["--seconds", "20", "--warmup-s", "5", "--seed", "3", "--guess", "50",
              "--precision", "0.1"]
    out = tmp_path / "truth.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bakeoff_sim.py"), "--config",
         str(ROOT / "bench.toml"), "--workload", "chat", "--topologies", "colocated", "--warm",
         "--precise", "--seeds", "1", "--jobs", "1", "--json", str(out), *common],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    truth = json.loads(out.read_text())["topologies"]["colocated"]
    got = predict_json(capsys, "--config", str(ROOT / "bench.toml"), "--workload", "chat",
                       "--endpoint", "colocated", "--loads", "1", *common)
    assert got["prediction"] is True and "prediction" in got["note"] and got["warm"] is True
    (e,) = got["endpoints"]
    c = e["capacity"]
    assert c["median"] is not None
    assert c["capacities"] == truth["capacities"] and c["median"] == truth["median"]
    assert c["median_per_gpu"] == truth["median_per_gpu"] and c["gpus"] == truth["gpus"] == 1
    assert c["crossings"] == truth["crossings"]
    assert [t["rate"] for t in c["seeds"][0]["tried"]] == \
        [t["rate"] for t in truth["seeds"][0]["tried"]]
    assert [t["worst_att"] for t in c["seeds"][0]["tried"]] == \
        [t["worst_att"] for t in truth["seeds"][0]["tried"]]
    # per class and latency against offered rate, at the capacity itself
    assert set(e["classes"]) == {"chat"} and e["classes"]["chat"]["share"] == 1.0
    (lat,) = e["latency"]
    assert lat["rate"] == c["median"] and lat["pass"]
    x = lat["classes"]["chat"]
    assert 0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"] and 0 < x["tpot_p50_ms"] <= x["tpot_p99_ms"]
    # the predicted prefix hit ratio (the twin_gap rule compares the measured one with it):
    # warm shared system prompts (most of a chat prompt), each prompt's own tail uncached
    assert 0.5 < x["hit_ratio"] < 1
    # no [twin] in bench.toml: every option is assumed, the endpoint's own ones as given
    assert e["fitted"] == [] and e["twin"] is False
    assumed = {a["option"]: a for a in e["assumed"]}
    assert set(assumed) == set(EmulatorConfig.model_fields) - {"topology"}
    assert assumed["replicas"]["source"] == "given" and assumed["replicas"]["value"] == 1
    assert assumed["prefill_tok_per_ms"]["source"] == "default"


def test_a_what_if_topology_returns_a_capacity_and_lists_the_link_as_assumed(tmp_path,
                                                                             capsys):
    cfg = tiny(tmp_path)
    args = ["--config", str(cfg), "--topology", "disaggregated", "--options", "rdma_gb_s=50",
            "--seconds", "10", "--warmup-s", "2", "--guess", "20", "--precision", "0.2",
            "--loads", "1"]
    got = predict_json(capsys, *args)
    (e,) = got["endpoints"]
    assert e["what_if"] and e["measured_topology"] == "colocated"
    assert e["topology"] == "disaggregated" and e["gpus"] == 2  # 1 GPU: 1 prefill + 1 decode
    assert "needs at least" in e["what_if_layout"]
    assert e["capacity"]["median"] > 0 and e["latency"][0]["rate"] == e["capacity"]["median"]
    assumed = {a["option"]: a for a in e["assumed"]}
    assert assumed["rdma_gb_s"] == {"option": "rdma_gb_s", "value": 50.0,
                                    "source": "--options", "unobserved": True}
    for name in ("link", "tcp_gb_s", "pd_setup_ms", "pd_us_per_block_layer"):
        assert assumed[name]["unobserved"] and assumed[name]["source"] == "default", name
    assert assumed["max_num_seqs"]["source"] == "given" and not assumed["max_num_seqs"][
        "unobserved"]
    assert not assumed["dram_gb_s"]["unobserved"]  # disaggregated adds no tier
    # the text labels every figure a prediction and names what it assumed
    assert main(["predict", *args]) == 0
    text = capsys.readouterr().out
    assert "(PREDICTED)" in text and "not a measurement" in text
    assert "predicted capacity:" in text and "tiny as disaggregated (what-if)" in text
    assert "ASSUMED, not observable on colocated: " in text and "rdma_gb_s=50.0 (--options)" in text
    assert main(["predict", *args, "--format", "md"]) == 0
    assert "### kvbench predict: chat" in capsys.readouterr().out


@pytest.mark.parametrize("topology,options,hidden,layout", [
    ("offloaded", {"dram_gb_s": 25}, ("dram_gb_s", "disk_gb_s", "dram_bytes", "offload"),
     {"replicas": 1}),
    ("routed", {"router": "ROUND_ROBIN"}, ("router", "cross_region_rtt_ms"),
     {"regions": 1, "replicas_per_region": 1}),
    ("disaggregated", {"prefill_gpus": 2}, ("link", "rdma_gb_s"),
     {"prefill_gpus": 2, "decode_gpus": 1}),
])
def test_each_what_if_lays_the_same_gpus_and_marks_what_it_adds(tmp_path, topology, options,
                                                                hidden, layout):
    cfg = tiny(tmp_path)
    (e,) = pr.plan(load_config(cfg), cfg, pr.Settings(workload="chat", topology=topology,
                                                      options=options))
    assert e["topology"] == topology and e["what_if"]
    for k, v in layout.items():
        assert e["options"][k] == v, k
    assumed = {a["option"]: a for a in e["assumed"]}
    for name in hidden:
        assert assumed[name]["unobserved"], name
    for k in options:
        assert assumed[k]["source"] == "--options"
    assert not assumed["max_num_seqs"]["unobserved"]


def test_the_twin_table_says_what_was_fitted_and_everything_else_is_assumed(tmp_path):
    cfg = tiny(tmp_path, TWIN)
    c = load_config(cfg)
    assert c.twin.endpoint == "tiny" and c.twin.fit["max_num_seqs"].status == "bound"
    (e,) = pr.plan(c, cfg, pr.Settings(workload="chat"))
    fitted = {f["option"]: f for f in e["fitted"]}
    assert fitted["prefill_tok_per_ms"]["stderr"] == 0.5
    assert fitted["max_num_seqs"]["status"] == "bound" and fitted["max_num_seqs"]["value"] == 4
    assert fitted["prefill_and_frontend_us_per_token"]["engine_option"] is False
    assumed = {a["option"] for a in e["assumed"]}
    assert not assumed & set(fitted)
    assert assumed | set(fitted) >= set(EmulatorConfig.model_fields) - {"topology"}
    assert e["twin"]


def test_a_twin_file_predicts_under_another_suites_workloads_and_slos(tmp_path):
    suite = tiny(tmp_path)
    twin = tmp_path / "only-twin.toml"
    twin.write_text('[[endpoints]]\nname = "twin"\nkind = "builtin"\ntopology = "colocated"\n'
                    'options = { replicas = 1, max_num_seqs = 8 }\n'
                    + TWIN.replace('endpoint = "tiny"', 'endpoint = "twin"'))
    c = load_config(twin, under=suite)
    assert [ep.name for ep in c.endpoints] == ["twin"] and "chat" in c.workloads
    assert c.slo["chat"].ttft_ms == 100
    (e,) = pr.plan(c, twin, pr.Settings(workload="chat"))
    assert e["endpoint"] == "twin" and e["options"]["max_num_seqs"] == 8


def _error(capsys, *args) -> str:
    assert main(["predict", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_bad_input_is_one_sentence_naming_file_field_and_fix(tmp_path, capsys):
    cfg = tiny(tmp_path)
    err = _error(capsys, "--config", str(cfg), "--topology", "mesh")
    assert "--topology mesh: not a topology; use one of" in err and "disaggregated" in err
    err = _error(capsys, "--config", str(cfg), "--options", "warp_factor=9")
    assert str(cfg) in err and "endpoints[0].options" in err and "warp_factor" in err
    assert "remove it or check its spelling" in err
    err = _error(capsys, "--config", str(cfg), "--options", "rdma_gb_s=-1")
    assert "rdma_gb_s" in err and str(cfg) in err
    err = _error(capsys, "--config", str(cfg), "--workload", "nope")
    assert "--workload nope" in err and "chat" in err
    openai = tmp_path / "real.toml"
    openai.write_text(cfg.read_text().replace(
        'kind = "builtin"\ntopology = "colocated"\n'
        'options = { max_num_seqs = 4, replicas = 1, time_scale = 0.2 }',
        'kind = "openai"\nurl = "http://127.0.0.1:9"'))
    err = _error(capsys, "--config", str(openai))
    assert str(openai) in err and "endpoints[0] ('tiny') is of kind 'openai'" in err
    assert "kvbench calibrate" in err
    bad_twin = tiny(tmp_path, TWIN.replace('endpoint = "tiny"', 'endpoint = "ghost"'))
    err = _error(capsys, "--config", str(bad_twin))
    assert "field twin.endpoint" in err and "'ghost'" in err and "['tiny']" in err
    lone = tmp_path / "lone.toml"
    lone.write_text('[[endpoints]]\nname = "twin"\nkind = "builtin"\ntopology = "colocated"\n')
    err = _error(capsys, "--config", str(lone))
    assert str(lone) in err and "--slo-config" in err


@pytest.mark.parametrize("topology", ["disaggregated", "offloaded"])
def test_the_default_colocated_endpoint_as_a_what_if_is_the_default_endpoint_of_it(topology):
    """bench.toml's colocated GPU laid out as disaggregated (1 prefill + 1 decode) or with the
    offload tiers added runs the engines of that topology's own built-in endpoint."""
    path = ROOT / "bench.toml"
    cfg = load_config(path)
    (e,) = pr.plan(cfg, path, pr.Settings(endpoint="colocated", topology=topology))
    (own,) = pr.plan(cfg, path, pr.Settings(endpoint=topology))
    assert e["gpus"] == own["gpus"] and e["gpus_how"] == own["gpus_how"]
    from kvbench.endpoints.config import validate_options

    a = validate_options(topology, e["options"]).resolved()
    b = validate_options(topology, own["options"]).resolved()
    assert a.cfg.model_dump(exclude={"replicas"}) == b.cfg.model_dump(exclude={"replicas"})
    assert (a.capacity_blocks, a.link_gb_s, a.offload_step_overhead) == \
        (b.capacity_blocks, b.link_gb_s, b.offload_step_overhead)


def test_endpoints_that_are_not_built_in_are_named_as_not_predicted(tmp_path, capsys):
    cfg = tiny(tmp_path)
    text = cfg.read_text().replace("[workloads.chat]", '[[endpoints]]\nname = "real"\n'
                                   'kind = "openai"\nurl = "http://127.0.0.1:9"\n\n'
                                   "[workloads.chat]")
    cfg.write_text(text)
    got = predict_json(capsys, "--config", str(cfg), "--seconds", "5", "--warmup-s", "1",
                       "--guess", "20", "--precision", "0.3", "--loads", "1")
    assert [e["endpoint"] for e in got["endpoints"]] == ["tiny"] and got["skipped"] == ["real"]
