"""The closed-loop capacity search (``search.loop = "closed"``): the highest number of users
at SLO. The plan in whole users against an oracle, the user pool that follows each probe's
count, the config's errors, and the search end to end through kvbench run and a real Locust
child against a built-in endpoint whose concurrency limit is known. Asserts on the records'
own times and on run.json, never on how long anything took."""

import json
import math
from pathlib import Path

import gevent
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from kvbench.config import load_config
from kvbench.core.contract import StageEntry
from kvbench.core.errors import UserError
from kvbench.core.store import load_results
from kvbench.loadgen.plan.pacing import ClosedLoopStages, StagePlan
from kvbench.reports.analysis import capacity as C
from kvbench.reports.measures.data import load
from kvbench.reports.statistics.metrics import request_frame
from kvbench.reports.rendering.render import build_context, render_html
from kvbench.core.contract import SearchSpec
from kvbench.runs.search import Planner
from kvbench_cli import run_config, tiny_chat_config

ROOT = Path(__file__).resolve().parent.parent
SPEC = {"loop": "closed", "start_users": 1, "max_users": 1024, "growth": 2.0, "target": 0.95,
        "confidence": 0.95, "probe_s": 10.0, "min_requests": 30, "max_probe_s": 60.0,
        "min_class_requests": 5, "refine": 1, "precision": 0.1, "budget_s": 100_000.0,
        "settle_s": 10.0, "confirm": True}


def typed(stages: list[dict]) -> list[StageEntry]:
    """Stages written as run.json holds them, as the contract's entries."""
    return [StageEntry.from_dict(s) for s in stages]


# --------------------------------------------------------------------------- the plan

def search(capacity, spec):
    """The planner against an oracle that passes at or below ``capacity`` users."""
    p = Planner(SearchSpec.from_dict(spec))
    while (probe := p.next()) is not None:
        assert probe.index == len(p.history) and probe.rate_rps is None
        assert isinstance(probe.users, int) and 1 <= probe.users <= spec["max_users"]
        p.record(probe, "pass" if probe.users <= capacity else "fail")
        assert len(p.history) < 200
    return p


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 3000), start=st.integers(1, 64), growth=st.floats(1.2, 4),
       precision=st.floats(0.01, 0.5), max_users=st.integers(64, 2048))
def test_planner_brackets_a_known_concurrency_in_whole_users(capacity, start, growth,
                                                             precision, max_users):
    spec = dict(SPEC, start_users=start, growth=growth, precision=precision,
                max_users=max_users)
    p = search(capacity, spec)
    lo, hi = p.bracket()
    levels = [q.users for q, _ in p.history]
    # every level is probed once, plus its confirmation
    assert len(levels) - len(set(levels)) <= 1
    if capacity == 0:  # even one user fails
        assert lo is None and hi == 1
        return
    if capacity >= max_users:
        assert hi is None and lo == max_users  # nothing failed up to the most allowed
        return
    if capacity < start:
        assert levels[1] < start  # down from the start
    assert lo is not None and hi is not None and lo <= capacity < hi
    assert hi - lo <= 1 or hi / lo - 1 <= precision
    (last, v), = p.history[-1:]
    assert last.role == "confirm" and last.users == lo and v == "pass"


def test_planner_refines_a_straddling_number_of_users():
    p = Planner(SearchSpec.from_dict(dict(SPEC, start_users=8)))
    first = p.next()
    p.record(first, "straddle")
    again = p.next()
    assert (again.users, again.role, again.duration_s) == (8, "refine", first.duration_s)
    # a probe is long enough for min_requests at the throughput the last passing level showed:
    # 8 s per request per user, 8 users answer one request a second: 30 requests take 30 s
    # (the open loop's min_requests / level would give 3.75 s, under the 25-s residence floor)
    p.residence_s = 8.0
    assert p.duration(8) == 30.0
    assert p.duration(16) == 25.0  # 15 s for the requests: the floor (3 residences + 1 s)
    assert p.duration(1) == 60.0  # capped by max_probe_s


# --------------------------------------------------------------------------- the user pool

def test_users_follow_each_stage_and_never_overlap_their_own_requests():
    """Each user sends one request at a time, tagged with the stage it was sent in; a stage
    of more users starts more, one of fewer retires the extra ones, none sends between
    stages; a cancelled stage's users are replaced by the next stage."""
    sent = []  # (stage, user, start, end) in loop-clock seconds
    counts = [3, 6, 2, 4]

    def run_user(u):
        while (stage := d.next_turn(u)) is not None:
            t0 = gevent.get_hub().loop.now()
            try:
                gevent.sleep(0.02)
            finally:
                d.turn_done(u)
            sent.append((stage, id(u), t0, gevent.get_hub().loop.now()))

    stages = [StagePlan(i, 0.3, None, n) for i, n in enumerate(counts)]
    ends = []
    d = ClosedLoopStages(run_user, iter(stages), on_stage=lambda st, a, b: ends.append(st.index))
    runner = gevent.spawn(d.run)
    runner.join(timeout=30)
    d.wait_idle(5)
    d.cancel()
    assert ends == [0, 1, 2, 3]
    df = pd.DataFrame(sent, columns=["stage", "user", "t0", "t1"])
    for i, n in enumerate(counts):
        mine = df[df["stage"] == i]
        assert mine["user"].nunique() == n, (i, mine["user"].nunique())
        # a user's requests never overlap: one in flight at a time
        for _, g in mine.groupby("user"):
            g = g.sort_values("t0")
            assert (g["t0"].to_numpy()[1:] >= g["t1"].to_numpy()[:-1]).all()


def test_a_cancelled_stage_loses_its_users_and_the_next_starts_new_ones():
    started = []

    def run_user(u):
        started.append(id(u))
        while d.next_turn(u) is not None:
            try:
                gevent.sleep(10)  # a long answer: still running when its stage is cut
            finally:
                d.turn_done(u)

    def stages():
        yield StagePlan(0, 0.2, None, 4)
        d.cancel_stage(0)  # the search cut it (a failed probe's stragglers go)
        yield StagePlan(1, 0.2, None, 3)

    d = ClosedLoopStages(run_user, stages())
    gevent.spawn(d.run).join(timeout=30)
    d.cancel()
    assert len(started) == 4 + 3  # the 4 cut users are gone; 3 new ones ran stage 1


def test_a_cut_that_lands_after_the_next_stage_began_leaves_that_stage_its_users():
    """The search publishes a failed probe's cut and the next probe together; the child can
    start the next stage first, keeping the old probe's users (their requests still running),
    and the cut then takes them: the running stage is made up at once (it ran with 23 of its
    181 users in a real bake-off before this)."""
    sending = []  # (stage, user) of every request started
    cancelled = []  # stage of every request a kill ended

    def run_user(u):
        while (stage := d.next_turn(u)) is not None:
            sending.append((stage, id(u)))
            try:
                gevent.sleep(10 if stage == 0 else 0.02)
            except gevent.GreenletExit:
                cancelled.append(stage)
                raise
            finally:
                d.turn_done(u)

    def stages():
        yield StagePlan(0, 0.2, None, 4)
        gevent.spawn_later(0.1, d.cancel_stage, 0)  # the cut, after stage 1 began
        yield StagePlan(1, 0.6, None, 3)

    d = ClosedLoopStages(run_user, stages())
    gevent.spawn(d.run).join(timeout=30)
    cut = list(cancelled)  # (before the end cancels whatever is left)
    d.cancel()
    in_1 = {u for st, u in sending if st == 1}
    assert len(in_1) == 3, sending
    assert not in_1 & {u for st, u in sending if st == 0}  # the cut users are gone
    # all 4 of the cut stage's requests were cancelled: the one whose user stage 1 retired
    # (still in flight when the cut came) too, so no backlog of a failed probe lingers
    assert cut.count(0) == 4, cut


# --------------------------------------------------------------------------- the config

@pytest.mark.parametrize("search, field", [
    ('{ loop = "closed", start_rps = 2.0 }', "start_rps"),
    ('{ start_users = 4 }', "start_users"),
    ('{ loop = "closed", start_users = 64, max_users = 8 }', "start_users"),
    ('{ loop = "closed", start_users = 0 }', "start_users"),
])
def test_closed_loop_settings_in_the_wrong_place_are_one_sentence(tmp_path, search, field):
    p = tmp_path / "bench.toml"
    p.write_text((ROOT / "bench.toml").read_text()
                 + f'\n[profiles.seats]\npacing = "search"\nsearch = {search}\n')
    with pytest.raises(UserError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg and "profiles.seats" in msg and field in msg
    assert msg.count("\n") == 0


def test_summarise_counts_users_for_a_closed_loop_search():
    rows = []
    for stage, n_ok, n_miss in ((0, 40, 0), (1, 40, 0), (2, 30, 10)):
        rows += [(stage, 30.0, True)] * n_ok + [(stage, 900.0, False)] * n_miss
    f = pd.DataFrame(rows, columns=["stage", "ttft_ms", "slo_met"])
    f["request_class"] = pd.Categorical(["chat"] * len(f))
    f["ok"], f["cancelled"], f["has_slo"] = True, False, True
    f["tpot_ms"], f["e2e_ms"], f["completion_tokens"] = 10.0, 1000.0, 10.0
    f["endpoint"], f["workload"] = "ep", "chat"
    stages = [{"endpoint": "ep", "workload": "chat", "index": i, "rate_rps": None,
               "users": n, "pacing": "closed", "duration_s": 10.0,
               "search": {"role": role, "verdict": v}}
              for i, (n, role, v) in enumerate([(8, "ramp", "pass"), (12, "bisect", "pass"),
                                                (16, "ramp", "fail")])]
    (cap,) = C.summarise(typed(stages), f, {"chat": {"ttft_ms": 500}})
    assert cap.unit == "users" and (cap.capacity_rps, cap.fail_rps) == (12, 16)
    # 1.0 at 12 users, 0.75 at 16: 0.95 is crossed at 12.8, whole users: 12
    assert cap.estimate_rps == 12.0
    assert cap.at_capacity["achieved_rps"] == 4.0  # 40 answers over the probe's 10 s


# --------------------------------------------------------------------------- end to end

SEQS = 4
SLO_TTFT_MS = 250

CONFIG = tiny_chat_config("closed-search", SEQS, f"""
[profiles.users]
pacing = "search"
search = {{ loop = "closed", start_users = 2, growth = 2.0, probe_s = 4, min_requests = 12, max_probe_s = 6, min_class_requests = 5, refine = 1, precision = 0.1, budget_s = 45, settle_s = 3 }}
drain_s = 2
""", SLO_TTFT_MS)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    return run_config(tmp_path_factory.mktemp("closed"), CONFIG, "c1", timeout_s=300)


def test_every_probe_is_a_closed_loop_stage_of_its_users(searched):
    run_dir, out = searched
    meta = json.loads((run_dir / "run.json").read_text())
    probes = [s for s in meta["stages"] if s.get("search")]
    assert probes and len(probes) == len(meta["stages"])
    assert all(s["pacing"] == "closed" and s["rate_rps"] is None for s in probes)
    assert probes[0]["users"] == 2 and probes[0]["search"]["role"] == "ramp"
    res = load_results(run_dir)
    req = res.requests.to_pandas()
    for s in probes:  # no more requests of a probe in flight at once than it has users
        mine = req[req["stage"] == s["index"]]
        t0 = mine["t_sent"].to_numpy(np.int64)
        e2e = mine["e2e_ns"].to_numpy(float)
        t1 = t0 + np.where(np.isnan(e2e), 0, e2e).astype(np.int64)
        events = sorted([(t, 1) for t in t0] + [(t, -1) for t in t1], key=lambda e: (e[0], e[1]))
        peak = max(np.cumsum([e[1] for e in events]), default=0)
        assert peak <= s["users"], (s["index"], peak, s["users"])
        # every user of the probe sent (a probe that ran fewer users than it says would
        # overstate the capacity): each answer takes well under the probe's length
        assert len(mine) >= s["users"], (s["index"], len(mine), s["users"])
        # sent within the probe's own window (none between probes)
        assert (t0 >= s["t_start_ns"]).all() and (t0 <= s["t_end_ns"]).all()
    assert "CAPACITY at SLO: tiny x chat:" in out and " users" in out


def test_closed_search_finds_the_concurrency_the_queue_model_predicts(searched):
    """Up to max_num_seqs users nobody waits for a slot; beyond, each request waits about
    (users - seqs) / seqs service times (a closed loop's queue), so TTFT leaves its SLO near
    seqs + seqs x (SLO - unqueued TTFT) / service time."""
    run_dir, _ = searched
    res = load_results(run_dir)
    slo = res.meta.config["slo"]
    f = request_frame(res.requests, stages=res.meta.stages, slo=slo)
    (cap,) = C.summarise(res.meta.stages, f, slo)
    assert cap.unit == "users" and cap.fail_rps is not None, cap
    assert cap.capacity_rps >= SEQS  # no queue at or below the endpoint's slots
    ok = f[f["ok"] & (f["server_queue_ms"] < 1.0)]
    service_s = float(np.median(ok["e2e_ms"])) / 1e3
    first_s = float(np.median(ok["ttft_ms"])) / 1e3
    model = SEQS + SEQS * (SLO_TTFT_MS / 1e3 - first_s) / service_s
    assert 0.6 * model <= cap.estimate_rps <= 1.4 * model + 1, (cap, model, service_s)
    assert cap.breaks["class"] == "chat" and cap.breaks["missed"] == "TTFT"
    # the failing level's misses waited in the server's queue (the model's reason)
    idx = [s.index for s in res.meta.stages if s.users == cap.fail_rps]
    missed = f[np.isin(f["stage"], idx) & f["ok"] & ~f["slo_met"].astype(bool)]
    assert len(missed) and (missed["server_queue_ms"] > 0).mean() > 0.9


def test_report_shows_the_concurrency_at_slo(searched):
    run_dir, _ = searched
    ctx = build_context(load([run_dir]), figures=False)
    (row,) = ctx["capacity"]["rows"]
    assert row["unit"] == "users" and row["loop"] == "closed loop: users"
    assert "req/s answered at" in row["capacity_text"]
    assert float(row["capacity_text"].split()[0]) == row["capacity"]
    assert all(p["rate"].endswith(" users") for p in ctx["capacity"]["probes"])
    html = render_html(ctx)
    assert "closed loop: users" in html


@pytest.mark.parametrize("profile", ["users", "search"])
def test_a_plain_locust_run_of_a_search_profile_fails_at_once(tmp_path, profile):
    """Only kvbench run plans a search's probes: a plain ``locust -f`` of a search profile
    (closed or open loop) had nothing to feed it and ended at --run-time with no record and
    exit 0. It now fails before any load, in one sentence naming the profile and the fix."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / "chat.py"), "--headless",
         "-u", "1", "-r", "1", "-t", "60s", "--host", "http://127.0.0.1:9",
         "--kvbench-model", "m", "--kvbench-config", str(ROOT / "bench.toml"),
         "--kvbench-profile", profile, "--kvbench-results", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert (f"--kvbench-profile {profile}: a capacity search" in out
            and f"kvbench run --config {ROOT / 'bench.toml'} --profile {profile}" in out), out
