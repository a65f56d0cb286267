"""A twin's prediction beside the run's measurement in the report: ``kvbench predict --save
RUN_DIR`` writes prediction.json into the run folder; ``kvbench report`` then shows, per
endpoint, the predicted capacity at SLO beside the capacity search's with its error, and
predicted TTFT/TPOT p99 beside the stage of the nearest rate, every predicted figure labelled
so; the diagnosis names the parameter that explains a gap beyond 15%.

The run is a real small capacity search's records (tests/synthetic.py, as the verdict's tests
build theirs); the expected errors are computed here from the records with numpy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser import browser_or_skip, offline_page  # noqa: E402
from kvbench.cli import main  # noqa: E402
from kvbench.reports.analysis.capacity import summarise  # noqa: E402
from kvbench.reports.analysis.diagnose import diagnose  # noqa: E402
from kvbench.reports.analysis.diagnose import twin as T  # noqa: E402
from kvbench.reports.measures.data import load  # noqa: E402
from kvbench.reports.rendering.context import build_context  # noqa: E402
from kvbench.reports.rendering.render import render  # noqa: E402
from kvbench_cli import tiny_chat_config  # noqa: E402
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run  # noqa: E402

EP, WL = "tiny", "chat"
PROBES = [(1.0, "pass", 1.0), (2.0, "pass", 1.0), (3.0, "pass", 1.5), (4.0, "fail", 20.0)]


def search_run(run_dir: Path, probes=PROBES) -> Path:
    """One endpoint's capacity search on the chat workload: each probe's requests at its own
    latency scale, with the search notes run.json carries."""
    tables, stages = [], []
    for index, (rate, verdict, slow) in enumerate(probes):
        shape = RunShape(endpoints=[EndpointShape(EP, "colocated", slowdown=slow)],
                         stage_rates_rps=(rate,), requests_per_stage=300, workload=WL,
                         classes=("chat",), seed=11 + index)
        t, st = synth_table(shape, run_id="twin-run")
        t = t.set_column(t.schema.get_field_index("stage"), "stage",
                         pa.array(np.full(t.num_rows, index, np.int32)))
        t = t.set_column(t.schema.get_field_index("request_id"), "request_id",
                         pa.array([f"{index}-{i}" for i in range(t.num_rows)], pa.string()))
        tables.append(t)
        stages.append({**st[0], "index": index, "profile": "search",
                       "search": {"role": "ramp", "verdict": verdict, "target": 0.95,
                                  "confidence": 0.95}})
    shape = RunShape(endpoints=[EndpointShape(EP, "colocated")], workload=WL)
    return write_run(run_dir, pa.concat_tables(tables), run_meta(shape, stages, "twin-run"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return search_run(tmp_path_factory.mktemp("results") / "twin-run")


def measured(run: Path, stage: int) -> dict:
    """TTFT/TPOT p50/p99 (ms) of one stage's chat requests, numpy's linear percentile."""
    f = load([run]).frame
    sub = f[(f["stage"].astype(int) == stage) & (f["request_class"].astype(str) == "chat")]
    out = {}
    for m, col in (("ttft", "ttft_ms"), ("tpot", "tpot_ms")):
        v = sub[col].to_numpy(np.float64)
        v = v[~np.isnan(v)]
        out[f"{m}_p50"] = float(np.percentile(v, 50))
        out[f"{m}_p99"] = float(np.percentile(v, 99))
    return out


def measured_capacity(run: Path) -> float:
    d = load([run])
    (c,) = summarise(d.stages, d.frame, d.slo)
    return c.estimate_rps


def save(run: Path, capacity: float, points: list[tuple[float, float, dict]],
         slo: dict | None = None) -> None:
    """A prediction as ``kvbench predict --save`` writes it: ``points`` (load, rate, chat's
    figures in ms)."""
    pred = {"prediction": True, "config": "twin.toml", "workload": WL, "seeds": [1],
            **({"slo": slo} if slo is not None else {}),
            "seconds": 120.0, "warmup_s": 20.0, "twin": {"path": "twin.toml",
                                                         "source_run": "cal-1"},
            "endpoints": [{
                "endpoint": "tiny-twin", "measured_endpoint": EP, "topology": "colocated",
                "what_if": False, "gpus": 1,
                "capacity": {"median": capacity, "median_per_gpu": capacity},
                "latency": [{"load": load_, "rate": rate,
                             "classes": {"chat": {k if k == "hit_ratio" else f"{k}_ms": v
                                                  for k, v in x.items()}}}
                            for load_, rate, x in points],
                "fitted": [{"option": "prefill_tok_per_ms", "value": 40.0, "stderr": 0.5,
                            "status": "fit"}],
                "assumed": [{"option": "hbm_gb_s", "value": None, "source": "default",
                             "unobserved": False},
                            {"option": "rdma_gb_s", "value": 50.0, "source": "--options",
                             "unobserved": True}]}]}
    (run / T.PREDICTION_FILE).write_text(json.dumps({"kind": T.KIND, "predictions": [pred]}))


def scaled(x: dict, **factor) -> dict:
    return {k: v * factor.get(k.split("_")[0], 1.0) for k, v in x.items()}


def test_the_section_sets_prediction_beside_measurement_with_its_errors(run_dir, tmp_path):
    run = search_run(tmp_path / "twin-run")
    cap = measured_capacity(run)
    low, at = measured(run, 0), measured(run, 2)  # 1.0 and 3.0 req/s
    # predicted at 1.1 req/s (nearest measured: 1.0) and 2.8 (nearest: 3.0)
    save(run, 1.2 * cap, [(0.5, 1.1, scaled(low, ttft=1.5)), (1.0, 2.8, scaled(at, tpot=0.8))])
    ctx = build_context(load([run]), figures=False)
    (p,) = ctx["prediction"]
    assert p["endpoint"] == EP and p["twin_endpoint"] == "tiny-twin" and p["workload"] == WL
    assert p["err_capacity"] == "+20.0%" and abs(p["err_capacity_value"] - 0.2) < 1e-9
    first, second = p["rows"]
    assert first["measured_at"].startswith("1.00 req/s (probe 1,")
    assert second["measured_at"].startswith("3.00 req/s (probe 3,")
    assert first["err_ttft_p99"] == "+50.0%" and first["err_tpot_p99"] == "+0.0%"
    assert second["err_ttft_p99"] == "+0.0%" and second["err_tpot_p99"] == "-20.0%"
    assert "hbm_gb_s=derived (default)" in p["assumed"]
    assert "rdma_gb_s=50.0 (--options; not observable" in p["assumed"]
    assert p["fitted"] == "prefill_tok_per_ms=40.0"
    md = render([run], "md", history=0)
    section = md.split("### Prediction beside measurement", 1)[1].split("\n### ", 1)[0]
    assert "| capacity at SLO (req/s) |" in section and "(predicted)" in section
    assert "+20.0%" in section and "+50.0%" in section and "-20.0%" in section
    assert "Assumed (not fitted): hbm\\_gb\\_s=derived (default)" in section


def test_no_prediction_no_section(run_dir):
    ctx = build_context(load([run_dir]), figures=False)
    assert ctx["prediction"] == []
    assert "Prediction beside measurement" not in render([run_dir], "md", history=0)
    assert not [x for x in diagnose(load([run_dir])) if x.rule == "twin_gap"]


@pytest.mark.parametrize("factors,capacity,parameter,option", [
    ({"ttft": 0.5}, 1.0, "prefill", "prefill_tok_per_ms"),  # TTFT only, at low load
    ({"tpot": 1.6}, 1.0, "decode", "hbm_gb_s"),
    ({}, 1.5, "scheduler", "max_num_seqs"),  # same low-load latency, capacity apart
    ({}, 1.05, None, None),  # within 15% everywhere: no finding
])
def test_the_finding_names_the_parameter_that_explains_the_gap(tmp_path, factors, capacity,
                                                                parameter, option):
    run = search_run(tmp_path / "twin-run")
    cap = measured_capacity(run)
    save(run, capacity * cap, [(0.5, 1.0, scaled(measured(run, 0), **factors)),
                               (1.0, 3.0, measured(run, 2))])
    d = load([run])
    found = [x for x in diagnose(d) if x.rule == "twin_gap"]
    if parameter is None:
        assert found == []
        return
    (x,) = found
    assert x.endpoint == EP and x.numbers["parameter"] == parameter
    assert option in x.numbers["options"] and option in x.cause
    md = render([run], "md", history=0)
    assert "twin\\_gap" in md or "(twin_gap)" in md
    assert T.PARAMETERS[parameter][0] in md.split("### Diagnosis", 1)[1]


def test_a_prediction_under_other_slos_says_so_and_blames_no_scheduler(tmp_path):
    run = search_run(tmp_path / "twin-run")
    judged = {c: s.limits() for c, s in load([run]).slo.items() if s.judged}
    assert judged  # the synthetic run's SLOs
    pts = [(0.5, 1.0, measured(run, 0)), (1.0, 3.0, measured(run, 2))]
    save(run, 1.5 * measured_capacity(run), pts, slo=judged)
    (p,) = build_context(load([run]), figures=False)["prediction"]
    assert p["slo_differs"] == ""
    assert [x.numbers["parameter"] for x in diagnose(load([run]))
            if x.rule == "twin_gap"] == ["scheduler"]
    other = {c: {**x, "ttft_ms": 2 * x.get("ttft_ms", 1000.0)} for c, x in judged.items()}
    save(run, 1.5 * measured_capacity(run), pts, slo=other)
    (p,) = build_context(load([run]), figures=False)["prediction"]
    assert p["slo_differs"] == ", ".join(sorted(judged))
    assert "Not the same question" in render([run], "md", history=0)
    assert not [x for x in diagnose(load([run])) if x.rule == "twin_gap"]


@pytest.mark.parametrize("factor,finding", [(0.5, True), (1.5, False)])
def test_a_search_that_found_no_failure_is_a_lower_bound(tmp_path, factor, finding):
    run = search_run(tmp_path / "twin-run", PROBES[:3])  # every probe passed
    cap = measured_capacity(run)
    save(run, factor * cap, [(0.5, 1.0, measured(run, 0)), (1.0, 3.0, measured(run, 2))])
    (p,) = build_context(load([run]), figures=False)["prediction"]
    assert "a lower bound" in p["meas_capacity"] and p["err_capacity"].startswith("≤ ")
    found = [x for x in diagnose(load([run])) if x.rule == "twin_gap"]
    # below the bound by half: a gap however high the capacity is; above it: none shown
    assert [x.numbers["parameter"] for x in found] == (["scheduler"] if finding else [])


@pytest.mark.parametrize("factor,finding", [(1.5, True), (0.5, False)])
def test_a_search_that_passed_nothing_bounds_the_capacity_from_above(tmp_path, factor,
                                                                     finding):
    run = search_run(tmp_path / "twin-run", [(1.0, "fail", 20.0), (2.0, "fail", 20.0)])
    # predicted latencies as measured: the capacity alone differs
    save(run, factor * 1.0, [(0.5, 1.0, measured(run, 0)), (1.0, 2.0, measured(run, 1))])
    (p,) = build_context(load([run]), figures=False)["prediction"]
    assert p["meas_capacity"] == "< 1.00 (the search passed no rate)"
    assert p["err_capacity"] == f"≥ {100 * (factor - 1):+.1f}%"
    found = [x for x in diagnose(load([run])) if x.rule == "twin_gap"]
    assert [x.numbers["parameter"] for x in found] == (["scheduler"] if finding else [])


def test_a_measured_hit_ratio_below_the_predicted_names_kv_capacity(tmp_path):
    run = search_run(tmp_path / "twin-run")
    low = {**measured(run, 0), "hit_ratio": 0.99}  # synthetic runs hit about half
    save(run, measured_capacity(run), [(0.5, 1.0, low)])
    (x,) = [x for x in diagnose(load([run])) if x.rule == "twin_gap"]
    assert x.numbers["parameter"] == "kv_capacity" and "kv_capacity_tokens" in x.cause


def test_predict_save_writes_the_prediction_the_report_reads(tmp_path, capsys):
    run = search_run(tmp_path / "twin-run")
    cfg = tmp_path / "twin.toml"
    cfg.write_text(tiny_chat_config(EP, 4, "[profiles.p]\npacing = \"poisson\"\n"
                                    "stages = [{ rate_rps = 1.0, duration_s = 1 }]\n", 100.0)
                   .replace("@RESULTS@", str(tmp_path / "results"))
                   + '\n[twin]\nendpoint = "tiny"\nfitted = ["max_num_seqs"]\n'
                     'source_run = "cal-1"\n[twin.fit.max_num_seqs]\nvalue = 4\n')
    assert main(["predict", "--config", str(cfg), "--save", str(run), "--seconds", "10",
                 "--warmup-s", "2", "--guess", "20", "--precision", "0.2",
                 "--loads", "0.5,1"]) == 0
    assert "saved to" in capsys.readouterr().err
    data = json.loads((run / T.PREDICTION_FILE).read_text())
    (pred,) = data["predictions"]
    (e,) = pred["endpoints"]
    assert pred["workload"] == WL and pred["seeds"] == [1] and pred["seconds"] == 10.0
    assert pred["twin"]["path"] == str(cfg) and pred["twin"]["source_run"] == "cal-1"
    assert e["measured_endpoint"] == EP and e["capacity"]["median"] > 0
    assert [p["load"] for p in e["latency"]] == [0.5, 1.0]
    assert [f["option"] for f in e["fitted"]] == ["max_num_seqs"]
    assert any(a["option"] == "prefill_tok_per_ms" for a in e["assumed"])
    # saving again replaces the prediction of the same workload and endpoint
    assert main(["predict", "--config", str(cfg), "--save", str(run), "--seconds", "10",
                 "--warmup-s", "2", "--guess", "20", "--precision", "0.2",
                 "--loads", "1"]) == 0
    assert len(json.loads((run / T.PREDICTION_FILE).read_text())["predictions"]) == 1
    (p,) = build_context(load([run]), figures=False)["prediction"]
    want = e["capacity"]["median"] / measured_capacity(run) - 1
    assert p["err_capacity"] == f"{100 * want:+.1f}%"


def test_predict_save_into_a_folder_without_a_run_is_one_sentence(tmp_path, capsys):
    cfg = tmp_path / "twin.toml"
    cfg.write_text(tiny_chat_config(EP, 4, "[profiles.p]\npacing = \"poisson\"\n"
                                    "stages = [{ rate_rps = 1.0, duration_s = 1 }]\n", 100.0)
                   .replace("@RESULTS@", str(tmp_path / "results")))
    assert main(["predict", "--config", str(cfg), "--save", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--save" in err and "not a run folder" in err and "Traceback" not in err


def test_predict_save_of_an_endpoint_the_run_lacks_is_one_sentence(tmp_path, capsys):
    run = tmp_path / "search"
    run.mkdir()
    (run / "run.json").write_bytes((ROOT / "tests/data/runs/search/run.json").read_bytes())
    cfg = tmp_path / "twin.toml"
    cfg.write_text(tiny_chat_config(EP, 4, "[profiles.p]\npacing = \"poisson\"\n"
                                    "stages = [{ rate_rps = 1.0, duration_s = 1 }]\n", 100.0)
                   .replace("@RESULTS@", str(tmp_path / "results")))
    assert main(["predict", "--config", str(cfg), "--save", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'tiny'" in err and "source_endpoint" in err
    assert not (run / T.PREDICTION_FILE).exists()


def test_the_section_in_headless_chromium(run_dir, tmp_path):
    sync_api = browser_or_skip()
    run = search_run(tmp_path / "twin-run")
    cap = measured_capacity(run)
    save(run, 1.2 * cap, [(0.5, 1.0, scaled(measured(run, 0), ttft=1.5))])
    page_path = tmp_path / "report.html"
    page_path.write_text(render([run], "html", history=0))
    errors, requests = [], []
    with offline_page(sync_api, page_path, errors, requests) as page:
        sec = page.locator("section#prediction")
        assert sec.is_visible()
        text = sec.inner_text()
        assert "Prediction beside measurement" in text and "+20.0%" in text
        assert "predicted" in text and "Assumed (not fitted)" in text
        finding = page.locator('#diagnosis .finding[data-rule="twin_gap"]')
        assert finding.count() == 1 and "prefill" in finding.inner_text()
    assert errors == [] and all(u.startswith("file:") for u in requests)
