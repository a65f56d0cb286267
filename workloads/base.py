"""The request a workload produces, and the session interface the load generator drives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

@dataclass(frozen=True, slots=True)
class Request:
    """One request to send. Exactly one of ``prompt`` (completions) or ``messages`` (chat)."""

    request_id: str
    request_class: str
    max_tokens: int
    prompt_tokens: int  # counted with the configured tokenizer (client side)
    shared_prefix_tokens: int  # what the generator meant to be reusable by later requests
    session_id: str
    turn: int = 0
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    arrival_offset_s: float | None = None  # open-loop arrival time from the workload/trace
    think_time_s: float = 0.0  # closed loop: wait before sending this turn
    workload: str = ""
    # The shared prefix holds earlier responses (an agent's history, a hogwild transcript):
    # what the server answers live, which the offline request only stands in for. A warm
    # cache does not prime such a prefix (the live one differs).
    prefix_from_responses: bool = False
    # Agentic replay (issue 36). ``stream=False`` sends the request without streaming (a trace's
    # "type": "n": no TTFT by design). ``parent_session_id``/``subagent_index`` name the session
    # that spawned this one ("" / -1 for a top-level session). ``conversation_offset_s`` is the
    # recorded send time from the conversation's start (the "original timestamps" strategy);
    # ``api_time_s`` the recorded server time of the previous answer, when the trace has it.
    # ``min_tokens`` asks the engine for at least that many tokens (0: not sent).
    stream: bool = True
    parent_session_id: str = ""
    subagent_index: int = -1
    conversation_offset_s: float | None = None
    api_time_s: float | None = None
    min_tokens: int = 0

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True, slots=True)
class Spawn:
    """Sub-agents a session starts (issue 36): the driver runs ``sessions`` concurrently, each
    as its own session, and the parent's next turn waits until all of them are done. A session
    returns it from ``next_request`` in place of a request; drivers without sub-agent support
    run the sessions one after another."""

    sessions: tuple["Session", ...]
    think_time_s: float = 0.0  # wait before starting them (closed loop)


class Session(Protocol):
    """A sticky sequence of turns. Turn k+1 may depend on turn k's real response."""

    session_id: str

    def next_request(self) -> "Request | Spawn | None":
        """The next turn, a ``Spawn`` of sub-agent sessions, or None when the session is over."""

    def feed_response(self, text: str) -> None:
        """The response text the endpoint actually returned for the last request."""


class Workload(Protocol):
    name: str
    request_class: str  # "mix" for a mix; each request carries its own class
    has_arrivals: bool  # True when requests carry arrival_offset_s (traces)

    def sessions(self) -> Iterator[Session]:
        """Deterministic sessions for this seed; single-shot workloads give 1-turn sessions."""

    def requests(self) -> Iterator[Request]:
        """All requests flattened in send order; sessions fed with a synthetic response of
        ``max_tokens`` tokens (used by ``describe`` and for open-loop replay)."""


@dataclass
class SingleTurnSession:
    """A session of one prepared request."""

    request: Request
    session_id: str = field(init=False)
    _done: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.session_id = self.request.session_id

    def next_request(self) -> Request | None:
        if self._done:
            return None
        self._done = True
        return self.request

    def feed_response(self, text: str) -> None:
        pass


def messages_tuple(messages: Sequence[dict]) -> tuple[dict, ...]:
    return tuple(dict(m) for m in messages)
