"""The report's History section: where the reported runs belong to a results store (their
folder's parent, or the ``s3://`` prefix they were fetched from) that keeps a history manifest,
the trend over the store's newest runs of each endpoint x workload's key figures (capacity at
SLO, goodput, TTFT p99, TPOT p99), the reported runs marked. Read from the manifest alone
(``kvbench.core.manifest``): no other run is opened, and nothing is written (a store of an older
kvbench without a manifest simply has no section here; ``kvbench history`` migrates it).

``figure`` is also what ``kvbench history --plot`` draws."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from kvbench.core import manifest as MF
from kvbench.core import objstore
from kvbench.core.errors import DataError
from kvbench.reports.rendering.cells import fmt

DEFAULT_RUNS = 30  # kvbench report --history N
TABLE_RUNS = 5  # the newest runs of the table (and of the Markdown report)
# (field of the manifest's figures, label, unit): latencies are in ms, as every metric
PLOTTED = (("capacity_rps", "capacity at SLO", "req/s"), ("goodput_rps", "goodput", "req/s"),
           ("ttft_p99", "TTFT p99", "ms"), ("tpot_p99", "TPOT p99", "ms"))
FIELDS = tuple(m for m, _, _ in PLOTTED)
COLUMNS = ["started_ns", "date", "run_id", "suite", "verdict", "endpoint", "workload", *FIELDS]


def store_of(spec) -> MF.Store:
    """The results store holding run ``spec``: an ``s3://.../RUN`` URL's prefix, or a local
    run folder's parent (``results/latest`` resolved first)."""
    if objstore.is_url(spec):
        loc, _ = objstore.split_run(str(spec))
        return MF.Store(loc=loc)
    return MF.Store(root=Path(spec).resolve().parent)


def trend_frame(entries: list[dict]) -> pd.DataFrame:
    """One row per run x endpoint x workload of the entries' figures, oldest first."""
    rows = [{"started_ns": int(e["started_ns"]), "run_id": str(e["run_id"]),
             "suite": e.get("suite"), "verdict": e.get("verdict") or "-",
             "endpoint": f.get("endpoint"), "workload": f.get("workload", "*"),
             **{k: f.get(k) for k in FIELDS}}
            for e in entries for f in (e.get("figures") or []) if isinstance(f, dict)]
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.DataFrame(rows)
    df.insert(1, "date", pd.to_datetime(df["started_ns"], unit="ns").dt.strftime(
        "%Y-%m-%d %H:%M"))
    df = df.astype({k: "float64" for k in FIELDS})
    return df.sort_values(["started_ns", "run_id", "endpoint", "workload"],
                          kind="stable")[COLUMNS].reset_index(drop=True)


def per_workload(tr: pd.DataFrame) -> pd.DataFrame:
    """Drop an endpoint's pooled ``*`` rows where it has rows per workload (one workload's
    line would otherwise be drawn twice)."""
    if tr.empty:
        return tr
    split = set(tr.loc[tr["workload"] != "*", "endpoint"])
    return tr[~((tr["workload"] == "*") & tr["endpoint"].isin(split))].reset_index(drop=True)


def figure(tr: pd.DataFrame, marked=(), cols: int = 1, title: str = "kvbench history"):
    """The trend as a plotly figure: one panel per figure with a value, one line per
    endpoint x workload over the runs' start times, a failed run drawn as a cross, the runs
    ``marked`` (run ids) as stars on a dotted line; None: nothing to draw."""
    import plotly.colors
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    shown = [(m, f"{label} ({unit})") for m, label, unit in PLOTTED
             if m in tr and tr[m].notna().any()]
    if tr.empty or not shown:
        return None
    x_of = pd.to_datetime(tr["started_ns"], unit="ns").dt.strftime("%Y-%m-%d %H:%M:%S") if (
        "started_ns" in tr) else tr["date"]
    tr = tr.assign(x=x_of)
    cols = max(1, min(cols, len(shown)))
    rows = -(-len(shown) // cols)
    fig = make_subplots(rows=rows, cols=cols, shared_xaxes=cols == 1,
                        subplot_titles=[t for _, t in shown], vertical_spacing=0.14 if
                        cols > 1 else 0.08, horizontal_spacing=0.08)
    palette = plotly.colors.qualitative.Plotly
    marked = set(marked)
    groups = list(tr.groupby(["endpoint", "workload"], sort=True))
    for i, (m, label) in enumerate(shown):
        r, c = i // cols + 1, i % cols + 1
        for j, ((ep, wl), sub) in enumerate(groups):
            name = f"{ep} x {wl}"
            colour = palette[j % len(palette)]
            fig.add_trace(go.Scatter(
                x=sub["x"], y=sub[m], mode="lines+markers", name=name, legendgroup=name,
                showlegend=i == 0, line=dict(color=colour),
                marker=dict(color=colour, size=[11 if v == "fail" else 7 for v in sub["verdict"]],
                            symbol=["x" if v == "fail" else "circle" for v in sub["verdict"]]),
                customdata=list(zip(sub["run_id"], sub["verdict"])),
                hovertemplate=f"{name}<br>%{{x}}<br>run %{{customdata[0]}} "
                              "(%{customdata[1]})<br>" + label + ": %{y:.4g}<extra></extra>"),
                row=r, col=c)
        here = tr[tr["run_id"].isin(marked) & tr[m].notna()]
        if len(here):
            fig.add_trace(go.Scatter(
                x=here["x"], y=here[m], mode="markers", name="this report's run",
                legendgroup="marked", showlegend=i == 0, hoverinfo="skip",
                marker=dict(symbol="star", size=15, color="rgba(0,0,0,0)",
                            line=dict(color="#c8312b", width=2))), row=r, col=c)
    for x in sorted(set(tr.loc[tr["run_id"].isin(marked), "x"])):
        fig.add_vline(x=x, line=dict(color="#c8312b", width=1, dash="dot"))
    fig.update_layout(height=(300 if cols > 1 else 250) * rows + 80, title=title,
                      template="plotly_white", margin=dict(l=60, r=20, t=70, b=40),
                      legend=dict(orientation="h", y=-0.12 if cols > 1 else -0.05))
    span = pd.to_datetime(tr["x"]).agg(["min", "max"])
    days = max(1, -(-int((span["max"] - span["min"]).days) // 8))  # at most ~9 ticks
    fig.update_xaxes(type="date", tickformat="%b %d", dtick=days * 86_400_000,
                     hoverformat="%Y-%m-%d %H:%M")
    fig.update_yaxes(rangemode="tozero")
    return fig


def _window(store: MF.Store, suite: str, limit: int, reported: dict) -> list[dict]:
    """The newest ``limit`` entries of ``suite``; where a reported run (id -> start) is older
    than them all, the ``limit`` runs up to the newest such run, so it is on the plot."""
    got = MF.read_entries(store, suite, limit)
    if not got:
        return got
    first = got[0]["started_ns"]
    older = [s for rid, s in reported.items() if s is not None and s < first
             and rid not in {e["run_id"] for e in got}]
    if older:
        upto = max(older)
        got = MF.read_entries(store, suite, limit, where=lambda e: e["started_ns"] <= upto)
    return got


def table_rows(tr: pd.DataFrame, marked, runs: int = TABLE_RUNS) -> list[dict]:
    """The newest ``runs`` runs' figures, newest first, for the HTML table and Markdown."""
    if tr.empty:
        return []
    newest = list(dict.fromkeys(tr.sort_values("started_ns")["run_id"][::-1]))[:runs]
    sub = tr[tr["run_id"].isin(newest)].sort_values(
        ["started_ns", "run_id", "endpoint", "workload"], ascending=[False, False, True, True])
    return [{"date": r.date, "run_id": r.run_id, "verdict": r.verdict, "endpoint": r.endpoint,
             "workload": r.workload, "marked": r.run_id in marked,
             **{m: fmt(getattr(r, m)) for m in FIELDS}}
            for r in sub.itertuples(index=False)]


def build(runs, sources, limit: int = DEFAULT_RUNS, figures: bool = True) -> list[dict]:
    """One block per (store, suite) of the reported runs that has history: its run count, the
    figure (``figures``), the table of its newest runs, which reported runs it holds. A store
    that cannot be read is named on stderr and left out: the report is about the runs."""
    if not limit or limit <= 0:
        return []
    groups: dict = {}
    for meta, src in zip(runs, sources):
        try:
            store = store_of(src)
        except ValueError:
            continue
        suite = str(meta.suite or "default")
        rid = str(meta.run_id or Path(str(src)).name)
        g = groups.setdefault((store.where(), suite), {"store": store, "reported": {}})
        g["reported"][rid] = meta.started_ns
    blocks = []
    for (where, suite), g in groups.items():
        try:
            entries = _window(g["store"], suite, limit, g["reported"])
        except (OSError, DataError) as exc:
            print(f"kvbench report: no History section for {where}: its history cannot be "
                  f"read ({str(exc).splitlines()[0][:160]})", file=sys.stderr)
            continue
        if not entries:
            continue
        tr = per_workload(trend_frame(entries))
        ids = [e["run_id"] for e in entries]
        marked = [rid for rid in g["reported"] if rid in ids]
        fig = None
        if figures:
            f = figure(tr, marked, cols=2, title=f"suite {suite}: the last {len(ids)} runs")
            if f is not None:
                d = f.to_plotly_json()
                fig = {"key": f"history-{len(blocks)}", "title": "History", "note": "",
                       "data": d["data"], "layout": d["layout"]}
        blocks.append({
            "store": where, "suite": suite, "n_runs": len(ids), "limit": limit,
            "first": _date(entries[0]), "last": _date(entries[-1]),
            "marked": marked, "unrecorded": [r for r in g["reported"] if r not in ids],
            "groups": int(tr.groupby(["endpoint", "workload"]).ngroups) if len(tr) else 0,
            "figure": fig, "rows": table_rows(tr, set(marked)),
            "table_runs": min(TABLE_RUNS, len(ids))})
    return blocks


def _date(entry: dict) -> str:
    return pd.to_datetime(int(entry["started_ns"]), unit="ns").strftime("%Y-%m-%d %H:%M")
