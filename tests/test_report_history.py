"""`kvbench report`'s History section: the trend over the newest runs of the results store a run
belongs to, read from the store's history manifest alone (entries made as kvbench gate makes
them), the reported run marked; in headless Chromium, in Markdown, on an s3:// store, and absent
where the store keeps no history."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from browser import browser_or_skip, offline_page
from kvbench.cli import main
from kvbench.core import manifest as MF
from kvbench.core.contract import RunMeta
from kvbench.reports.analysis import history as H
from test_results_s3 import _bucket, env, s3  # noqa: F401 (fixtures)
from synthetic import T0_NS, EndpointShape, RunShape, run_meta, synth_table, write_run

ROOT = Path(__file__).resolve().parents[1]
DAY = 86400 * 10**9
NIGHTS = 4
GROUPS = (("colocated", "chat"), ("disaggregated", "chat"))
FIELDS = ("capacity_rps", "goodput_rps", "ttft_p99", "tpot_p99")


def _value(night: int, ep: int, field: str) -> float:
    """A distinct figure per night, endpoint and field (a mix-up shows in the values)."""
    return {"capacity_rps": 10.0 + night + 0.5 * ep, "goodput_rps": 8.0 + night + 0.25 * ep,
            "ttft_p99": 400.0 + 10 * night + 100 * ep, "tpot_p99": 30.0 + night + 5 * ep}[field]


def _rows(night: int) -> list[dict]:
    rows = [{"endpoint": ep, "request_class": "*", "metric": "goodput_rps", "value": 1.0}
            for ep, _ in GROUPS]  # pooled over workloads: left out where a workload has rows
    rows += [{"endpoint": ep, "workload": wl, "request_class": "*", "metric": f,
              "value": _value(night, i, f)}
             for i, (ep, wl) in enumerate(GROUPS) for f in FIELDS]
    return rows


def _night_id(i: int) -> str:
    return f"night-{i}"


def _write_run(store: Path, run_id: str, started_ns: int) -> Path:
    shape = RunShape(endpoints=[EndpointShape(ep) for ep, _ in GROUPS], stage_rates_rps=(2.0,),
                     requests_per_stage=60)
    table, stages = synth_table(shape, run_id=run_id)
    meta = run_meta(shape, stages, run_id=run_id)
    meta["started_ns"] = started_ns
    return write_run(store / run_id, table, meta)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store of NIGHTS nightly runs' manifest entries (the last one's run folder real) and
    one entry of another suite, which the section leaves out."""
    root = tmp_path_factory.mktemp("store")
    for i in range(NIGHTS):
        rid = _night_id(i)
        meta = RunMeta(run_id=rid, suite="synthetic", started_ns=T0_NS + (i - NIGHTS + 1) * DAY)
        H.record_run(root, meta, root / rid, _rows(i), "fail" if i == 1 else "pass")
    H.record_run(root, RunMeta(run_id="other", suite="weekly", started_ns=T0_NS), root / "o",
                 _rows(99), "pass")
    _write_run(root, _night_id(NIGHTS - 1), T0_NS)
    _write_run(root, _night_id(0), T0_NS - (NIGHTS - 1) * DAY)
    return root


def _figure(html: str, key: str = "history-0") -> dict:
    m = re.search(rf'<script type="application/json" id="fig-{key}">(.*?)</script>', html, re.S)
    assert m, f"no figure {key}"
    return json.loads(m.group(1))


def _values(y) -> list:
    """A trace's values: a list, or plotly's typed array ({dtype, bdata})."""
    if isinstance(y, dict):
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"]).tolist()
    return list(y)


def _section(html: str) -> str:
    return html.split('<section id="history">', 1)[1].split("</section>", 1)[0]


def test_html_history_section_holds_the_stores_runs(store, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(store / _night_id(NIGHTS - 1)), "-o", str(out)]) == 0
    html = out.read_text()
    assert '<a href="#history">History</a>' in html
    # after the verdict (and capacity) sections, before the diagnosis
    assert html.index('id="verdict"') < html.index('id="history"') < html.index('id="diagnosis"')
    sec = _section(html)
    assert f'data-runs="{NIGHTS}"' in sec and 'data-suite="synthetic"' in sec
    assert "other" not in sec  # another suite's run
    fig = _figure(html)
    lines = [t for t in fig["data"] if t.get("legendgroup") != "marked"]
    # four panels x two endpoint x workload lines (the pooled "*" rows left out)
    assert len(lines) == 4 * len(GROUPS)
    assert {t["name"] for t in lines} == {f"{ep} x {wl}" for ep, wl in GROUPS}
    for t in lines:
        assert len(t["x"]) == NIGHTS and [c[0] for c in t["customdata"]] == [
            _night_id(i) for i in range(NIGHTS)]
    by_axis = {}
    for t in lines:
        by_axis.setdefault(t["yaxis"], []).append(t)
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles == ["capacity at SLO (req/s)", "goodput (req/s)", "TTFT p99 (ms)",
                      "TPOT p99 (ms)"]
    for axis, field in zip(sorted(by_axis, key=lambda a: int(a[1:] or 1)), FIELDS):
        for t in by_axis[axis]:
            i = [ep for ep, _ in GROUPS].index(t["name"].split(" x ")[0])
            assert _values(t["y"]) == [_value(n, i, field) for n in range(NIGHTS)], (axis, field)
    # the failed night drawn as a cross; the reported run marked on every panel
    assert lines[0]["marker"]["symbol"] == ["circle", "x", "circle", "circle"]
    marked = [t for t in fig["data"] if t.get("legendgroup") == "marked"]
    assert len(marked) == 4 and all(len(t["x"]) == len(GROUPS) for t in marked)
    assert marked[0]["x"][0] == lines[0]["x"][-1]
    # the table: the newest runs first, the reported one highlighted
    rows = re.findall(r"<tr( class=\"this-run\")?><td class=\"key\">[^<]*</td>"
                      r"<td class=\"key\">(night-\d)", sec)
    assert [r[1] for r in rows][:2] == [_night_id(NIGHTS - 1)] * 2
    assert [bool(r[0]) for r in rows] == [True, True] + [False] * (2 * NIGHTS - 2)
    assert "<td>13.50</td><td>11.25</td><td>530.0</td><td>38.00</td>" in sec  # capacity of disaggregated x chat on the last night


def test_history_n_limits_and_zero_turns_it_off(store, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(store / _night_id(NIGHTS - 1)), "-o", str(out),
                 "--history", "2"]) == 0
    html = out.read_text()
    assert 'data-runs="2"' in _section(html)
    assert all(len(t["x"]) == 2 for t in _figure(html)["data"]
               if t.get("legendgroup") != "marked")
    assert main(["report", str(store / _night_id(NIGHTS - 1)), "-o", str(out),
                 "--history", "0"]) == 0
    html = out.read_text()
    assert 'id="history"' not in html and 'href="#history"' not in html


def test_an_older_run_is_kept_on_its_own_window(store, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(store / _night_id(0)), "-o", str(out), "--history", "2"]) == 0
    fig = _figure(out.read_text())
    line = next(t for t in fig["data"] if t.get("legendgroup") != "marked")
    assert [c[0] for c in line["customdata"]] == [_night_id(0)]  # nothing older than it
    assert any(t.get("legendgroup") == "marked" for t in fig["data"])


def test_markdown_history_table(store, capsys):
    assert main(["report", str(store / _night_id(NIGHTS - 1)), "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert f"### History: suite synthetic, the last {NIGHTS} of {NIGHTS} runs recorded" in md
    rows = [ln for ln in md.splitlines() if re.match(r"\| \d{4}-\d\d-\d\d ", ln)]
    assert len(rows) == NIGHTS * len(GROUPS)
    assert rows[0].split(" | ")[1] == "**night-3** (this report)"
    assert rows[1].rstrip(" |").split(" | ")[3:9] == ["disaggregated", "chat", "13.50", "11.25", "530.0",
                                         "38.00"]


def test_no_history_no_section(tmp_path, capsys):
    run = _write_run(tmp_path / "plain", "lonely", T0_NS)
    out = tmp_path / "r.html"
    assert main(["report", str(run), "-o", str(out)]) == 0
    html = out.read_text()
    assert 'id="history"' not in html and 'href="#history"' not in html
    assert main(["report", str(run), "--format", "md"]) == 0
    assert "History" not in capsys.readouterr().out
    assert not (tmp_path / "plain" / "history").exists()  # a report writes no history


def test_a_run_not_yet_gated_is_named_not_marked(store, tmp_path):
    import shutil

    run = store / "tonight"
    shutil.copytree(store / _night_id(NIGHTS - 1), run)
    meta = json.loads((run / "run.json").read_text())
    meta["run_id"] = "tonight"
    (run / "run.json").write_text(json.dumps(meta))
    out = tmp_path / "r.html"
    try:
        assert main(["report", str(run), "-o", str(out)]) == 0
    finally:
        shutil.rmtree(run)
    sec = _section(out.read_text())
    assert "not gated into this store yet): tonight" in sec
    assert f'data-runs="{NIGHTS}"' in sec and "this-run" not in sec


def test_history_section_in_headless_chromium(store, tmp_path):
    sync_api = browser_or_skip()
    out = tmp_path / "report.html"
    assert main(["report", str(store / _night_id(NIGHTS - 1)), "-o", str(out)]) == 0
    errors, requests = [], []
    with offline_page(sync_api, out, errors, requests) as page:
        page.wait_for_function(
            "document.querySelectorAll('#plot-history-0 .main-svg').length >= 1",
            timeout=20_000)
        assert page.evaluate("document.getElementById('plot-history-0').data.length") == (
            4 * len(GROUPS) + 4)
        # every panel drew its lines' points (4 nights per line)
        assert page.locator("#plot-history-0 .scatterlayer .trace").count() == (
            4 * len(GROUPS) + 4)
        assert page.locator("#plot-history-0 .point").count() >= 4 * len(GROUPS) * NIGHTS
        assert page.locator("nav a[href='#history']").count() == 1
        art = ROOT / "test-artifacts"
        art.mkdir(exist_ok=True)
        page.locator("#history").screenshot(path=str(art / "report-history.png"))
    assert errors == []
    assert [u for u in requests if not u.startswith("file:")] == []
    assert (ROOT / "test-artifacts" / "report-history.png").stat().st_size > 20_000


def test_history_of_an_s3_store(tmp_path, s3, env):
    from kvbench.core import objstore

    bucket = _bucket(s3, "kvb-report-hist")
    url = f"s3://{bucket}/nightly"
    loc = objstore.parse(url, {"endpoint_url": s3})
    for i in range(3):
        H.record_run(loc, RunMeta(run_id=_night_id(i), suite="synthetic",
                                  started_ns=T0_NS + (i - 2) * DAY), None, _rows(i), "pass")
    objstore.upload_run(_write_run(tmp_path / "made", _night_id(2), T0_NS), loc, _night_id(2))
    env_url = f"{url}/{_night_id(2)}?endpoint_url={s3}"
    out = tmp_path / "r.md"
    assert main(["report", env_url, "--format", "md", "-o", str(out)]) == 0
    md = out.read_text()
    assert "### History: suite synthetic, the last 3 of 3 runs recorded" in md
    assert f"s3://{bucket}/nightly" in md and "**night-2** (this report)" in md
    assert MF.read_entries(MF.Store(loc=loc), "synthetic")[-1]["run_id"] == _night_id(2)
