"""The Locust User behind every locustfile. Closed loop: each user runs one session at a time
(``plan.sessions``: think times, sub-agents run concurrently within the user).
Open loop: the process's first user runs the dispatcher. At the stage's end (Locust stopping
the users) nothing new starts; what is in flight drains for up to the drain bound."""

from __future__ import annotations

import gevent
from locust import User, task
from locust.exception import StopUser

from kvbench.core.errors import UserError
from kvbench.loadgen.wiring import hooks # noqa: F401 - registers the event listeners
from kvbench.loadgen.wiring import webtab # noqa: F401 - the web UI's kvbench tab
from kvbench.loadgen.wiring.context import fail, get_context, quit_soon


class KVBenchUser(User):
    """Closed loop: each user runs one session at a time (think times between turns, turn k+1
    built from turn k's response). Open loop: the process's first user runs the dispatcher;
    more users add nothing (use one user per process)."""

    abstract = True
    kvbench_user = True  # the hooks act for these classes only
    workload = "chat"  # [workloads.<name>] of the config, or the kind with its defaults

    def wait_time(self):
        return 0

    def on_start(self) -> None:
        try:
            self.ctx = get_context(self.environment, type(self))
        except UserError as exc:
            # reported once, in one sentence; the user stops in its task (a StopUser raised
            # here would print Locust's traceback of on_start)
            fail(self.environment, exc)
            self.ctx = None
            return
        self.stage = self.ctx.stage_index
        if self.ctx.pacing == "closed":
            self.llm = self.ctx.new_client()
            if self.ctx.warm and not self.ctx.adopt_warm(self.llm.pool):
                self.llm.pool.warm(1)
            self.driver = self.ctx.session_driver(self._send, self.ctx.stopping)

    @task
    def drive(self) -> None:
        ctx = self.ctx
        if ctx is None or ctx.stopping.is_set():  # the stage is over: in flight ones drain, nothing new
            raise StopUser()
        if ctx.pacing != "closed":
            if ctx.dispatcher is None:
                try:
                    ctx.run_dispatcher()
                finally:
                    ctx.dispatched.set()
                quit_soon(self.environment)
            ctx.dispatched.wait()  # more users add nothing: they wait for the dispatcher
            raise StopUser()
        session = ctx.next_session()
        if session is None:
            ctx.stopping.wait(1.0)
            return
        self.driver.run(session)

    def _send(self, req, t_scheduled_ns):
        """One request of a session (sub-agents' included); None once no more may go."""
        if not self.ctx.claim():  # the stage's (or run's) request count was sent
            return None
        return self.ctx.send(self.llm, req, t_scheduled_ns, self.stage, keep_text=True)
