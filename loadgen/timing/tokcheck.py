"""Does the server count the prompt tokens the client planned? Checked on the first responses
of a plain ``locust -f`` run (``kvbench run`` checks in its preflight, before any load).

A workload sizes its prompts with the configured tokenizer; with the wrong one (the built-in
tokenizer against a Llama server counted 2.82x the planned tokens) every prompt length, cache hit
ratio and TTFT of the run belongs to another workload. So by default the run stops at the first
responses, with the ratio and the fix; ``--kvbench-tokenizer-check warn`` runs on after one loud
warning (the records still hold both counts: ``prompt_tokens`` and ``prompt_tokens_client``).
"""

from __future__ import annotations

import logging

from locust import events

from kvbench.core.errors import UserError

log = logging.getLogger("kvbench.loadgen")

CHECK_RESPONSES = 3  # responses with usage compared before deciding
TOLERANCE = 0.01  # relative, as preflight's TOKEN_COUNT_TOLERANCE
MODES = ("stop", "warn", "off")


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    parser.add_argument(
        "--kvbench-tokenizer-check", env_var="KVBENCH_TOKENIZER_CHECK", default="stop",
        choices=MODES, help="when the server counts prompt tokens more than 1%% off the "
                            "client's plan: stop the run (default), warn once, or off")


class TokenCheck:
    """Sums the planned and the server's prompt tokens of the first ``CHECK_RESPONSES``
    responses that report usage, then decides once."""

    def __init__(self, tokenizer_name: str, mode: str = "stop") -> None:
        self.tokenizer_name = tokenizer_name
        self.mode = mode
        self.planned = 0
        self.served = 0
        self.seen = 0
        self.decided = False
        self.ratio: float | None = None

    def observe(self, planned: int | None, served: int | None) -> UserError | None:
        """Feed one response; returns the error to stop the run with, once, when the counts
        disagree and the mode is ``stop`` (``warn`` logs it instead)."""
        if self.decided or not planned or served is None:
            return None
        self.planned += planned
        self.served += served
        self.seen += 1
        if self.seen < CHECK_RESPONSES:
            return None
        self.decided = True
        self.ratio = self.served / self.planned
        if abs(self.ratio - 1.0) <= TOLERANCE:
            return None
        text = self.message()
        if self.mode == "stop":
            return UserError(f"{text}; or pass --kvbench-tokenizer-check warn to run anyway")
        log.warning("kvbench: WARNING: %s. The run goes on (--kvbench-tokenizer-check warn): "
                    "its prompts are not the sizes the workload planned", text)
        return None

    def message(self) -> str:
        return (f"the server counted {self.ratio:.2f}x the prompt tokens the client planned "
                f"({self.served:,} vs {self.planned:,} over the first {self.seen} responses): "
                f"prompts were sized with the tokenizer {self.tokenizer_name}, not the model's; "
                "set suite.tokenizer to the model's tokenizer.json (a file or its directory) in "
                "a bench.toml and pass it with --kvbench-config")


def for_environment(environment, tokenizer_name: str) -> TokenCheck | None:
    """The check of a plain locustfile run; None under ``kvbench run`` (a job file: its
    preflight checked) or with ``--kvbench-tokenizer-check off``."""
    o = getattr(environment, "parsed_options", None)
    if o is None or getattr(o, "kvbench_job", ""):
        return None
    mode = getattr(o, "kvbench_tokenizer_check", "stop") or "stop"
    return None if mode == "off" else TokenCheck(tokenizer_name, mode)
