"""Prometheus/DCGM scraping: the parser (property-tested against prometheus_client's own
renderer) and the scraper against a real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import math
import time

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvbench.collectors.prometheus import PrometheusScraper, parse_metrics
from kvbench.config import GpuRole
from kvbench.core.schema import ENGINE, GPU
from metrics_server import MetricsServer, exposition

names = st.from_regex(r"[a-z][a-z0-9_]{0,12}(:[a-z][a-z0-9_]{0,12})?", fullmatch=True)
label_names = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
label_values = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=12)
values = st.floats(allow_nan=False, allow_infinity=False, width=64)


class _Fixed:
    def __init__(self, fams):
        self.fams = fams

    def collect(self):
        return self.fams


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(names, st.tuples(st.booleans(), st.lists(
    st.tuples(st.dictionaries(label_names, label_values, max_size=3), values),
    min_size=1, max_size=4)), min_size=1, max_size=5))
def test_parse_roundtrips_prometheus_client_rendering(spec):
    fams, expected = [], []
    seen_families = set()
    for name, (counter, samples) in spec.items():
        base = name.removesuffix("_total")
        if base in seen_families:
            continue
        seen_families.add(base)
        keys = sorted({k for labels, _ in samples for k in labels})
        cls = CounterMetricFamily if counter else GaugeMetricFamily
        fam = cls(base, "help", labels=keys)
        seen = set()
        for labels, v in samples:
            lv = tuple(labels.get(k, "") for k in keys)
            if lv in seen:
                continue
            seen.add(lv)
            v = abs(v) if counter else v
            fam.add_metric(list(lv), v)
            sample = base + "_total" if counter else base
            expected.append((sample, dict(zip(keys, lv)), v))
        fams.append(fam)
    reg = CollectorRegistry()
    reg.register(_Fixed(fams))
    text = generate_latest(reg).decode()
    engine, gpu = parse_metrics(text, t_ns=123, endpoint="e")
    assert gpu is None and engine.schema == ENGINE
    got = [(m, dict(lab), v) for m, lab, v in zip(engine.column("metric").to_pylist(),
                                                  engine.column("labels").to_pylist(),
                                                  engine.column("value").to_pylist())]
    got = [(m, lab, v) for m, lab, v in got if not m.endswith("_created")]
    assert len(got) == len(expected)
    for (gm, gl, gv), (em, el, ev) in zip(sorted(got, key=repr), sorted(expected, key=repr)):
        assert (gm, gl) == (em, el)
        assert math.isclose(gv, ev, rel_tol=1e-12, abs_tol=0)
    assert set(engine.column("t_ns").to_pylist()) == {123}


def test_dcgm_series_become_gpu_rows():
    roles = [GpuRole(host="node-b", gpus=[3], role="cache")]
    text = exposition(2) + ('DCGM_FI_DEV_GPU_UTIL{gpu="3",Hostname="node-b"} 9\n'
                            'DCGM_FI_DEV_FB_TOTAL{gpu="3",Hostname="node-b"} 81559\n'
                            'DCGM_FI_DEV_FB_USED{gpu="3",Hostname="node-b"} 100\n')
    engine, gpu = parse_metrics(text, t_ns=5, endpoint="ep", roles=roles)
    rows = {(r["host"], r["gpu"]): r for r in gpu.to_pylist()}
    assert set(rows) == {("node-a", 0), ("node-a", 1), ("node-b", 3)}
    a0 = rows[("node-a", 0)]
    assert (a0["role"], a0["source"], a0["endpoint"], a0["t_ns"]) == ("prefill", "dcgm", "ep", 5)
    assert a0["gpu_util_pct"] == 40 and a0["sm_active"] == 0.5 and a0["sm_occupancy"] == 0.25
    assert a0["dram_active"] == 0.75 and a0["power_w"] == 412.5 and a0["sm_clock_mhz"] == 1755
    assert a0["hbm_used_bytes"] == 1000 * 2**20 and a0["hbm_total_bytes"] == 4000 * 2**20
    assert a0["pcie_rx_bytes_s"] == 1.5e9 and a0["temperature_c"] == 55
    assert rows[("node-a", 1)]["role"] == "decode"
    b3 = rows[("node-b", 3)]
    assert b3["role"] == "cache" and b3["hbm_total_bytes"] == 81559 * 2**20
    assert b3["sm_active"] is None
    # every sample is also kept raw in the engine table
    assert "DCGM_FI_DEV_GPU_UTIL" in engine.column("metric").to_pylist()


def test_scraper_against_server_counts_failures_and_keeps_going():
    engine, gpus, logs = [], [], []
    with MetricsServer() as srv:
        good = PrometheusScraper("ep", srv.url + "/metrics", interval_s=0.05,
                                 engine_emit=engine.append, gpu_emit=gpus.append, log=logs.append)
        bad = PrometheusScraper("bad", srv.url + "/broken", interval_s=0.05,
                                engine_emit=engine.append, log=logs.append)
        junk = PrometheusScraper("junk", srv.url + "/garbage", interval_s=0.05,
                                 engine_emit=engine.append, log=logs.append)
        t0 = time.time_ns()
        for s in (good, bad, junk):
            s.start()
        time.sleep(0.4)
        for s in (good, bad, junk):
            s.stop()
        t1 = time.time_ns()
    t = pa.Table.from_batches(engine, schema=ENGINE)
    assert good.failures == 0 and good.scrapes >= 4
    assert set(t.column("endpoint").to_pylist()) == {"ep"}
    ts = t.column("t_ns").to_pylist()
    assert t0 <= min(ts) and max(ts) <= t1
    hits = [(tn, v) for tn, m, v in zip(ts, t.column("metric").to_pylist(),
                                         t.column("value").to_pylist())
            if m == "vllm:prefix_cache_hits_total"]
    assert len(hits) == good.scrapes  # one per scrape, raw and growing
    assert [v for _, v in sorted(hits)] == sorted(v for _, v in hits)
    g = pa.Table.from_batches(gpus, schema=GPU)
    assert g.num_rows == 2 * good.scrapes and set(g.column("source").to_pylist()) == {"dcgm"}
    assert good.telemetry() == {"engine:ep": "ok", "engine_family:ep": "vllm", "dcgm:ep": "ok"}
    assert bad.failures == bad.scrapes >= 4 and "500" in bad.last_error
    assert junk.failures == junk.scrapes and junk.last_error.startswith("ValueError")
    assert bad.telemetry()["engine:bad"].startswith("no successful scrape of")
    assert "engine_family:bad" not in bad.telemetry()  # nothing scraped, nothing to tell
    assert bad.incomplete()[0].why.startswith(f"{bad.failures} of {bad.scrapes}")
    assert len([m for m in logs if "bad" in m]) == 1  # one message, not one per scrape


def test_configured_engine_family_wins_over_detection():
    with MetricsServer() as srv:
        auto = PrometheusScraper("a", srv.url + "/metrics", engine_emit=lambda b: None,
                                 engine="auto")
        told = PrometheusScraper("t", srv.url + "/metrics", engine_emit=lambda b: None,
                                 engine="sglang")
        assert auto.scrape_once() and told.scrape_once()
    assert auto.telemetry()["engine_family:a"] == "vllm"  # most of the page's names
    assert told.telemetry()["engine_family:t"] == "sglang"


def test_scraper_unreachable_endpoint_times_out_quickly():
    s = PrometheusScraper("gone", "http://127.0.0.1:9/metrics", interval_s=0.05,
                          engine_emit=lambda b: None, log=lambda m: None)
    t0 = time.monotonic()
    assert s.scrape_once() is False
    assert time.monotonic() - t0 < 2 and s.failures == 1
