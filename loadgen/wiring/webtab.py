"""kvbench's tab in Locust's web UI, through Locust's own extension points: a ``kvbench`` entry of
``template_args["extended_tabs"]`` with its table (``extended_tables``), filled from the
``extended_stats`` of the ``/stats/requests`` answer (Locust's documented ``after_request``
pattern), and a page of our own at ``/kvbench`` (the same figures with small live charts,
inline SVG and script: nothing loaded from elsewhere) with its JSON at ``/kvbench/live.json``.

Locust's "Aggregated" row averages TTFTs with TPOTs and E2E times; for kvbench's rows it is
relabelled so nobody reads it as a latency. On a distributed run this serves from the master,
which its workers feed (``kvbench.loadgen.liveview.live``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from locust import events
from locust.runners import MasterRunner, WorkerRunner

from kvbench.loadgen.liveview import live

TAB = "kvbench"
PAGE = Path(__file__).with_name("templates") / "kvbench_live.html"
CACHE_S = 1.0  # at most one summary a second, however many browsers watch
AGGREGATED = "Aggregated (mixes e2e, ttft, tpot: see the kvbench tab)"
_COLS = [("endpoint", "Endpoint"), ("request_class", "Class"), ("span", "Span"),
         ("requests", "Requests"), ("errors", "Errors"),
         ("ttft_p50", "TTFT p50 ms"), ("ttft_p90", "p90"), ("ttft_p99", "p99"),
         ("tpot_p50", "TPOT p50 ms"), ("tpot_p90", "p90"), ("tpot_p99", "p99"),
         ("itl_p50", "ITL p50 ms"), ("itl_p90", "p90"), ("itl_p99", "p99"),
         ("lateness_p99", "Lateness p99 ms"), ("slo_attainment", "SLO met"),
         ("goodput_rps", "Goodput req/s"), ("hit_ratio", "Hit ratio (records)")]


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table_rows(summary: dict) -> list[dict]:
    """The tab's rows: per endpoint and class, the window and since start; then the run's."""
    rows = []
    for r in summary["rows"]:
        for span, label in (("window", f"last {summary['window_s']:.0f} s"),
                            ("since", "since start")):
            f = r[span]
            row = {"endpoint": r["endpoint"], "request_class": r["request_class"], "span": label,
                   "requests": str(f["done"]), "errors": str(f["errors"]),
                   "lateness_p99": _fmt(f["lateness"][2]),
                   "slo_attainment": "no SLO" if f["slo_attainment"] is None and not r["slo"]
                   else (_fmt(100 * f["slo_attainment"]) + " %" if f["slo_attainment"]
                         is not None else "-"),
                   "goodput_rps": _fmt(f["goodput_rps"], 2),
                   "hit_ratio": _fmt(f["hit_ratio"], 3)}
            for m in ("ttft", "tpot", "itl"):
                for q, v in zip(("p50", "p90", "p99"), f[m]):
                    row[f"{m}_{q}"] = _fmt(v)
            rows.append(row)
    st = summary["state"]
    tele = summary["telemetry"]
    engine = "; ".join(
        f"{ep}: KV {_fmt(100 * e['kv_usage'] if e['kv_usage'] is not None else None)} %, "
        f"queue {_fmt(e['waiting'], 0)}, hits {_fmt(e['hit_ratio'], 3)}"
        for ep, e in (tele.get("engines") or {}).items()) or tele.get("note", "-")
    rows.append({"endpoint": "in flight / dropped", "request_class":
                 f"{st.get('in_flight', 0)} / {st.get('dropped_at_cap', 0)}",
                 "span": "engine", "requests": engine, "errors": "charts: /kvbench"})
    return rows


class WebTab:
    """The routes and the tab on one Locust web UI."""

    def __init__(self, environment) -> None:
        self.environment = environment
        self._cache: tuple[float, dict] | None = None

    def summary(self) -> dict:
        stats = getattr(self.environment, "kvbench_live", None)
        if stats is None:
            return {"rows": [], "state": {"runner": getattr(self.environment.runner, "state",
                                                            None)},
                    "telemetry": {"note": "no requests yet"},
                    "window_s": live.WINDOW_S, "since_s": 0.0, "stages": {}, "workers": 0}
        now = time.monotonic()
        if self._cache is None or now - self._cache[0] >= CACHE_S:
            if stats.inbox:
                stats.drain()
            if stats.telemetry is None:  # a master: the run directory is known once it runs
                rd = _run_dir(self.environment)
                if rd is not None:
                    stats.telemetry = live.TelemetryTail(rd)
            self._cache = (now, self._with_runner(stats.summary()))
        return self._cache[1]

    def _with_runner(self, summary: dict) -> dict:
        """Locust's own state and user count beside the summary: the page names the stage
        from them (a closed loop's users are the ones Locust runs; none yet before a start)."""
        runner = self.environment.runner
        state = summary["state"] = dict(summary.get("state") or {})
        state["runner"] = getattr(runner, "state", None)
        try:
            state["users_now"] = runner.user_count if runner is not None else None
        except Exception:  # noqa: BLE001 - a figure of the page, never an error of the run
            state["users_now"] = None
        return summary

    def install(self, web_ui) -> None:
        from flask import Response, request

        web_ui.template_args["extended_tabs"] = [{"title": "kvbench", "key": TAB}]
        web_ui.template_args["extended_tables"] = [
            {"key": TAB, "structure": [{"key": k, "title": t} for k, t in _COLS]}]
        app = web_ui.app

        @app.route("/kvbench")
        def kvbench_page():
            return Response(PAGE.read_text(), mimetype="text/html")

        @app.route("/kvbench/live.json")
        def kvbench_live():
            return Response(json.dumps(self.summary(), default=_json_default),
                            mimetype="application/json")

        @app.after_request
        def extend_stats(response):
            if request.path != "/stats/requests" or response.status_code != 200:
                return response
            try:
                data = response.get_json()
                for s in data.get("stats", []):
                    if s.get("name") == "Aggregated" and _kvbench_rows(data):
                        s["name"] = AGGREGATED
                data["extended_stats"] = [{"key": TAB, "data": table_rows(self.summary())}]
                response.set_data(json.dumps(data, default=_json_default))
            except Exception:  # noqa: BLE001 - Locust's own answer must still reach the UI
                pass
            return response


def _kvbench_rows(data: dict) -> bool:
    return any(str(s.get("name", "")).split(" ")[0] in ("e2e", "ttft", "tpot")
               for s in data.get("stats", []))


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


@events.init.add_listener
def on_init(environment, web_ui=None, **kw) -> None:
    """A single process's or a master's web UI gets the tab; a master also listens to its
    workers' live summaries (a single process's comes with its load context)."""
    from kvbench.loadgen.plan.options import has_kvbench_options

    if not has_kvbench_options(getattr(environment, "parsed_options", None)):
        return
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        live.listen_as_worker(environment)
    ui = web_ui or getattr(environment, "web_ui", None)
    if isinstance(runner, MasterRunner) and ui is not None:
        live.attach_master(environment, _slo(environment), None)
        environment.events.test_start.add_listener(_ask_workers)
    if ui is not None:
        WebTab(environment).install(ui)


def _ask_workers(environment, **kw) -> None:
    """The workers of a master with a web UI send their live values (a headless master's
    workers send only their small state: nobody would read the rest)."""
    environment.runner.send_message(live.LIVE_WANTED_MSG, True)


def _run_dir(environment) -> Path | None:
    o = environment.parsed_options
    if not getattr(o, "kvbench_run_id", None) and not getattr(o, "kvbench_job", None):
        return None
    from kvbench.loadgen.plan.options import run_dir

    try:
        return run_dir(o)
    except Exception:  # noqa: BLE001 - no run directory: no telemetry figures
        return None


def _slo(environment) -> dict:
    """The job's SLOs, resolved from the options as the workers do (without a model lookup)."""
    from kvbench.core.errors import UserError
    from kvbench.loadgen.wiring.hooks import kvbench_users
    from kvbench.loadgen.plan.options import job_from_options

    classes = kvbench_users(environment)
    if not classes:
        return {}
    try:
        job = job_from_options(environment.parsed_options, environment.host or getattr(
            classes[0], "host", None), classes[0].workload, lookup_model=False)
    except (UserError, Exception):  # noqa: BLE001 - the workers report a bad config
        return {}
    return job.slo
