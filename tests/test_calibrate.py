"""kvbench calibrate: the engine-model fit recovers known parameters, from synthetic records
made with the model's own step formula, and from a real short run of [profiles.calibrate]
against a built-in endpoint with non-default options."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
import urllib.request
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kvbench.core.schema import ENGINE, REQUESTS
from kvbench.model import profiles as pf
from kvbench.reports.analysis import calibrate as C

ROOT = Path(__file__).resolve().parents[1]
W = pf.MODELS["llama-3-70b"].weight_bytes("fp8")

TRUE = dict(prefill_tok_per_ms=31.0, frontend_us_per_prompt_token=3.0, hbm_gb_s=4000.0,
            kv_bytes_per_token=160_000, step_token_budget=3000, max_num_seqs=10,
            kv_capacity_tokens=70_000)


class Synth:
    """Records from the step model: step = max(tokens / rate, a + b * kv) + c * sequences
    (``c``: ``step_us_per_seq``, 0 unless given)."""

    def __init__(self, p: dict):
        self.rate = p["prefill_tok_per_ms"]
        self.f = p["frontend_us_per_prompt_token"] / 1e3
        self.a = W / (p["hbm_gb_s"] * 1e9) * 1e3
        self.b = p["kv_bytes_per_token"] / (p["hbm_gb_s"] * 1e9) * 1e3
        self.c = p.get("step_us_per_seq", 0.0) / 1e3
        self.k = p.get("prefill_ms_per_token2", 0.0)
        self.p = p
        self.rows: list[dict] = []
        self.keys: dict = {}
        self.t = 0.0  # ms
        self.rng = np.random.default_rng(1)

    def step(self, tokens, kv, seqs=1):
        return max(tokens / self.rate, self.a + self.b * kv) + self.c * seqs

    def add(self, start, ttft, offs, P, O, cached=0, shared=0, session=None):
        i = len(self.rows)
        self.rows.append(dict(
            run_id="r", endpoint="ep", topology="colocated", workload="w", request_class="chat",
            stage=0, request_id=f"q{i}", session_id=session or f"s{i}", turn=0, worker="h:1",
            prompt_tokens=int(P), prompt_tokens_client=int(P), shared_prefix_tokens=int(shared),
            max_tokens=int(O), completion_tokens=int(O), completion_tokens_client=int(O),
            cached_tokens=int(cached), t_scheduled=int(start * 1e6), t_sent=int(start * 1e6),
            connect_ns=0, ttft_ns=int(ttft * 1e6),
            chunk_offsets_ns=[int(x * 1e6) for x in offs], chunk_tokens=[1] * len(offs),
            e2e_ns=int(offs[-1] * 1e6), status="ok", http_status=200))

    def jitter(self):
        return float(self.rng.normal(0, 0.05))

    def alone(self, P, cached=0, shared=0, session=None, O=2):
        u, done, ttft = P - cached, cached, 1.0 + self.f * P
        while u > 0:
            c = min(u, self.p["step_token_budget"])
            ttft += self.step(c, done + c) + self.k * ((done + c) ** 2 - done ** 2)
            u -= c
            done += c
        ttft += self.jitter()
        offs = [ttft + k * self.step(1, P + k) for k in range(O)]
        self.add(self.t, ttft, offs, P, O, cached, shared, session)
        self.t += offs[-1] + 5

    def batch(self, users, P, O, waves=3, cached=0):
        """``users`` requests in lockstep waves, ``max_num_seqs`` at a time."""
        m = self.p["max_num_seqs"]
        for _ in range(waves):
            t0 = self.t
            queue_end = t0
            for g in range(0, users, m):
                n = min(m, users - g)
                ttft0 = (queue_end - t0) + 1.0 + self.f * P + self.step(n * (P - cached),
                                                                        n * P, n)
                tpot = self.a + self.b * n * (P + O / 2) + self.c * n
                for _k in range(n):
                    ttft = ttft0 + self.jitter()
                    offs = [ttft + k * tpot for k in range(O)]
                    self.add(t0, ttft, offs, P, O, cached, cached)
                queue_end = t0 + ttft0 + (O - 1) * tpot + 1
            self.t = queue_end + 5

    def mixed(self, decodes=6, P_long=12000, O=64):
        """Decodes whose steps a long prompt's chunks stretch (budget-sized chunks)."""
        t0 = self.t
        tpot = self.a + self.b * decodes * (64 + O / 2) + self.c * decodes
        full = self.p["step_token_budget"] / self.rate
        for _d in range(decodes):
            gaps = [tpot] * (O - 1)
            for k in range(5, 5 + int(P_long // self.p["step_token_budget"])):
                gaps[k] = full + self.jitter()
            offs = list(np.cumsum([20.0] + gaps))
            self.add(t0, 20.0, offs, 64, O)
        self.add(t0 + 10, 10 + P_long / self.rate, [10 + P_long / self.rate + 1], P_long, 1)
        self.t = t0 + offs[-1] + 5

    def evict(self, docs=24, L=8000, n=150):
        """One user asking documents at random: an LRU of blocks as the engine keeps it
        (a request's blocks released tail first), each document a prefix key."""
        bt, cap = 16, self.p["kv_capacity_tokens"] // 16
        lru: OrderedDict = OrderedDict()
        system = [("sys", k) for k in range(8)]
        for r in range(n):
            d = int(self.rng.integers(docs))
            prefix = system + [("doc", d, k) for k in range(L // bt)]
            hit = 0
            while hit < len(prefix) and prefix[hit] in lru:
                hit += 1
            blocks = prefix + [("tail", r, k) for k in range(3)]
            for b in blocks:
                lru.pop(b, None)
            while len(lru) + len(blocks) > cap:
                lru.popitem(last=False)
            for b in reversed(blocks):
                lru[b] = None
            self.keys[f"q{len(self.rows)}"] = d
            self.alone(len(prefix) * bt + 32, cached=hit * bt, shared=len(prefix) * bt)

    def table(self) -> pa.Table:
        cols = {f.name: [r.get(f.name) for r in self.rows] for f in REQUESTS}
        return pa.Table.from_pydict(cols, schema=REQUESTS)


def synthetic(p: dict, *, prefill=True, cached=True, decode=True, mixed=True, evict=True):
    s = Synth(p)
    if prefill:
        for P in np.linspace(1024, 12288, 16):
            s.alone(int(P))
    if cached:
        for P in np.linspace(1024, 12288, 10):
            s.alone(int(P), cached=int(P) - 32, shared=int(P) - 32)
    if decode:
        for users in (1, 4, 16, 24):
            s.batch(users, 64, 96)
        for users in (4, 12):
            s.batch(users, 2048, 96, cached=1888)
    if mixed:
        s.mixed()
    if evict:
        s.evict()
    return s.table(), s.keys


def test_fit_recovers_synthetic_parameters_within_10pct():
    recs, keys = synthetic(TRUE)
    fit = C.fit(recs, None, "ep", prefix_keys=keys)
    assert not fit.missing, fit.missing
    for name, want in TRUE.items():
        got = fit.params[name]
        assert got.status == "fit", (name, got)
        assert abs(got.value - want) <= 0.10 * want, (name, got.value, want)
        assert got.stderr >= 0


def test_per_sequence_step_term_is_fitted_where_the_records_show_one():
    """A CPU engine of a tiny model: each sequence in a step costs more host time than its KV
    reads (here 400 us against 0.1 ms of KV for 24 short decodes). The decodes of short and
    of 2K-token contexts separate the per-sequence term from the KV slope; without it the KV
    slope absorbs it and a workload of long contexts is predicted far too slow."""
    p = dict(TRUE, step_us_per_seq=400.0)
    recs, keys = synthetic(p)
    fit = C.fit(recs, None, "ep", prefix_keys=keys)
    got = fit.params["step_us_per_seq"]
    assert got.status == "fit" and abs(got.value - 400.0) <= 40.0, got
    for name in ("hbm_gb_s", "kv_bytes_per_token", "prefill_tok_per_ms"):
        assert abs(fit.params[name].value - p[name]) <= 0.10 * p[name], (name, fit.params[name])
    assert any("step_us_per_seq" in n for n in fit.notes)
    # the GPU model's records show none: the two-term fit stands, no option is added
    assert "step_us_per_seq" not in C.fit(synthetic(TRUE)[0], None, "ep").params


def test_per_sequence_step_term_slows_each_step_of_the_emulator():
    """The option the fit writes: a step of n sequences takes n x step_us_per_seq longer."""
    from kvbench.runs import virtual

    reqs = [("chat", 64, [], 32)] * 8
    base = {"replicas": 1, "kv_capacity_tokens": 100_000}
    tpot = {}
    for c in (0.0, 2000.0):
        rows = virtual.run_rate("colocated", {**base, "step_us_per_seq": c}, reqs, 200.0, 0.04,
                                seed=1)
        tpot[c] = float(np.nanmedian([r["tpot_ms"] for r in rows]))
    # 8 requests arriving in 40 ms decode together: about 8 x 2 ms more per step
    assert 10.0 <= tpot[2000.0] - tpot[0.0] <= 17.0, tpot


def test_quadratic_prefill_is_fitted_where_the_records_show_one():
    """Attention over the context: on vLLM CPU the tiny model's cold 7K-token prompt spent as
    long on it as on the rest. Fitted jointly with the rate (the linear rate alone absorbs
    part of it, and the predicted suffix of a long cached prefix costs far too little)."""
    p = dict(TRUE, prefill_ms_per_token2=4e-6)
    recs, keys = synthetic(p)
    fit = C.fit(recs, None, "ep", prefix_keys=keys)
    got = fit.params["prefill_ms_per_token2"]
    assert abs(got.value - 4e-6) <= 0.15 * 4e-6, got
    assert abs(fit.params["prefill_tok_per_ms"].value - 31.0) <= 0.1 * 31.0
    assert any("prefill_ms_per_token2" in n for n in fit.notes)
    assert "prefill_ms_per_token2" not in C.fit(synthetic(TRUE)[0], None, "ep").params


def test_quadratic_prefill_lengthens_the_emulators_prefill_by_k_u_squared():
    from kvbench.runs import virtual

    ttft = {}
    for k in (0.0, 1e-5):
        opts = {"replicas": 1, "kv_capacity_tokens": 100_000, "prefill_ms_per_token2": k}
        rows = virtual.run_rate("colocated", opts, [("chat", 6000, [], 2)], 10.0, 0.1, seed=1)
        ttft[k] = rows[0]["ttft_ms"]
    assert abs(ttft[1e-5] - ttft[0.0] - 1e-5 * 6000 ** 2) <= 2.0, ttft  # 360 ms


def test_limit_that_never_binds_is_a_bound():
    p = dict(TRUE, max_num_seqs=256)
    fit = C.fit(synthetic(p, evict=False)[0], None, "ep")
    seqs = fit.params["max_num_seqs"]
    assert seqs.status == "bound" and seqs.value >= 24  # "at least" the users it saw


def test_without_cached_prompts_the_front_end_is_folded_into_the_rate():
    fit = C.fit(synthetic(TRUE, cached=False)[0], None, "ep")
    combined = 1 / (1 / TRUE["prefill_tok_per_ms"] + TRUE["frontend_us_per_prompt_token"] / 1e3)
    assert abs(fit.params["prefill_tok_per_ms"].value - combined) <= 0.1 * combined
    assert any("not separable" in n for n in fit.notes)


def test_missing_stages_are_named():
    fit = C.fit(synthetic(TRUE, prefill=False, cached=False, evict=False, mixed=False)[0],
                None, "ep")
    text = " ".join(fit.missing)
    assert "calib_prefill" in text  # the stage that would supply the prefill rate
    assert "calib_evict" in text  # no metrics and no eviction probe: KV capacity


def _engine_table(gen_tokens: float, capacity_blocks: int = 0) -> pa.Table:
    rows = []
    lab = [("model_name", "m"), ("engine", "e0")]
    for t, v in ((0, 0.0), (10**9, gen_tokens)):
        rows.append(dict(t_ns=t, endpoint="ep", metric="vllm:generation_tokens_total",
                         labels=lab, value=v))
        rows.append(dict(t_ns=t, endpoint="ep", metric="kvbench:steps_total", labels=lab,
                         value=v))
    if capacity_blocks:
        rows.append(dict(t_ns=0, endpoint="ep", metric="vllm:cache_config_info",
                         labels=[("block_size", "16"), ("num_gpu_blocks",
                                                        str(capacity_blocks))], value=1.0))
    return pa.Table.from_pylist(rows, schema=ENGINE)


def test_metrics_capacity_and_interference():
    recs = synthetic(TRUE, evict=False)[0]
    sent = sum(recs.column("completion_tokens").to_pylist())
    fit = C.fit(recs, _engine_table(sent, 5000), "ep")
    kv = fit.params["kv_capacity_tokens"]
    assert kv.status == "metrics" and kv.value == 80_000
    assert fit.unreliable is None
    fit = C.fit(recs, _engine_table(sent * 3, 5000), "ep")
    assert fit.unreliable and "unreliable" in fit.unreliable


def test_twin_file_is_a_builtin_endpoint(tmp_path):
    from kvbench.commands.calibrate import render_twin
    from kvbench.config import parse_config
    from kvbench.endpoints.config import EmulatorConfig

    recs, keys = synthetic(TRUE)
    fit = C.fit(recs, None, "ep", prefix_keys=keys)
    text = render_twin(fit, name="ep-twin", endpoint="ep", source_run="r1",
                       base_options={"replicas": 1}, defaults=EmulatorConfig().model_dump())
    doc = tomllib.loads(text)
    tw = doc["twin"]
    # [twin] endpoint names the twin's own [[endpoints]] table; the measured one is its source
    assert tw["endpoint"] == "ep-twin" and tw["source_endpoint"] == "ep"
    assert tw["source_run"] == "r1"
    assert set(tw["fitted"]) == set(TRUE)
    for name in TRUE:
        assert {"value", "stderr", "status"} <= set(tw["fit"][name])
    ep = doc["endpoints"][0]
    assert ep["kind"] == "builtin"
    cfg = parse_config({"endpoints": doc["endpoints"], "workloads": {"chat": {"kind": "chat"}},
                        "profiles": {"p": {"stages": [{"users": 1, "duration_s": 1}]}}})
    opts = cfg.endpoints[0].options
    assert abs(opts["prefill_tok_per_ms"] - TRUE["prefill_tok_per_ms"]) <= 3.1


def test_prefixes_cached_in_large_blocks_still_separate_the_front_end():
    """vLLM CPU caches whole 128-token blocks: a re-asked prefix comes back up to 127 tokens
    short of its length. Read as a partly evicted prefix, every cached-stage request was left
    out and the front end could not be separated; the engine's block size (its cache config)
    is the tolerance."""
    s = Synth(TRUE)
    for P in np.linspace(1024, 12288, 16):
        s.alone(int(P))
    for P in np.linspace(1024, 12288, 10):
        shared = int(P) - 32
        s.alone(int(P), cached=shared // 128 * 128, shared=shared)
    for users in (1, 4, 16, 24):
        s.batch(users, 64, 96)
    for users in (4, 12):
        s.batch(users, 2048, 96, cached=1792)
    lab = [("block_size", "128"), ("num_gpu_blocks", "16384")]
    engine = pa.Table.from_pylist([dict(t_ns=0, endpoint="ep", metric="vllm:cache_config_info",
                                        labels=lab, value=1.0)], schema=ENGINE)
    fit = C.fit(s.table(), engine, "ep")
    f = fit.params["frontend_us_per_prompt_token"]
    assert not any("not separable" in n for n in fit.notes), fit.notes
    assert abs(f.value - TRUE["frontend_us_per_prompt_token"]) <= 0.15 * 3.0, f
    assert fit.params["kv_capacity_tokens"].value == 16384 * 128


def test_a_twin_of_an_openai_endpoint_is_one_engine():
    """The fit sees a real endpoint whole: its twin is one replica, not the colocated
    topology's default (two, which doubled the predicted capacity of vLLM CPU)."""
    from kvbench.commands.calibrate import base_options
    from kvbench.endpoints.config import gpu_count, validate_options

    base = base_options({"name": "vllm", "kind": "openai", "url": "http://x"})
    assert base == {"replicas": 1}
    assert gpu_count(validate_options("colocated", base))[0] == 1
    assert gpu_count(validate_options("colocated", {}))[0] == 2  # what it was without
    src = {"kind": "builtin", "options": {"replicas": 3, "hardware": "h100", "seed": 4}}
    assert base_options(src) == {"replicas": 3, "hardware": "h100"}


SHORT = """
[profiles.calibrate_short]
pacing = "closed"
cache = "warm"
drain_s = 5
stages = [
  { workload = "calib_prefill", users = 1, duration_s = 20, requests = 12 },
  { workload = "calib_cached", users = 1, duration_s = 20, requests = 8 },
  { workload = "calib_decode", users = 2, duration_s = 3 },
  { workload = "calib_decode", users = 8, duration_s = 3 },
]
"""


def test_real_calibrate_run_recovers_prefill_rate_and_kv_capacity(tmp_path):
    """The calibration stages (shortened: four of them, about 40 s on a busy 2-core host)
    against a built-in endpoint with options the fit is not told, then kvbench calibrate."""
    hidden = "prefill_tok_per_ms = 30.0, kv_capacity_tokens = 100000, max_num_seqs = 12, " \
             "step_token_budget = 3072"
    text = (ROOT / "bench.toml").read_text().replace(
        "options = { replicas = 1 }", "options = { replicas = 1, " + hidden + " }")
    text = text.replace('results_dir = "results"', f'results_dir = "{tmp_path / "results"}"')
    (tmp_path / "bench.toml").write_text(text + SHORT)
    kv = [sys.executable, "-m", "kvbench"]
    subprocess.run(kv + ["run", "--config", str(tmp_path / "bench.toml"), "--profile",
                         "calibrate_short", "--endpoint", "colocated", "--run-id", "cal"],
                   cwd=tmp_path, check=True, timeout=600, capture_output=True)
    out = subprocess.run(kv + ["calibrate", str(tmp_path / "results" / "cal"), "--endpoint",
                               "colocated", "-o", str(tmp_path / "twin.toml")],
                         cwd=tmp_path, check=True, timeout=120, capture_output=True, text=True)
    assert "prefill_tok_per_ms" in out.stdout
    # the stages this short run left out are named, with the stage that would supply them
    assert "calib_mixed" in out.stdout  # the step token budget
    tw = tomllib.loads((tmp_path / "twin.toml").read_text())["twin"]["fit"]
    # modelled quantities: the fitted rate within 10% of the hidden 30 tokens/ms (and the
    # front end's 2 us per prompt token apart from it), the capacity read from the metrics
    assert abs(tw["prefill_tok_per_ms"]["value"] - 30.0) <= 3.0
    assert tw["prefill_tok_per_ms"]["status"] == "fit"
    assert tw["kv_capacity_tokens"]["status"] == "metrics"
    assert tw["kv_capacity_tokens"]["value"] == 100000
    shutil.rmtree(tmp_path / "results", ignore_errors=True)


def _neighbour(url: str, stop: threading.Event, sent: list) -> None:
    """Someone else's traffic on the shared endpoint: 64-token answers, one after another."""
    i = 0
    while not stop.is_set():
        body = json.dumps({"model": "kvbench-llama-3-70b", "max_tokens": 64,
                           "prompt": f"another team's request {i} " * 30}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                sent.append(json.loads(resp.read())["usage"]["completion_tokens"])
        except OSError:
            return
        i += 1


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared"])
def test_calibrating_a_shared_endpoint_says_the_fit_is_unreliable(tmp_path, shared):
    """Proof 4 on the real path: the calibration stages against a running `kvbench serve`
    (an openai endpoint whose /metrics kvbench scrapes) while, in the shared case, another
    client sends its own requests to it. The engine's generation counter then exceeds what
    the run received, and `kvbench calibrate` says the fit is unreliable; alone, it does not."""
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "serve", "--topology",
                             "colocated", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stop, got = threading.Event(), []
    neighbour = None
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("kvbench serve: listening on http://"), line
        url = line.split(" on ")[1].split(" ")[0]
        text = (ROOT / "bench.toml").read_text()
        text = text.replace('results_dir = "results"',
                            f'results_dir = "{tmp_path / "results"}"')
        text += (f'\n[[endpoints]]\nname = "shared"\nkind = "openai"\nurl = "{url}"\n'
                 'model = "kvbench-llama-3-70b"\n' + SHORT)
        (tmp_path / "bench.toml").write_text(text)
        if shared:
            neighbour = threading.Thread(target=_neighbour, args=(url, stop, got), daemon=True)
            neighbour.start()
        kv = [sys.executable, "-m", "kvbench"]
        subprocess.run(kv + ["run", "--config", str(tmp_path / "bench.toml"), "--profile",
                             "calibrate_short", "--endpoint", "shared", "--run-id", "cal"],
                       cwd=tmp_path, check=True, timeout=600, capture_output=True)
    finally:
        stop.set()
        if neighbour is not None:
            neighbour.join(60)
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    out = subprocess.run(kv + ["calibrate", str(tmp_path / "results" / "cal"), "--endpoint",
                               "shared", "-o", str(tmp_path / "twin.toml")],
                         cwd=tmp_path, timeout=120, capture_output=True, text=True)
    said = out.stdout + out.stderr
    if shared:
        assert sum(got) >= 64 * 5  # the neighbour's load was served while the run went on
        assert "unreliable" in said and "did not send shared the endpoint" in said, said
    else:
        assert out.returncode == 0, said
        assert "unreliable" not in said, said


def test_calibrate_profile_stages_name_their_workloads():
    from kvbench.config import load_config, parse_config
    from kvbench.runs import matrix

    cfg = load_config(ROOT / "bench.toml")
    prof = cfg.profiles["calibrate"]
    assert prof.stage_workloads()[0] == "calib_prefill"
    sel = matrix.select(cfg, profile="calibrate", endpoints=["colocated"])
    ep = sel.endpoints[0]
    jobs = matrix.jobs(cfg, sel, [(ep, "http://127.0.0.1:1", "m", 131072)], run_id="r",
                       results_dir="/tmp")
    assert [j.workload for j in jobs] == prof.stage_workloads()  # once, in stage order
    assert [j.stage_index for j in jobs] == list(range(len(prof.stages)))
    bad = {"endpoints": [{"name": "e", "kind": "openai", "url": "http://127.0.0.1:1"}],
           "workloads": {"chat": {"kind": "chat"}},
           "profiles": {"p": {"stages": [{"users": 1, "duration_s": 1, "workload": "chat"},
                                         {"users": 1, "duration_s": 1}]}}}
    with pytest.raises(Exception, match="give every stage"):
        parse_config(bad)
    bad["profiles"]["p"]["stages"][1]["workload"] = "nope"
    with pytest.raises(Exception, match="nope"):
        parse_config(bad)
