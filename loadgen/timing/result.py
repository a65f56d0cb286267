"""One request's outcome as the client measured it (kept apart from the client so the
client's hot path stays one file under the size limit)."""

from __future__ import annotations


class Result:
    """One request's outcome, in record units (ns offsets from ``t_sent_ns``)."""

    __slots__ = ("t_sent_ns", "t_sent_mono_ns", "connect_ns", "ttft_ns", "offsets_ns", "tokens", "e2e_ns",
                 "status", "http_status", "error", "prompt_tokens", "completion_tokens",
                 "completion_tokens_client", "cached_tokens", "text", "server_queue_ns",
                 "server_prefill_ns", "server_kv_transfer_ns", "server_first_decode_ns",
                 "server_replica", "server_region", "retry_after_s", "server_request_id",
                 "resent", "streamed")

    def __init__(self) -> None:
        self.t_sent_ns = 0
        self.t_sent_mono_ns = 0  # perf_counter_ns at the send (CLOCK_MONOTONIC on Linux)
        self.connect_ns = 0
        self.ttft_ns = None
        self.offsets_ns: list[int] = []
        self.tokens: list[int] = []
        self.e2e_ns = None
        self.status = "cancelled"
        self.http_status = None
        self.error = None
        self.prompt_tokens = None
        self.completion_tokens = None
        self.completion_tokens_client = 0
        self.cached_tokens = None
        self.text = ""
        self.server_queue_ns = None
        self.server_prefill_ns = None
        self.server_kv_transfer_ns = None
        self.server_first_decode_ns = None
        self.server_replica = None
        self.retry_after_s = None
        self.server_region = None
        self.server_request_id = None  # the server's X-Request-Id answer
        self.resent = False  # sent again on a fresh connection after a stale pooled one
        self.streamed = True  # False: sent without streaming (its answer one JSON body)
