"""Render a comparison/bake-off report (one self-contained HTML file, or Markdown for CI logs)
from the template context ``reports.context`` builds.

Everything the HTML needs is inlined (plotly.js once, styles, figure JSON), so it opens with no
network now and in a year. The History section (``history_section``) reads only the manifest
of the store the runs belong to. Text from endpoints goes through Jinja autoescape; figure JSON is
escaped so that no string inside it can close its <script> element.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from jinja2 import Environment, PackageLoader, select_autoescape

from kvbench.reports.rendering.cells import fmt
from kvbench.reports.rendering.context import build_context
from kvbench.reports.rendering.history_section import DEFAULT_RUNS
from kvbench.reports.rendering.history_section import build as build_history


def _env() -> Environment:
    env = Environment(loader=PackageLoader("kvbench.reports.rendering", "templates"),
                      autoescape=select_autoescape(["html", "j2"], default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = fmt
    env.filters["script_json"] = script_json
    return env


def script_json(obj) -> str:
    """JSON that is safe inside <script>: no '<', '>', '&' or line separators in the text."""
    import plotly.utils

    s = json.dumps(obj, cls=plotly.utils.PlotlyJSONEncoder, separators=(",", ":"))
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_html(ctx: dict) -> str:
    from markupsafe import Markup
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    if "</script" in js.lower():  # would end the inline element early
        js = js.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")
    figs = [{"key": f["key"], "title": f["title"], "note": f["note"],
             "json": Markup(script_json({"data": f["data"], "layout": f["layout"]}))}
            for f in ctx["figures"]]
    history = [{**h, "figure": h["figure"] and {
        **h["figure"], "json": Markup(script_json({"data": h["figure"]["data"],
                                                   "layout": h["figure"]["layout"]}))}}
               for h in ctx.get("history") or []]
    tpl = _env().get_template("report.html.j2")
    return tpl.render(**{**ctx, "figures": figs, "history": history}, plotly_js=Markup(js))


def md_escape(text) -> str:
    s = str(text)
    for ch in "\\`*_[]<>|":
        s = s.replace(ch, "\\" + ch)
    return s.replace("\n", " ")


def render_md(ctx: dict) -> str:
    env = Environment(loader=PackageLoader("kvbench.reports.rendering", "templates"), autoescape=False,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["md"] = md_escape
    return env.get_template("report.md.j2").render(**ctx)


def render(paths: Sequence[Path | str], fmt_: str = "html", slo=None,
           title: str | None = None, history: int = DEFAULT_RUNS,
           sources: Sequence[Path | str] | None = None,
           max_requests: int | None = None) -> str:
    """The report of the runs in ``paths``; ``history``: at most that many runs of the
    results store the runs belong to (the parent of ``sources``, what the user named: a
    folder or an ``s3://`` run; default ``paths``) in a History section, 0: none.
    Runs of more than ``max_requests`` compacted requests in all (default
    ``scale.MAX_REQUESTS``) are reported out of core (``reports.rendering.scale``)."""
    from kvbench.reports.rendering import scale

    paths = [Path(p) for p in paths]
    if scale.wanted(paths, max_requests):
        ctx, runs = _scaled_context(paths, slo, title, fmt_ == "html")
    else:
        from kvbench.reports.measures.data import load

        d = load(paths, slo=slo)
        ctx, runs = build_context(d, title, figures=fmt_ == "html"), d.runs
    ctx["history"] = build_history(runs, list(sources or paths), history,
                                   figures=fmt_ == "html")
    return render_html(ctx) if fmt_ == "html" else render_md(ctx)


def _slo(slo, metas) -> dict:
    """The SLOs ``load`` judges by: those given, else the runs' configs' merged."""
    from kvbench.reports.measures.data import _slo as as_slo

    if slo is None:
        slo = {}
        for meta in metas:
            slo.update(meta.slo)
    return as_slo(slo)


def _scaled_context(paths: list[Path], slo, title: str | None,
                    figures: bool) -> tuple[dict, list]:
    """The context of runs too large to hold (``reports.rendering.scale``): built over a
    seeded sample of their requests (temporary copies of the runs), the Summary's figures
    exact over every request."""
    import shutil
    import tempfile

    from kvbench.core.store import read_meta
    from kvbench.reports.measures.data import load
    from kvbench.reports.rendering import scale

    tmp = Path(tempfile.mkdtemp(prefix="kvbench-report-sample-"))
    try:
        per = max(1, scale.SAMPLE // len(paths))
        samplers = [scale.Sampler(per, scale.compacted_requests(p)) for p in paths]
        metas = [read_meta(p) for p in paths]
        names: dict[str, int] = {}  # endpoint names that repeat across runs: name@run_id
        for meta in metas:
            for ep in {str(e.name) for e in meta.endpoints if e.name}:
                names[ep] = names.get(ep, 0) + 1
        labels = [(lambda e, rid=str(meta.run_id or p.name):
                   e if names.get(e, 0) <= 1 else f"{e}@{rid}")
                  for meta, p in zip(metas, paths)]
        exact = scale.exact_figures(paths, labels, _slo(slo, metas), samplers)
        copies = [scale.sampled_copy(p, tmp / f"{i}-{p.name}", s) for i, (p, s) in
                  enumerate(zip(paths, samplers))]
        d = load([c for c, _, _ in copies], slo=slo)
        scale.scale_windows(d, {str(meta.run_id or p.name): m / n if n else 1.0
                                for meta, p, (_, m, n) in zip(d.runs, paths, copies)})
        stages = (scale.ordered_like(exact.rates, d.frame),
                  scale.ordered_like(exact.stages, d.frame))
        ctx = build_context(d, title, figures=figures, stages=stages)
        scale.apply(ctx, d, exact, scale.Scale(sum(n for _, _, n in copies),
                                               sum(m for _, m, _ in copies)))
        for r, p in zip(ctx["runs"], paths):
            r["path"] = str(p)  # the run's own folder, not the sample's
        return ctx, d.runs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["render", "render_html", "render_md", "build_context"]
