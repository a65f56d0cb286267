"""With ``suite.parallel_endpoints`` each endpoint's jobs run in a lane of their own: every line
a lane says names its endpoint x workload, and two lanes never share a line."""

from __future__ import annotations

import io
import threading

from kvbench.commands.run import Console
from kvbench.runs.orchestrate import MatrixRun
from kvbench.runs.search import console
from kvbench.runs.search.control import Probe


def test_every_line_of_a_lane_names_it_and_lines_stay_whole():
    out = io.StringIO()
    lanes = ["colocated x mix", "offloaded x mix", "disaggregated x longdoc"]
    start = threading.Barrier(len(lanes))

    def lane(name: str) -> None:
        with console.lane(name):
            start.wait()
            for k in range(200):
                console.emit(console.probe_line(Probe(k, 3.0, 6.0, "ramp"), "pass", "ok"), out)

    threads = [threading.Thread(target=lane, args=(n,)) for n in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.getvalue().splitlines()
    assert len(lines) == 200 * len(lanes)
    for name in lanes:
        mine = [x for x in lines if x.startswith(f"    [{name}] probe ")]
        assert len(mine) == 200
        assert {int(x.split("probe ")[1].split()[0]) for x in mine} == set(range(1, 201))
    console.emit("    probe 1 (ramp) 3 req/s", out)  # outside a lane: as it was
    assert out.getvalue().splitlines()[-1] == "    probe 1 (ramp) 3 req/s"


def test_a_lines_own_label_is_not_repeated():
    with console.lane("colocated x mix"):
        assert console.tagged("[1/6] colocated x mix (search) ...") == \
            "[1/6] colocated x mix (search) ..."
        assert console.tagged("[1/6] cache: warm") == "[colocated x mix] [1/6] cache: warm"


def test_side_by_side_jobs_say_their_lines_in_their_lane(capsys, monkeypatch):
    """``MatrixRun.one`` in a lane (``quiet``): the job's cache line (kvbench run's Console)
    and the search's probe lines (``console.say``) both name endpoint x workload."""
    run = MatrixRun.__new__(MatrixRun)
    run.console = Console()

    class _Ep:
        name = "offloaded"

    class _Job:
        endpoint = _Ep()
        workload = "mix"

    def fake_one(self, k, job, wls, quiet):
        self.console.job_cache(k, 6, "warm: empty")
        console.say(console.probe_line(Probe(0, 3.0, 10.0, "ramp"), "pass", "ok"))

    monkeypatch.setattr(MatrixRun, "_one", fake_one)
    run.one(5, _Job(), {}, quiet=True)
    run.one(5, _Job(), {}, quiet=False)  # one endpoint at a time: lines as they were
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[offloaded x mix] [5/6] cache: warm: empty",
                     "    [offloaded x mix] probe 1 (ramp) 3 req/s, 10 s: PASS: ok",
                     "[5/6] cache: warm: empty",
                     "    probe 1 (ramp) 3 req/s, 10 s: PASS: ok"]
