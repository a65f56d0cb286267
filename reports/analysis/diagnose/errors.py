"""The error finding: an error rate above a threshold, its dominant status and error text,
and what that kind of error usually means."""

from __future__ import annotations

import math

from kvbench.reports.statistics import metrics as M
from kvbench.reports.measures.data import ReportData
from kvbench.reports.analysis.diagnose.base import Finding, _fmt
from kvbench.reports.analysis.diagnose.search import exempt, keep_mask

ERROR_RATE = 0.01  # errors above 1% of the requests that finished ...
ERROR_MIN = 3  # ... and at least this many of them
ERROR_RATE_CRITICAL = 0.05  # a run whose latencies describe mostly the survivors

# What each kind of error usually means, and what to do: (cause, fix) by status, with HTTP
# codes told apart where they mean different things.
_ERROR_CAUSES = {
    "overload": ("the server refused work it had no room for (429 / 503: rate limit, full "
                 "queue or a replica out of the pool)",
                 "lower the offered load or add replicas; where the server sends Retry-After "
                 "the records hold it (retry_after_s)"),
    "auth": ("the server rejected the credentials (401 / 403)",
             "check the endpoint's api_key_env / headers in bench.toml"),
    "client": ("the server rejected the requests themselves (4xx: context too long, unknown "
               "model, bad parameters)",
               "check the model name and max_context_tokens against the server, and the error "
               "text"),
    "server": ("the server failed while serving (5xx)",
               "read the server's log at the times in the errors-over-time plot"),
    "timeout": ("requests ran past request_timeout_s (an overloaded or stalled server)",
                "lower the load, or raise [profiles.*] request_timeout_s if long answers are "
                "expected"),
    "disconnected": ("the connection was refused or closed mid-response (a crashed or "
                     "restarted server, or a proxy's idle timeout)",
                     "check that the server stayed up, and any proxy's timeouts"),
    "protocol_error": ("the responses were not the streaming protocol expected (a proxy "
                       "buffering or rewriting the stream, or another API dialect)",
                       "point the endpoint at the server itself, or check its api setting"),
}


def _error_kind(status: str, http: float) -> str:
    if status == "http_error":
        if http in (429.0, 503.0):
            return "overload"
        if http in (401.0, 403.0):
            return "auth"
        if 400 <= http < 500:
            return "client"
        return "server"
    return status if status in _ERROR_CAUSES else "server"


def errors(d: ReportData) -> list[Finding]:
    """Error rate above ``ERROR_RATE``: the dominant error (status, the most common error
    text, their counts and shares), its likely cause and fix. Requests cancelled at the stop
    (or by a capacity search cutting a probe) are not errors and are left out of both counts;
    so are a search's probes above the capacity it claims, where failing is how it found the
    limit (``diagnose.search``)."""
    out = []
    f = d.frame
    f = f.loc[keep_mask(f, exempt(d.stages, overload=False)),
              ["endpoint", "ok", "cancelled", "status", "error", "http_status"]]
    for ep, sub in f.groupby("endpoint", observed=True):
        finished = int((~sub["cancelled"]).sum())
        bad = sub[M.failed(sub)]
        n_err = len(bad)
        if not finished or n_err < ERROR_MIN or n_err / finished <= ERROR_RATE:
            continue
        rate = n_err / finished
        by_status = bad["status"].astype(str).value_counts()
        status, n_status = str(by_status.index[0]), int(by_status.iloc[0])
        of_status = bad[bad["status"].astype(str).to_numpy() == status]
        texts = of_status["error"].astype(object).fillna("(no error text)").astype(str)
        top = texts.value_counts()
        text, n_text = str(top.index[0]), int(top.iloc[0])
        codes = of_status["http_status"].dropna()
        http = float(codes.mode().iloc[0]) if len(codes) else math.nan
        cause, fix = _ERROR_CAUSES[_error_kind(status, http)]
        status_label = status + (f" {int(http)}" if status == "http_error" and http == http
                                 else "")
        ev = [("error rate (errors / requests that finished)",
               f"{_fmt(rate, '%')} ({n_err:,} of {finished:,})"),
              ("dominant status", f"{status_label}: {n_status:,} ({_fmt(n_status / n_err, '%')} "
                                  "of the errors)"),
              ("most common error", f"\"{text[:200]}\": {n_text:,} ({_fmt(n_text / n_err, '%')}"
                                    " of the errors)")]
        if len(by_status) > 1:
            ev.append(("other statuses", ", ".join(f"{s} {int(n):,}" for s, n in
                                                   by_status.iloc[1:].items())))
        cancelled = int(sub["cancelled"].sum())
        if cancelled:
            ev.append(("cancelled at the stop (not counted)", f"{cancelled:,}"))
        out.append(Finding(
            "errors", f"{ep}: {_fmt(rate, '%')} of requests failed, mostly {status_label}", ev,
            cause, fix, endpoint=str(ep),
            severity="critical" if rate > ERROR_RATE_CRITICAL else "warning",
            numbers={"error_rate": rate, "errors": n_err, "status": status,
                     "status_count": n_status, "error": text, "error_count": n_text}))
    return out

