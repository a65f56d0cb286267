"""The closed-loop session driver: one user replays one session at a time, each request sent
after the previous answer, when the replay strategy says (issue 36).

A session's ``next_request`` gives a request, a ``Spawn`` of sub-agent sessions, or None. A
``Spawn`` starts its sessions at once, each as its own greenlet of the same user sending its own
requests one after another; the parent's next turn waits until every one of them is done (a
sub-agent that failed is done too: the parent's next turn is built on its own answers only).
Sub-agent requests carry their parent's session id and their index among the siblings.

When a request goes (``replay``; every recorded time is multiplied by ``time_scale``):

* ``think``: ``think_time_s`` after the previous answer of the session (none before its first
  request); the intended send is the actual one (``t_scheduled`` = ``t_sent``).
* ``timestamps``: at the session's start + ``conversation_offset_s`` (the recorded send time
  from the conversation's start; a sub-agent's from its own start), at once when that time
  has passed: ``t_scheduled`` keeps the intended time, so the lateness a slow endpoint causes
  is recorded (the backlog of a real user who would have sent on time). A request without an
  offset falls back to ``think``.
* ``api_scaled``: the recorded gap between two sends, the previous answer's recorded server
  time (``api_time_s``) plus ``think_time_s``, counted from the previous send and never before
  the previous answer came; ``t_scheduled`` is the intended time (a slower endpoint than the
  recorded one shows as lateness). A request without ``api_time_s`` falls back to ``think``.

A ``Spawn``'s own ``think_time_s`` (scaled) is waited before its sessions start, whatever the
strategy; the turn after a ``Spawn`` counts its think time from the last sub-agent's end.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import gevent

from kvbench.workloads.base import Spawn

REPLAYS = ("think", "timestamps", "api_scaled")


class SessionDriver:
    """Drives sessions for one user. ``send(req, t_scheduled_ns)`` sends one request and
    returns its result (``.status``, ``.text``, ``.t_sent_ns``), or None when no more may be
    sent (the stage's or run's count was reached, the user retired): the session then ends
    and ``run`` returns False. ``stopped`` (an event) ends every wait at once."""

    def __init__(self, send: Callable, stopped, *, replay: str = "think",
                 time_scale: float = 1.0, clock: Callable[[], int] = time.time_ns) -> None:
        if replay not in REPLAYS:
            raise ValueError(f"replay {replay!r}: use one of {', '.join(REPLAYS)}")
        if not time_scale > 0:
            raise ValueError(f"time_scale {time_scale!r}: give a factor above 0")
        self.send = send
        self.stopped = stopped
        self.replay = replay
        self.scale = float(time_scale)
        self.clock = clock
        self.refused = False  # ``send`` said no more: every session of this driver ends

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` (scaled already); True when the stop came first."""
        if seconds <= 0:
            return self.stopped.is_set()
        return bool(self.stopped.wait(seconds))

    def _when(self, req, t0_ns: int, prev_sent: int | None, prev_end: int | None
              ) -> tuple[float, int | None]:
        """``(seconds to wait, t_scheduled_ns or None)`` for ``req``."""
        now = self.clock()
        if self.replay == "timestamps" and req.conversation_offset_s is not None:
            due = t0_ns + int(req.conversation_offset_s * self.scale * 1e9)
            return max(0.0, (due - now) / 1e9), due
        if self.replay == "api_scaled" and req.api_time_s is not None and prev_sent is not None:
            gap = (req.api_time_s + max(0.0, req.think_time_s)) * self.scale
            due = prev_sent + int(gap * 1e9)
            return max(0.0, (due - now) / 1e9), due
        if prev_end is not None and req.think_time_s > 0:
            return max(0.0, req.think_time_s * self.scale - (now - prev_end) / 1e9), None
        return 0.0, None

    def run(self, session, parent_session_id: str = "", subagent_index: int = -1) -> bool:
        """Replay ``session`` to its end (or its first failed answer); False when it ended
        because no more may be sent or the stop came."""
        if not parent_session_id:
            self.refused = False
        t0 = self.clock()
        prev_sent = prev_end = None
        subs: list = []
        try:
            while not (self.stopped.is_set() or self.refused):
                item = session.next_request()
                if item is None:
                    return True
                if isinstance(item, Spawn):
                    if self._wait(item.think_time_s * self.scale):
                        return False
                    subs = [gevent.spawn(self.run, s, session.session_id, i)
                            for i, s in enumerate(item.sessions)]
                    gevent.joinall(subs)
                    subs = []
                    prev_end = self.clock()
                    continue
                req = item
                if parent_session_id and not req.parent_session_id:
                    req = replace(req, parent_session_id=parent_session_id,
                                  subagent_index=subagent_index)
                wait_s, t_sched = self._when(req, t0, prev_sent, prev_end)
                if self._wait(wait_s):
                    return False
                res = self.send(req, t_sched)
                if res is None:
                    self.refused = True
                    return False
                prev_sent, prev_end = res.t_sent_ns, self.clock()
                if res.status != "ok":
                    return True  # a session cannot build its next turn on a failed answer
                session.feed_response(res.text)
            return False
        finally:
            if subs:  # the user was stopped while its sub-agents ran: they stop too
                gevent.killall(subs, block=True)
