"""The capacity search in the report: the capacity table (per endpoint x workload, from
``reports.analysis.capacity``), the rankings per workload by capacity at SLO per GPU and per
dollar, and the verdict the report opens with: per workload, who ranks first, by how much,
whether the search showed it apart from the next, which class breaks first on which SLO, and
one plain sentence. The HTML and the Markdown pages print the same dicts built here, so they
say the same words.

A figure is never shown apart from its neighbour while it is weak: thin (every request of a
class within SLO, too few to show the target), decided on its estimate (a pass or the failure
above it still straddled the target after refinement), a lower bound (nothing failed), or not
held (the search's final hold at the claimed rate failed). Each weakness comes with what would
settle it (``caveats``)."""

from __future__ import annotations

import re

from kvbench.reports.analysis.numbering import number
from kvbench.reports.measures.data import ReportData
from kvbench.reports.rendering.cells import fmt


def build_capacity(d: ReportData) -> dict | None:
    """The capacity search's section: per endpoint x workload the capacity at SLO with its
    bracket (last passing, first failing rate) and the attainment interval of its worst class
    there, the class that broke first and the SLO it missed, per GPU and per dollar; the
    rankings by capacity per GPU and per dollar within each workload; the verdict per
    workload (``verdict``); the ``Capacity`` objects themselves (``caps``, for the summary at
    capacity). None: no search ran."""
    from kvbench.reports.analysis import capacity as C

    caps = C.summarise(d.stages, d.frame, d.slo)
    if not caps:
        return None
    rows = [capacity_row(c, d) for c in caps]
    by_gpu = ranked(rows, "per_gpu")
    by_usd = ranked(rows, "per_usd")
    probes = [{"endpoint": s.endpoint, "workload": s.workload, "stage": number(s.index),
               "rate": (fmt(s.rate_rps) if s.rate_rps is not None
                        else f"{s.users} users" if s.users is not None else "–"),
               "duration": fmt(s.duration_s), "role": s.search.role,
               "verdict": s.search.verdict or (
                   "not judged" if s.search.role == "warmup" else "void"),
               "why": s.search.why or ""}
              for s in d.stages if s.search is not None]
    return {"rows": rows, "by_gpu": by_gpu, "by_usd": by_usd, "probes": probes,
            "verdict": verdict(rows, by_gpu, by_usd), "caps": caps}


def capacity_row(c, d: ReportData) -> dict:
    """One endpoint x workload of the capacity table, with the fields the rankings and the
    verdict read (its weaknesses in ``caveats``)."""
    from kvbench.reports.analysis import capacity as C

    ep = d.endpoint(c.endpoint)
    per = C.per_gpu_and_cost(c, ep.gpus, ep.gpu_hour_cost)
    at = c.at_capacity or {}
    br = c.breaks or {}
    closed = c.unit == "users"
    num = (lambda x: fmt(x, "count")) if closed else fmt  # whole users
    gpus = ep.gpus or 1
    row = {
        "endpoint": c.endpoint, "workload": c.workload, "status": c.status,
        "unit": c.unit, "loop": "closed loop: users" if closed else "open loop: req/s",
        "capacity": c.estimate_rps, "capacity_text": C.capacity_text(c, fmt),
        "passed": c.capacity_rps,
        "fail": c.fail_rps, "low": c.low_rps, "high": c.high_rps, "held": c.held,
        "bracket": (f"none passed; failed at {num(c.fail_rps)}" if c.capacity_rps is None
                    and c.fail_rps is not None else "–" if c.capacity_rps is None
                    else f"{num(c.capacity_rps)} – {num(c.fail_rps)}" if c.fail_rps is not None
                    else f"≥ {num(c.capacity_rps)}")
        + ("" if (c.low_rps, c.high_rps) == (c.capacity_rps, c.fail_rps)
           or c.capacity_rps is None else f" (shown: {c.interval_text})"),
        # the bracket per GPU: the interval the ranking per GPU is read against
        "bracket_per_gpu": (f"{fmt(c.capacity_rps / gpus)} – {fmt(c.fail_rps / gpus)}"
                            if c.capacity_rps is not None and c.fail_rps is not None
                            else f"≥ {fmt(c.capacity_rps / gpus)}"
                            if c.capacity_rps is not None else "–"),
        "attainment": (f"{fmt(at.get('attainment'), 'fraction')} "
                       f"[{fmt(at.get('low'), 'fraction')}, "
                       f"{fmt(at.get('high'), 'fraction')}] ({at.get('worst_class')})"
                       + (f"; thin: {at['thin']}" if at.get("thin") else "")
                       + ("; decided on its estimate: the interval still straddles the "
                          "target after refinement" if at.get("estimate") else "")
                       if at else "–"),
        "breaks": (f"{br['class']}: {br['missed'] or '?'} "
                   f"({fmt(br['attainment'], 'fraction')} within SLO at "
                   f"{num(br['rate_rps'])} {c.unit})" if br else "none seen"),
        "breaks_short": (f"{br['class']} on {br['missed'] or '?'} at {num(br['rate_rps'])} "
                         f"{c.unit}" if br else "none seen"),
        "gpus": ep.gpus, "gpu_hour_cost": ep.gpu_hour_cost,
        "per_gpu": per["capacity_per_gpu"], "per_gpu_text": fmt(per["capacity_per_gpu"]),
        "per_usd": per["capacity_per_usd_hour"],
        "per_usd_text": fmt(per["capacity_per_usd_hour"]),
        "output_tps_per_gpu": per["output_tps_per_gpu"],
        "usd_per_mtok_value": per["usd_per_mtok"],
        "usd_per_mtok": fmt(per["usd_per_mtok"]),
        "probes": c.probes, "load_s": fmt(c.load_s)}
    row["caveats"] = caveats(c, num)
    return row


_THIN = re.compile(r"^(?P<classes>.*) \((?P<needed>\d+) needed each")


def caveats(c, num=fmt) -> list[dict]:
    """Why a capacity cannot be ranked apart from its neighbours, each with what would settle
    it: [{"why": "thin", "text": ...}]; empty when nothing weakens it (a search without hold
    data, ``held`` None, is not held against it)."""
    at = c.at_capacity or {}
    unit = c.unit
    out = []
    if c.capacity_rps is None:
        return out
    if at.get("thin"):
        m = _THIN.match(at["thin"])
        longer = ("a longer hold: search.hold_s" if c.held else
                  "longer probes: search.probe_s, min_requests")
        text = (f"thin: {m['classes']} within SLO, {m['needed']} of each needed ({longer})"
                if m else f"thin: {at['thin']}")
        out.append({"why": "thin", "end": "pass", "text": text})
    if at.get("estimate"):
        out.append({"why": "decided on its estimate", "end": "pass",
                    "text": f"decided on its estimate at {num(c.capacity_rps)} {unit}: a "
                            "longer probe there (search.max_probe_s)"})
    if c.fail_rps is not None and c.high_rps != c.fail_rps:
        out.append({"why": "failure decided on its estimate", "end": "fail",
                    "text": f"its failure at {num(c.fail_rps)} {unit} decided on its "
                            "estimate: a longer probe there (search.max_probe_s)"})
    if c.fail_rps is None:
        out.append({"why": "a lower bound", "end": "fail",
                    "text": f"a lower bound: nothing failed up to {num(c.capacity_rps)} "
                            f"{unit}: a longer search (search.budget_s)"})
    if c.held is False:
        out.append({"why": "not held", "end": "pass",
                    "text": f"not held: the hold at {num(c.capacity_rps)} {unit} failed"})
    return out


def ranked(rows: list[dict], key: str) -> list[dict]:
    """``rows`` with a ``key`` figure, ranked by it within each workload (endpoints compete on
    the same traffic only), workloads in the order they first appear; each a copy with its
    ``rank`` and ``apart``: None for the first, "yes" where the search showed the one above
    better, else why not (their brackets overlap, or either figure is weak: ``caveats``)."""
    def group(r):  # an open loop's rate and a closed loop's users do not compare
        return (r["workload"], r.get("unit", "req/s"))

    order = {w: i for i, w in reversed(list(enumerate(group(r) for r in rows)))}
    out = sorted((r for r in rows if r[key] is not None),
                 key=lambda r: (order[group(r)], -r[key]))
    result, last, k = [], None, 0
    for r in out:
        k = k + 1 if group(r) == last else 1
        above = result[-1] if k > 1 else None
        last = group(r)
        result.append({**r, "rank": k, "apart": None if above is None else
                       apart_text(above, r, key)})
    return result


def apart_text(a: dict, b: dict, key: str) -> str:
    """"yes" when ``a`` (ranked above) is shown better than ``b``, else why not. The evidence
    is ``a``'s pass and ``b``'s failure: a weakness of either (``a`` thin, decided on its
    estimate or not held; ``b``'s failure decided on its estimate) keeps them together, a
    weakness of the other ends does not (``b`` passing thinly says nothing of whether ``a``
    serves more than ``b`` fails at)."""
    if not separated(a, b, key):
        return f"no: {b['endpoint']}'s bracket overlaps {a['endpoint']}'s"
    weak = [f"{r['endpoint']}'s " + ("figure is " if end == "pass" else "") + " and ".join(
        dict.fromkeys(x["why"] for x in r.get("caveats", []) if x.get("end") == end))
        for r, end in ((a, "pass"), (b, "fail"))
        if any(x.get("end") == end for x in r.get("caveats", []))]
    return "no: " + "; ".join(weak) if weak else "yes"


def separated(a: dict, b: dict, key: str) -> bool:
    """Whether ``a`` (ranked above) is shown better than ``b``: the highest rate ``a`` passed,
    in ``key``'s units, lies above the rate at which ``b`` failed (its capacity at SLO, an
    interpolation inside its bracket, is not evidence of itself). Otherwise the search cannot
    tell them apart (a bracket runs from the last passing rate to the first failing one; none
    failing: open above). Whether either end was settled on its estimate is a weakness of
    the figure (``caveats``), judged apart from this."""
    fail = b.get("fail")
    return (fail is not None and a.get("passed") is not None
            and a["passed"] * a[key] / a["capacity"] > fail * b[key] / b["capacity"])


def verdict(rows: list[dict], by_gpu: list[dict], by_usd: list[dict]) -> list[dict]:
    """Per workload (open and closed loops apart): the ranking per GPU (each with whether it
    is shown above the next, and why not), the ranking per dollar, the endpoints that passed
    no rate, and one sentence (``sentence``): the HTML and Markdown verdicts print these."""
    groups = list(dict.fromkeys((r["workload"], r["unit"]) for r in rows))
    out = []
    for wl, unit in groups:
        def mine(rs):
            return [r for r in rs if (r["workload"], r["unit"]) == (wl, unit)]

        gpu, usd = mine(by_gpu), mine(by_usd)
        entries = []
        for i, r in enumerate(gpu):
            nxt = gpu[i + 1] if i + 1 < len(gpu) else None
            entries.append({**r, "apart_next": None if nxt is None else nxt["apart"],
                            "next": None if nxt is None else nxt["endpoint"],
                            "usd_rank": next((u["rank"] for u in usd
                                              if u["endpoint"] == r["endpoint"]), None),
                            "caveat_text": "; ".join(x["text"] for x in r["caveats"])})
        unranked = [r for r in mine(rows) if r["per_gpu"] is None]
        out.append({"workload": wl, "unit": unit, "closed": unit == "users",
                    "ranking": entries, "by_usd": usd, "unranked": unranked,
                    "sentence": sentence(wl, unit, entries, usd, unranked),
                    "usd_text": usd_text(usd, unit)})
    return out


def sentence(wl: str, unit: str, gpu: list[dict], usd: list[dict],
             unranked: list[dict]) -> str:
    """"longdoc: disaggregated serves 4.33 req/s per GPU at SLO, 1.6x colocated; shown
    apart." and what else a reader must know: who leads per dollar where that differs, who
    passed nothing."""
    if not gpu:
        text = f"{wl}: no endpoint passed any " + ("rate" if unit == "req/s" else
                                                  "number of users") + " probed"
        return text + (": " + ", ".join(r["endpoint"] for r in unranked) + "." if unranked
                       else ".")
    top = gpu[0]
    bound = top["fail"] is None
    text = (f"{wl}: {top['endpoint']} serves {'at least ' if bound else ''}"
            f"{fmt(top['per_gpu'])} {unit} per GPU at SLO")
    if len(gpu) > 1:
        second = gpu[1]
        ratio = top["per_gpu"] / second["per_gpu"] if second["per_gpu"] else None
        if ratio is not None and not (bound and second["fail"] is None):
            text += (f", {'at least ' if bound else 'at most ' if second['fail'] is None else ''}"
                     f"{ratio:.1f}x {second['endpoint']}")
        else:
            text += f", ahead of {second['endpoint']}"
        apart = second["apart"]
        text += ("; shown apart." if apart == "yes" else
                 f"; not shown apart from {second['endpoint']}: "
                 + ("their brackets overlap." if "overlaps" in apart else
                    apart.removeprefix("no: ") + "."))
    else:
        text += "; the only endpoint with a capacity." if unranked else "."
    if usd and gpu and usd[0]["endpoint"] != top["endpoint"]:
        text += f" Per dollar, {usd[0]['endpoint']} ranks first."
    for r in unranked:
        text += (f" {r['endpoint']} passed no "
                 + ("rate" if unit == "req/s" else "number of users") + " probed"
                 + (f" (it failed at {fmt(r['fail'])} {unit})." if r["fail"] is not None
                    else "."))
    return text


def usd_text(usd: list[dict], unit: str) -> str:
    """The ranking per dollar in one line: "1. offloaded (5.06 req/s per $/hour); 2. ...
    (not shown apart: ...)"."""
    parts = []
    for r in usd:
        apart = r["apart"]
        parts.append(f"{r['rank']}. {r['endpoint']} ({'≥ ' if r['fail'] is None else ''}"
                     f"{fmt(r['per_usd'])} {unit} per $/hour"
                     + ("" if apart in (None, "yes") else
                        f"; not shown apart: {apart.removeprefix('no: ')}") + ")")
    return "; ".join(parts) + ("." if parts else "")
