"""The report's verdict: per workload, endpoints ranked by capacity at SLO, first on the page
(HTML and Markdown saying the same sentences), and every figure of a searched endpoint x
workload describing one load (its capacity probes), with one $ per million output tokens."""

from __future__ import annotations

import html as html_lib
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from browser import browser_or_skip, offline_page
from kvbench.cli import main
from kvbench.reports.measures.data import load
from kvbench.reports.rendering.capacity_section import ranked, sentence
from kvbench.reports.rendering.context import build_context
from kvbench.reports.statistics import metrics as M
from synthetic import EndpointShape, RunShape, run_meta, synth_table, write_run

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "runs"

# (endpoint, topology, GPUs): per workload, its probes as (rate, verdict, slowdown); the
# slowdown sets the latencies each probe measured (20x misses every SLO)
ENDPOINTS = [("colocated", "colocated", 1), ("disaggregated", "disaggregated", 2),
             ("offloaded", "offloaded", 1)]
PROBES = {
    "mix": {"colocated": [(2.0, "pass", 1.0), (4.0, "pass", 3.0), (8.0, "fail", 20.0)],
            "disaggregated": [(2.0, "pass", 1.0), (4.0, "fail", 20.0)],
            "offloaded": [(4.0, "pass", 1.0), (16.0, "pass", 1.5), (32.0, "fail", 20.0)]},
    "longdoc": {"colocated": [(2.5, "pass", 1.0), (3.0, "fail", 20.0)],
                "disaggregated": [(4.0, "pass", 1.0), (8.0, "pass", 1.2),
                                  (16.0, "fail", 20.0)],
                "offloaded": [(2.0, "pass", 1.0), (3.0, "fail", 20.0)]},
}


def search_run(run_dir: Path, probes=PROBES, requests: int = 320) -> Path:
    """A run of capacity searches on two workloads: each probe's requests synthetic, at its
    own latency scale, with the search notes run.json carries."""
    tables, stages = [], []
    for ep, topo, gpus in ENDPOINTS:
        index = 0
        for wl, by_ep in probes.items():
            for rate, verdict, slow in by_ep[ep]:
                shape = RunShape(endpoints=[EndpointShape(ep, topo, gpus=gpus,
                                                          gpu_hour_cost=2.0, slowdown=slow)],
                                 stage_rates_rps=(rate,), requests_per_stage=requests,
                                 workload=wl, seed=index + 7 * len(stages))
                t, st = synth_table(shape, run_id="search-2wl")
                t = t.set_column(t.schema.get_field_index("stage"), "stage",
                                 pa.array(np.full(t.num_rows, index, np.int32)))
                ids = [f"{ep}-{wl}-{index}-{i}" for i in range(t.num_rows)]
                t = t.set_column(t.schema.get_field_index("request_id"), "request_id",
                                 pa.array(ids, pa.string()))
                tables.append(t)
                stages.append({**st[0], "index": index, "profile": "search",
                               "search": {"role": "ramp", "verdict": verdict,
                                          "target": 0.95, "confidence": 0.95}})
                index += 1
    shape = RunShape(endpoints=[EndpointShape(ep, topo, gpus=gpus, gpu_hour_cost=2.0)
                                for ep, topo, gpus in ENDPOINTS])
    return write_run(run_dir, pa.concat_tables(tables),
                     run_meta(shape, stages, run_id="search-2wl"))


@pytest.fixture(scope="module")
def two_workloads(tmp_path_factory):
    return search_run(tmp_path_factory.mktemp("results") / "search-2wl")


@pytest.fixture(scope="module")
def ctx(two_workloads):
    return build_context(load([two_workloads]), figures=False)


def md_unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def html_sentences(html: str) -> dict[str, str]:
    return {html_lib.unescape(w): html_lib.unescape(s) for w, s in re.findall(
        r'<p class="sentence" data-workload="([^"]*)">([^<]*)</p>', html)}


def md_sentences(md: str) -> list[str]:
    head = md.split("### Verdict: capacity at SLO", 1)[1].split("\n### ", 1)[0]
    return [md_unescape(m) for m in re.findall(r"^\*\*(.+)\*\*$", head, re.M)]


def test_verdict_ranks_each_workload_by_capacity_per_gpu(ctx):
    v = {g["workload"]: g for g in ctx["verdict"]}
    assert sorted(v) == ["longdoc", "mix"]
    # mix: offloaded passed 16/GPU, colocated 4, disaggregated 2 on 2 GPUs = 1/GPU
    assert [r["endpoint"] for r in v["mix"]["ranking"]] == [
        "offloaded", "colocated", "disaggregated"]
    # longdoc: disaggregated passed 8 req/s on 2 GPUs (4/GPU) above colocated's fail at 4
    assert [r["endpoint"] for r in v["longdoc"]["ranking"]] == [
        "disaggregated", "colocated", "offloaded"]
    top = v["longdoc"]["ranking"][0]
    assert top["apart_next"] == "yes" and top["caveats"] == []
    s = v["longdoc"]["sentence"]
    assert s.startswith("longdoc: disaggregated serves ") and "per GPU at SLO" in s
    assert "x colocated; shown apart." in s
    assert v["mix"]["ranking"][0]["breaks_short"].endswith("at 32.00 req/s")
    assert "on TTFT" in v["mix"]["ranking"][0]["breaks_short"]


def test_a_weak_figure_is_never_shown_apart_and_says_what_it_would_take():
    """Brackets that are separated still are not "shown apart" when the evidence is weak:
    the upper one's pass thin, decided on its estimate or not held, or the lower one's
    failure decided on its estimate; a weakness of the other ends (the lower one passing
    thinly, the upper one a lower bound) says nothing of the order. A search without hold
    data (held None) is not held against it."""
    END = {"thin": "pass", "decided on its estimate": "pass", "not held": "pass",
           "failure decided on its estimate": "fail", "a lower bound": "fail"}

    def row(ep, passed, fail, caveats=(), held=None):
        return {"endpoint": ep, "workload": "mix", "capacity": passed, "passed": passed,
                "fail": fail, "per_gpu": passed, "held": held,
                "caveats": [{"why": w, "end": END[w], "text": f"{w}: more"} for w in caveats]}

    assert [r["apart"] for r in ranked([row("a", 10, 12), row("b", 4, 5)], "per_gpu")] == [
        None, "yes"]
    for why in ("thin", "decided on its estimate", "not held"):
        got = ranked([row("a", 10, 12, [why]), row("b", 4, 5)], "per_gpu")
        assert got[1]["apart"] == f"no: a's figure is {why}"
        got = ranked([row("a", 10, 12), row("b", 4, 5, [why])], "per_gpu")
        assert got[1]["apart"] == "yes"
    got = ranked([row("a", 10, 12), row("b", 4, 5, ["failure decided on its estimate"])],
                 "per_gpu")
    assert got[1]["apart"] == "no: b's failure decided on its estimate"
    got = ranked([row("a", 10, None, ["a lower bound"]), row("b", 4, 5)], "per_gpu")
    assert got[1]["apart"] == "yes"
    got = ranked([row("a", 4.5, 6), row("b", 4, 5)], "per_gpu")
    assert got[1]["apart"] == "no: b's bracket overlaps a's"
    gpu = ranked([row("a", 10, 12, ["thin"]), row("b", 4, 5)], "per_gpu")
    assert sentence("mix", "req/s", gpu, [], []).endswith(
        "; not shown apart from b: a's figure is thin.")


def test_caveats_read_the_capacity():
    from kvbench.reports.analysis.capacity import Capacity
    from kvbench.reports.rendering.capacity_section import caveats

    base = dict(endpoint="e", workload="mix", status="bracketed", probes=3, load_s=30.0,
                breaks=None, low_rps=4.0, high_rps=8.0, estimate_rps=5.0)
    thin = {"thin": "longctx 5/5 (46 needed each to show 95% at 95% confidence)",
            "estimate": False}
    got = caveats(Capacity(capacity_rps=4.0, fail_rps=8.0, at_capacity=thin, **base))
    assert [c["why"] for c in got] == ["thin"]
    assert "46 of each needed" in got[0]["text"] and "longctx 5/5" in got[0]["text"]
    plain = {"thin": "", "estimate": True}
    got = caveats(Capacity(capacity_rps=4.0, fail_rps=None, at_capacity=plain,
                           held=False, **{**base, "high_rps": None}))
    assert [c["why"] for c in got] == ["decided on its estimate", "a lower bound", "not held"]
    assert caveats(Capacity(capacity_rps=4.0, fail_rps=8.0, at_capacity={"thin": ""},
                            held=None, **base)) == []


def test_searched_summary_is_computed_from_the_capacity_probes_only(ctx):
    """colocated x mix passed 2 and 4 req/s (latencies 3x apart) and failed 8: its summary
    column is the 4 req/s probe's alone, not the pool of the three."""
    t = next(s for s in ctx["summaries"] if s["key"] == "capacity-mix-req/s")
    col = t["columns"].index("colocated")
    rows = {r["label"]: r["cells"][col] for r in t["rows"]}
    assert rows["measured at"].text.startswith("4.00 req/s, the highest that passed")
    assert not any(s["key"] == "stages" for s in ctx["summaries"])  # nothing left to pool


def test_summary_row_equals_the_capacity_rate_probe(two_workloads, ctx):
    d = load([two_workloads])
    f = d.frame
    sel = ((f["endpoint"].astype(str) == "colocated") & (f["workload"].astype(str) == "mix"))
    at_cap = f[sel & (f["stage"] == 1)]
    pooled = f[sel]
    want = M.evaluate(at_cap, ("ttft_p50", "ttft_p99", "ttft_mean", "throughput_rps"))
    other = M.evaluate(pooled, ("ttft_p99", "ttft_mean"))
    for m in ("ttft_p99", "ttft_mean"):  # the pool of the three rates is another figure
        assert abs(other[m] - want[m]) > 0.2 * want[m]
    t = next(s for s in ctx["summaries"] if s["key"] == "capacity-mix-req/s")
    col = t["columns"].index("colocated")
    rows = {r["label"]: r["cells"][col] for r in t["rows"]}
    assert rows["TTFT p50"].value == pytest.approx(want["ttft_p50"])
    assert rows["TTFT p99"].value == pytest.approx(want["ttft_p99"])
    assert rows["TTFT mean"].value == pytest.approx(want["ttft_mean"])
    assert rows["achieved throughput"].value == pytest.approx(want["throughput_rps"])
    assert rows["requests"].value == len(at_cap)


def test_one_cost_per_million_tokens_per_endpoint_and_workload(ctx):
    """$ per M output tokens of each searched endpoint x workload: the capacity table's,
    the verdict's and the summary's are one figure (``per_gpu_and_cost``)."""
    for g in ctx["verdict"]:
        t = next(s for s in ctx["summaries"] if s["key"] == f"capacity-{g['workload']}-req/s")
        cost = next(r for r in t["rows"] if r["label"].startswith("cost per million"))
        for r in g["ranking"]:
            table = next(c for c in ctx["capacity"]["rows"]
                         if (c["endpoint"], c["workload"]) == (r["endpoint"], g["workload"]))
            summary = cost["cells"][t["columns"].index(r["endpoint"])].text
            assert r["usd_per_mtok"] == table["usd_per_mtok"] == summary != "–"


def test_one_cost_figure_in_the_html_of_the_committed_search(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(DATA / "search"), "-o", str(out)]) == 0
    page = out.read_text()
    d = load([DATA / "search"])
    ctx = build_context(d, figures=False)
    for r in ctx["capacity"]["rows"]:
        if r["usd_per_mtok"] == "–":
            continue
        # the pooled figure of every probe (1.16 for offloaded before) is nowhere
        from kvbench.reports.analysis import pareto as P
        f = d.frame
        pooled = P.endpoint_figures(f[f["endpoint"].astype(str) == r["endpoint"]],
                                    d.endpoint(r["endpoint"]))["cost_per_m"]
        assert r["usd_per_mtok"] in page
        summary = re.search(r"cost per million output tokens at capacity at SLO.*?</tr>",
                            page, re.S).group(0)
        assert r["usd_per_mtok"] in summary
        assert f"{pooled:.2f}" not in summary


def test_markdown_verdict_is_the_html_verdict(two_workloads, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(two_workloads), "-o", str(out)]) == 0
    html = html_sentences(out.read_text())
    assert main(["report", str(two_workloads), "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.index("### Verdict") < md.index("### Capacity at SLO") < md.index("### Summary")
    assert md_sentences(md) == list(html.values())
    assert sorted(html) == ["longdoc", "mix"]
    for w, s in html.items():
        assert s.startswith(f"{w}: ")
    # the rankings and the capacity table are in the Markdown too
    for ep, _, _ in ENDPOINTS:
        assert re.search(rf"^\| 1 \| {ep} \|", md, re.M) or ep in md
    assert "| rank | endpoint | per GPU (req/s) |" in md


def test_markdown_verdict_of_the_committed_search(tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(DATA / "search"), "-o", str(out)]) == 0
    html = html_sentences(out.read_text())
    assert main(["report", str(DATA / "search"), "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md_sentences(md) == list(html.values()) and list(html) == ["mix"]


def test_a_run_without_a_search_says_so_in_one_line(tmp_path, capsys):
    shape = RunShape(endpoints=[EndpointShape("a"), EndpointShape("b")],
                     stage_rates_rps=(2.0, 4.0), requests_per_stage=60)
    t, st = synth_table(shape, run_id="ladder")
    d = write_run(tmp_path / "ladder", t, run_meta(shape, st, run_id="ladder"))
    assert main(["report", str(d), "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert "No capacity search in these runs" in md and "### Verdict" not in md
    assert "**Goodput ranking, mix:** 1." in md


@pytest.mark.parametrize("which", ["default bake-off", "two workloads"])
def test_first_screen_shows_the_ranking(which, two_workloads, tmp_path):
    """At 1400x1000 the verdict is the first section and its rankings of every workload are
    on the first screen, without scrolling: the committed default bake-off's search, and a
    search of two workloads."""
    sync_api = browser_or_skip()
    run = DATA / "search" if which == "default bake-off" else two_workloads
    groups = build_context(load([run]), figures=False)["verdict"]
    out = tmp_path / "report.html"
    assert main(["report", str(run), "-o", str(out)]) == 0
    errors, requests = [], []
    with offline_page(sync_api, out, errors, requests) as page:
        first = page.evaluate("document.querySelector('main section').id")
        assert first == "verdict"
        nav = page.evaluate("Array.from(document.querySelectorAll('nav a'))"
                            ".map(a => [a.textContent, a.getAttribute('href')])")
        assert nav[:2] == [["Verdict", "#verdict"], ["Capacity at SLO", "#capacity"]]
        seen = page.evaluate("""Array.from(document.querySelectorAll(
            '#verdict p.sentence, #verdict table.ranking tr')).map(e => {
              const r = e.getBoundingClientRect();
              return [e.textContent.trim().slice(0, 40), r.top >= 0 && r.bottom <= 1000,
                      r.height > 0];
            })""")
        # each workload's sentence, and its table's header and rows
        assert len(seen) == sum(2 + len(g["ranking"]) for g in groups) >= 4
        assert all(inside and tall for _, inside, tall in seen), seen
        art = ROOT / "test-artifacts"
        art.mkdir(exist_ok=True)
        page.screenshot(path=str(art / f"report-first-screen-{which.replace(' ', '-')}.png"))
    assert errors == []
    assert [u for u in requests if not u.startswith("file:")] == []


def test_plots_draw_one_series_per_endpoint_and_workload(two_workloads):
    """Against offered load: a series per endpoint x workload (never one line zig-zagging
    over both workloads), one offered-load reference; the Pareto curve likewise."""
    ctx = build_context(load([two_workloads]))
    figs = {f["key"]: f for f in ctx["figures"]}
    names = [t["name"] for t in figs["goodput_vs_load"]["data"]]
    assert [n for n in names if n.startswith("offered")] == ["offered (achieved = offered)"]
    series = {n.split(":")[0] for n in names if not n.startswith("offered")}
    assert series == {f"{ep} · {wl}" for ep, _, _ in ENDPOINTS for wl in PROBES}
    for t in figs["goodput_vs_load"]["data"]:
        if t["name"].endswith(": goodput"):
            ep, wl = t["name"].removesuffix(": goodput").split(" · ")
            assert sorted(_values(t["x"])) == pytest.approx(sorted(
                r for r, _, _ in PROBES[wl][ep]), rel=0.2)
    pareto = {t["name"] for t in figs["pareto"]["data"] if t.get("mode") == "lines+markers"}
    assert pareto == series
    cdf = {t["name"] for t in figs["cdf_ttft"]["data"]}
    assert cdf == series


def _values(x) -> list[float]:
    """A plotly trace's coordinates, plain or as its typed array ({dtype, bdata})."""
    import base64

    if isinstance(x, dict):
        return np.frombuffer(base64.b64decode(x["bdata"]), dtype=x["dtype"]).tolist()
    return list(x)
