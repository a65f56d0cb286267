"""A topology is one module of ``kvbench.model.topologies``. The topology below ("pair": two
prefill GPUs per decode GPU) exists only in this file: dropping its module beside the others is
all it takes for bench.toml to accept it, its GPU count to follow its options, the emulator to
wire and serve it and ``kvbench serve --topology pair`` to run it. No product file names a
topology beyond its own module and the GPU roles (tested here too)."""

from __future__ import annotations

import ast
import asyncio
import importlib
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbench.config.parse import parse_config
from kvbench.core.errors import UserError
from kvbench.model import topologies
from emulator_client import request

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("kvbench", "loadgen", "reports", "collectors", "endpoints", "workloads")

# ---- the example topology: its whole module --------------------------------------------------
PAIR = '''"""Two prefill GPUs per decode GPU: long prompts keep the decode pool fed."""

from kvbench.model.topologies.base import DECODE, PREFILL, Layout, Pool, Topology

TOPOLOGY = Topology(
    name="pair",
    description="two prefill GPUs per decode GPU",
    layout=lambda o: Layout((Pool(PREFILL, 2 * o.decode_gpus, "p"),
                             Pool(DECODE, o.decode_gpus, "d", entry=False))),
    gpus_how=lambda o: (f"{2 * o.decode_gpus} prefill + {o.decode_gpus} decode "
                        "(options.decode_gpus)"),
    splits_prefill_decode=True,
)
'''
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path):
    """The module dropped into a folder on the package's path, imported and registered as
    discovery does (discovery itself ran already in this process)."""
    (tmp_path / "pair.py").write_text(PAIR)
    topologies.__path__.append(str(tmp_path))
    try:
        yield topologies.register(importlib.import_module("kvbench.model.topologies.pair")
                                  .TOPOLOGY)
    finally:
        topologies.unregister("pair")
        topologies.__path__.remove(str(tmp_path))
        sys.modules.pop("kvbench.model.topologies.pair", None)


def _cfg(*endpoints: dict):
    data = tomllib.loads((ROOT / "bench.toml").read_text())
    data["endpoints"] = list(endpoints)
    return parse_config(data)


def _spelled(name: str) -> list[str]:
    """Product files holding a string constant equal to ``name`` (f-string parts included)."""
    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            if any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree)):
                found.append(str(path.relative_to(ROOT)))
    return found


def test_a_topology_name_is_spelled_in_at_most_two_product_files():
    # The GPU role "colocated" (the gpu table's role column, the emulator's engine role) counts:
    # it is spelled once, in topologies/base.py, beside the colocated topology's own module.
    assert topologies.names() == ("colocated", "disaggregated", "offloaded", "routed")
    for name in topologies.names():
        files = _spelled(name)
        assert f"kvbench/model/topologies/{name}.py" in files
        assert len(files) <= 2, (name, files)


def test_each_layout_runs_the_gpus_it_counts():
    from kvbench.endpoints.config import validate_options

    for name in topologies.names():
        for options in ({}, {"replicas": 3, "prefill_gpus": 2, "decode_gpus": 3, "regions": 2,
                             "replicas_per_region": 2}):
            cfg = validate_options(name, options)
            n, how = topologies.get(name).gpus(cfg)
            assert n == topologies.get(name).layout(cfg).gpus and "options." in how


def test_a_new_topology_is_validated_counted_and_emulated(pair):
    assert "pair" in topologies.where(splits_prefill_decode=True)
    ep = {"name": "e", "kind": "builtin", "topology": "pair", "options": {"decode_gpus": 2}}
    assert _cfg(ep).endpoints[0].gpus == 6
    with pytest.raises(UserError, match=r"gpus = 2 but this pair endpoint runs 6 GPUs: "
                                        r"4 prefill \+ 2 decode \(options\.decode_gpus\)"):
        _cfg({**ep, "gpus": 2})
    with pytest.raises(UserError, match=r"topology: Input should be 'colocated', "
                                        r"'disaggregated', 'offloaded', 'routed' or 'pair'"):
        _cfg({**ep, "topology": "pairs"})
    # a real endpoint may carry it as its label
    assert _cfg({"name": "v", "kind": "openai", "url": "http://127.0.0.1:9",
                 "topology": "pair"}).endpoints[0].topology == "pair"

    from kvbench.endpoints.config import validate_options
    from kvbench.endpoints.server import EmulatorServer

    async def go():
        srv = await EmulatorServer(validate_options("pair", {"decode_gpus": 2,
                                                             "time_scale": 0.05})).start()
        try:
            async with aiohttp.ClientSession() as s:
                reply = await request(s, srv.url, {"prompt": "a long prompt " * 50,
                                                   "max_tokens": 3})
                async with s.get(f"{srv.url}/metrics") as r:
                    text = await r.text()
            return srv, reply, text
        finally:
            await srv.stop()

    srv, reply, text = asyncio.run(go())
    assert reply.status == 200
    assert reply.headers["x-kvbench-replica"][0] == "p"  # prefilled on a prefill GPU...
    assert reply.headers["x-kvbench-replica"].split(">")[1][0] == "d"  # ...decoded on another
    assert reply.header_ms("kv-transfer") > 0
    roles = {s.labels["engine"]: s.labels["role"]
             for fam in text_string_to_metric_families(text) if fam.name == "DCGM_FI_DEV_GPU_UTIL"
             for s in fam.samples}
    assert roles == {"p0": "prefill", "p1": "prefill", "p2": "prefill", "p3": "prefill",
                     "d0": "decode", "d1": "decode"}


def test_kvbench_serve_runs_a_dropped_module(tmp_path):
    """A fresh process: the package finds the module on its own (pkgutil over its path)."""
    (tmp_path / "pair.py").write_text(PAIR)
    boot = ("import sys, kvbench.model.topologies as t; t.__path__.append(sys.argv[1]); "
            "from kvbench.cli import main; sys.exit(main(sys.argv[2:]))")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", boot, str(tmp_path), "serve", "--topology",
                             "pair", "--port", "0", "--options-json", '{"time_scale": 0.05}'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line.endswith("(topology pair)"), line + proc.stderr.read()
        url = line.split(" on ")[1].split(" ")[0]

        async def ping():
            async with aiohttp.ClientSession() as s:
                return await request(s, url, {"prompt": "ping " * 40, "max_tokens": 2})
        reply = asyncio.run(ping())
        assert reply.status == 200 and ">d0" in reply.headers["x-kvbench-replica"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_real_endpoints_topology_is_a_label():
    """An openai endpoint's topology names a design for the reports; validating it never loads
    the emulator, and "unknown" is allowed."""
    code = ("import sys, tomllib; from kvbench.config.parse import parse_config; "
            f"d = tomllib.loads(open({str(ROOT / 'bench.toml')!r}).read()); "
            "d['endpoints'] = [{'name': 'v', 'kind': 'openai', 'url': 'http://127.0.0.1:9'}, "
            "{'name': 'w', 'kind': 'openai', 'url': 'http://127.0.0.1:9', "
            "'topology': 'disaggregated'}]; "
            "print([e.topology for e in parse_config(d).endpoints], "
            "any(m.startswith('kvbench.endpoints') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "['unknown', 'disaggregated'] False", out.stderr
    with pytest.raises(UserError, match=r"'routed' or 'unknown'"):
        _cfg({"name": "v", "kind": "openai", "url": "http://127.0.0.1:9", "topology": "colo"})


def test_the_emulators_modules_import_no_circle():
    """Imports among endpoints/ (TYPE_CHECKING ones and those inside functions included)."""
    graph = {}
    for path in (ROOT / "endpoints").glob("*.py"):
        deps = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("kvbench.endpoints."):
                deps.add(n.module.rsplit(".", 1)[1])
            elif isinstance(n, ast.Import):
                deps |= {a.name.rsplit(".", 1)[1] for a in n.names
                         if a.name.startswith("kvbench.endpoints.")}
        graph[path.stem] = deps

    def reaches(a: str, b: str, seen: set) -> bool:
        return any(d == b or (d not in seen and reaches(d, b, seen | {d}))
                   for d in graph.get(a, ()))

    assert not [m for m in graph if reaches(m, m, {m})]
