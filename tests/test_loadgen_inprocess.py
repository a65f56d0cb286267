"""The Locust user, hooks and open-loop dispatcher in this process: a Locust ``Environment`` with
a local runner against the logging test server, no Locust subprocess. The context lives on the
environment (``environment.kvbench``), so two environments never share one."""

import os
from dataclasses import replace

# Locust patches the whole process with gevent at import; the client uses gevent sockets
# itself, so the test process stays unpatched (the variable must not reach later subprocesses).
os.environ["LOCUST_SKIP_MONKEY_PATCH"] = "1"
try:
    import gevent
    import locust
    from locust.argument_parser import get_parser
    from locust.env import Environment
finally:
    del os.environ["LOCUST_SKIP_MONKEY_PATCH"]

import pytest

import stream_server as testing
from kvbench.config import parse_config
from kvbench.core.store import load_results
from kvbench.loadgen.wiring import hooks # noqa: F401 - registers the event listeners
from kvbench.loadgen.wiring.context import LoadContext
from kvbench.loadgen.job import JobUser
from kvbench.loadgen.plan.options import job_from_options
from kvbench.runs import finalize as finalize_module
from kvbench.core.contract import StagePlan as JobStage
from kvbench.runs.job import Job, resolve

CONFIG = {
    "suite": {"name": "inproc", "seed": 3},
    "endpoints": [{"name": "test", "kind": "openai", "url": "http://127.0.0.1:9",
                   "model": "test-model", "topology": "colocated"}],
    "workloads": {
        "chat": {"kind": "chat", "requests": 40,
                 "prompt_tokens": {"dist": "constant", "mean": 30},
                 "output_tokens": {"dist": "constant", "mean": 4}},
        "rag": {"kind": "rag", "requests": 20, "documents": 4,
                "chunk_tokens": {"dist": "constant", "mean": 30},
                "output_tokens": {"dist": "constant", "mean": 4}},
        "mix": {"kind": "mix", "requests": 40, "components": [
            {"workload": "chat", "weight": 2}, {"workload": "rag", "weight": 1}]},
    },
    "profiles": {"closed": {"pacing": "closed", "stages": [{"users": 2, "duration_s": 1}]},
                 "open": {"pacing": "constant", "stages": [{"rate_rps": 20, "duration_s": 1}]}},
}


@pytest.fixture(scope="module")
def server():
    proc, url = testing.start(ttft_ms=5, itl_ms=2)
    yield url
    testing.stop(proc)


def environment(job_file, url) -> Environment:
    opts = get_parser().parse_args(["--headless", "--kvbench-job", str(job_file)])
    env = Environment(user_classes=[JobUser], host=url, events=locust.events,
                      parsed_options=opts)
    runner = env.create_local_runner()
    env.events.init.fire(environment=env, runner=runner, web_ui=None)
    return env


def job_for(tmp_path, url, workload, profile) -> Job:
    return resolve(parse_config(CONFIG), workload=workload, endpoint="test", url=url,
                   profile=profile, run_id=f"{workload}-{profile}", results_dir=tmp_path)


def quit_and_finalize(env) -> None:
    env.runner.quit()
    env.events.quitting.fire(environment=env, reverse=True)


def test_closed_loop_users_record_every_request(server, tmp_path):
    job = job_for(tmp_path, server, "chat", "closed")
    env = environment(job.save(tmp_path / "job.json"), server)
    ctx = env.kvbench  # built by the init hook, before the run starts
    assert isinstance(ctx, LoadContext) and ctx.job == job
    env.runner.start(2, spawn_rate=100)
    gevent.sleep(1.0)
    quit_and_finalize(env)
    res = load_results(job.run_dir)
    n = res.requests.num_rows
    assert n > 0 and res.meta.counts["requests_started"] == res.meta.counts[
        "records_written"] == n
    assert set(res.requests.column("status").to_pylist()) <= {"ok", "cancelled"}
    assert res.meta.stages[0].users == 2 and res.meta.stages[0].profile == "closed"
    assert res.meta.endpoints[0].model == "test-model"
    assert res.meta.suite == "inproc" and res.meta.workloads["chat"]["requests"] == 40
    assert res.meta.workloads_sent["test"]["chat"]
    assert env.stats.get("e2e chat", "LLM").num_requests > 0  # Locust's own stats


def test_open_loop_dispatcher_paces_and_ends_the_run(server, tmp_path, monkeypatch):
    calls = []
    real = finalize_module.finalize  # hooks imports it where a run ends
    monkeypatch.setattr(finalize_module, "finalize",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    job = job_for(tmp_path, server, "mix", "open")
    env = environment(job.save(tmp_path / "job.json"), server)
    env.runner.start(1, spawn_rate=100)
    for _ in range(100):  # the dispatcher quits the runner once its stages are done
        gevent.sleep(0.1)
        if env.runner.state == "stopped":
            break
    assert env.runner.state == "stopped"
    quit_and_finalize(env)
    env.events.quitting.fire(environment=env, reverse=True)  # a second quit finalizes nothing
    assert calls == [1]
    res = load_results(job.run_dir)
    assert 16 <= res.requests.num_rows <= 22  # 20 req/s for 1 s, constant gaps
    assert set(res.requests.column("request_class").to_pylist()) <= {"chat", "rag"}
    assert [s.rate_rps for s in res.meta.stages] == [20.0]
    assert set(res.meta.workloads_sent["test"]) == {"mix"}


def test_each_environment_has_its_own_context(server, tmp_path):
    a = job_for(tmp_path / "a", server, "chat", "closed")
    b = job_for(tmp_path / "b", server, "rag", "closed")
    env_a = environment(a.save(tmp_path / "a.json"), server)
    env_b = environment(b.save(tmp_path / "b.json"), server)
    try:
        assert env_a.kvbench is not env_b.kvbench
        assert env_a.kvbench.workload_name == "chat" and env_b.kvbench.workload_name == "rag"
    finally:
        for env in (env_a, env_b):
            env.kvbench.close()


def test_plain_options_resolve_the_same_job(server, tmp_path):
    from kvbench.config import load_config

    cfg = tmp_path / "bench.toml"
    cfg.write_text(f"""
[suite]
name = "plain"
seed = 5

[[endpoints]]
name = "test"
kind = "openai"
url = "{server}"
topology = "colocated"

[workloads.chat]
kind = "chat"
requests = 10

[profiles.open]
pacing = "poisson"
stages = [ {{ rate_rps = 4.0, duration_s = 2 }} ]
""")
    opts = get_parser().parse_args([
        "--headless", "--kvbench-config", str(cfg), "--kvbench-endpoint", "test",
        "--kvbench-profile", "open", "--kvbench-run-id", "p1", "--kvbench-results",
        str(tmp_path), "--kvbench-rates", "2,6", "--kvbench-stage-duration", "3"])
    job = job_from_options(opts, None, "chat")
    assert job == resolve(load_config(cfg), workload="chat", endpoint="test", profile="open",
                          run_id="p1", results_dir=tmp_path,
                          stages=[JobStage(0, 3.0, 2.0), JobStage(1, 3.0, 6.0)])
    assert job.endpoint.model == "test-model"  # the first of the server's /v1/models
    assert job.pacing == "poisson" and job.seed == 5 and job.suite == "plain"
    assert Job.from_dict(job.to_dict()) == job
    from kvbench.workloads.registry import make_workload

    built = [(r.request_id, r.prompt) for r in job.build_workload().requests()]
    assert built == [(r.request_id, r.prompt)
                     for r in make_workload("chat", load_config(cfg)).requests()]


def _established_to(url: str) -> int:
    """This process's TCP connections to the server at ``url`` (ESTABLISHED)."""
    import psutil  # Locust's own dependency

    port = int(url.rsplit(":", 1)[1])
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_closed_loop_connections_open_before_the_first_user_starts(server, tmp_path):
    """Every user's keep-alive connection is opened at the test's start, before the stage's
    loop-lag clock: with a slow ramp (one user a second) all four are up while at most one
    user runs, and each user sends on one of them (no request pays a connection)."""
    users = 4
    job = job_for(tmp_path, server, "chat", "closed")
    job = replace(job, stages=[JobStage(index=0, duration_s=1.0, users=users)])
    env = environment(job.save(tmp_path / "job.json"), server)
    before = _established_to(server)
    env.runner.start(users, spawn_rate=1)
    gevent.sleep(0.2)
    assert env.runner.user_count <= 1
    assert _established_to(server) - before >= users
    gevent.sleep(3.5)  # the ramp completes
    quit_and_finalize(env)
    res = load_results(job.run_dir)
    assert res.requests.num_rows > 0
    assert set(res.requests.column("connect_ns").to_pylist()) == {0}


def test_answers_ending_together_do_not_stall_the_loop_in_one_pass(server, tmp_path,
                                                                   monkeypatch):
    """256 answers whose last bytes arrive at the same instant (sockets readable in one poll),
    each with 0.1 ms of bookkeeping after it (Locust's events, the next request): run in the
    one pass of the loop that read them, that is 25.6 ms of the process's own CPU with every
    other stream and timer waiting. kvbench yields to the loop after each answer's record,
    so the rest runs in slices with the loop's timers between them. Asserted on the own-CPU
    part of the largest pause, which a busy host cannot inflate (rounds after the first: the
    loop's poll array grows to hold all 256 sockets)."""
    import itertools
    import time

    from kvbench.loadgen.timing.looplag import LoopLag

    job = job_for(tmp_path, server, "chat", "closed")
    env = environment(job.save(tmp_path / "job.json"), server)
    ctx = env.kvbench
    n, rounds = 256, 4
    pairs = [gevent.socket.socketpair() for _ in range(n)]

    class Answered:
        def __init__(self, sock):
            self.sock = sock

        def post_stream(self, path, body, *, keep_text, res, request_id, max_tokens, **_):
            self.sock.recv(1)  # the answer's last bytes
            res.status, res.t_sent_ns, res.e2e_ns, res.ttft_ns = "ok", time.time_ns(), 1, 1

    def bookkeeping(req, res):
        t0 = time.process_time_ns()
        while time.process_time_ns() - t0 < 100_000:
            pass

    monkeypatch.setattr(ctx, "report", bookkeeping)
    reqs = itertools.cycle(list(ctx.workload.requests()))

    def stream(sock):
        client = Answered(sock)
        for _ in range(rounds):
            ctx.send(client, next(reqs), None, 0)

    greenlets = [gevent.spawn(stream, b) for _, b in pairs]
    lag = LoopLag().start()
    own = []
    try:
        for _ in range(rounds):
            gevent.sleep(0.1)  # every stream waiting for its answer
            lag.reset()
            for a, _ in pairs:
                a.sendall(b"x")  # every answer ends now
            gevent.sleep(0.1)  # the firing after the last slice measures it
            out = lag.take()
            own.append(out["loop_pause_max_ms"] - out["loop_pause_max_offcpu_ms"])
        gevent.joinall(greenlets, timeout=10)
    finally:
        lag.stop()
        for a, b in pairs:
            a.close()
            b.close()
    assert all(g.successful() for g in greenlets)
    assert max(own[1:]) < 15, own  # one pass: >= 25.6 ms; slices: about 5 ms
    quit_and_finalize(env)
