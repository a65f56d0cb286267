"""GPU counts of the endpoints: a built-in endpoint's follow from its topology and options (a
written `gpus` must agree, else a one-sentence config error); an openai endpoint's are as
configured; run.json records them with the price."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvbench.config.parse import load_config, parse_config
from kvbench.core.errors import UserError
from kvbench.runs.job import resolve

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*endpoints: dict):
    data = tomllib.loads((ROOT / "bench.toml").read_text())
    data["endpoints"] = list(endpoints)
    return parse_config(data)


@pytest.mark.parametrize("topology, options, gpus", [
    ("colocated", {}, 2),  # two replicas: the GPUs of one prefill and one decode GPU
    ("colocated", {"replicas": 5}, 5),
    ("offloaded", {}, 1),  # its DRAM and disk tiers are no GPUs
    ("offloaded", {"replicas": 3, "dram_bytes": 1e12}, 3),
    ("disaggregated", {}, 2),  # 1 prefill + 1 decode
    ("disaggregated", {"prefill_gpus": 3, "decode_gpus": 5}, 8),
    ("disaggregated", {"replicas": 7}, 2),  # replicas is a colocated setting
    ("routed", {}, 12),  # 3 regions x 4 replicas
    ("routed", {"regions": 2, "replicas_per_region": 3, "region_names": ["a", "b"]}, 6),
])
def test_builtin_gpus_follow_the_topology(topology, options, gpus):
    cfg = _cfg({"name": "e", "kind": "builtin", "topology": topology, "options": options})
    assert cfg.endpoints[0].gpus == gpus
    # the count the emulator's cluster actually builds (one engine per GPU)
    from kvbench.endpoints.cluster import Cluster
    from kvbench.endpoints.config import validate_options

    assert len(Cluster(validate_options(topology, options).resolved()).engines) == gpus
    # a written count that agrees is accepted
    same = _cfg({"name": "e", "kind": "builtin", "topology": topology, "options": options,
                 "gpus": gpus})
    assert same.endpoints[0].gpus == gpus


def test_builtin_gpus_that_disagree_are_a_config_error():
    with pytest.raises(UserError) as e:
        _cfg({"name": "e", "kind": "builtin", "topology": "disaggregated", "gpus": 1,
              "options": {"decode_gpus": 3}})
    msg = str(e.value)
    assert msg.startswith("bench.toml: field endpoints[0].gpus: gpus = 1 but this "
                          "disaggregated endpoint runs 4 GPUs: 1 prefill + 3 decode")
    assert "remove gpus" in msg and msg.count("\n") == 0 and msg.endswith(".")
    with pytest.raises(UserError, match=r"endpoints\[0\]\.gpus: gpus = 2 but this offloaded "
                                        r"endpoint runs 1 GPU: 1 replica \(options\.replicas"):
        _cfg({"name": "e", "kind": "builtin", "topology": "offloaded", "gpus": 2})
    # bad options are named as such, not as a GPU mismatch
    with pytest.raises(UserError, match=r"endpoints\[0\]\.options\.decode_gpus"):
        _cfg({"name": "e", "kind": "builtin", "topology": "disaggregated", "gpus": 2,
              "options": {"decode_gpus": 0}})
    with pytest.raises(UserError, match=r"endpoints\[0\]\.gpus: .*larger value"):
        _cfg({"name": "e", "kind": "builtin", "topology": "colocated", "gpus": 0})


def test_openai_gpus_as_configured():
    base = {"name": "v", "kind": "openai", "url": "http://127.0.0.1:9"}
    assert _cfg(base).endpoints[0].gpus == 1
    assert _cfg({**base, "gpus": 16, "topology": "disaggregated"}).endpoints[0].gpus == 16


def test_run_json_records_gpus_and_price():
    cfg = load_config(ROOT / "bench.toml")
    want = {"colocated": 1, "disaggregated": 2, "offloaded": 1}  # colocated: options.replicas
    assert {e.name: e.gpus for e in cfg.endpoints} == want
    for ep in cfg.endpoints:
        assert ep.gpu_hour_cost is not None  # the example prices of the default bake-off
        job = resolve(cfg, workload="mix", endpoint=ep.name, url="http://127.0.0.1:9",
                      lookup_model=False)
        rec = job.endpoint.record()
        assert (rec.gpus, rec.gpu_hour_cost) == (want[ep.name], ep.gpu_hour_cost)
