"""Results schema, version 1: the one place that knows the columns of every results table.

Layout of a run (``results/<run_id>/``):

* ``requests/endpoint=<e>/workload=<w>/part-<n>.parquet``: one row per request started
  (``REQUESTS``), a Hive-partitioned dataset (``kvbench.core.layout``; runs of layout 1: one
  ``requests.parquet``);
  while a run is live, each load process appends to ``requests-<host>-<pid>.rows`` (msgpack
  column lists with no types, ``kvbench.core.rows``, so the load process needs no pyarrow;
  readable up to its last complete batch) and the shards are typed by this module and
  compacted into the dataset at the end;
* ``gpu.parquet``: telemetry samples per GPU (``GPU``), from NVML or the DCGM exporter;
* ``engine.parquet``: raw engine ``/metrics`` samples (``ENGINE``), counters kept raw;
  while a run is live, the collectors append GPU and engine samples (the OTLP receiver its
  ``SPANS``) to ``<table>-<host>-<pid>.arrows`` (Arrow IPC streams), compacted the same way;
* ``run.json``: resolved config, versions, git commit, hosts, clock offsets, start/end,
  what was incomplete and why; ``schema_version`` must equal ``SCHEMA_VERSION``.

Times: ``t_scheduled`` and ``t_sent`` are Unix epoch ns; every other ``*_ns`` request time is an
offset from ``t_sent`` taken on a monotonic clock. Telemetry ``t_ns`` is Unix epoch ns.
"""

from __future__ import annotations

import pyarrow as pa

from kvbench.core.contract import SCHEMA_VERSION  # noqa: E402,F401 - one place

STATUSES = ("ok", "http_error", "timeout", "disconnected", "protocol_error", "cancelled")

REQUESTS = pa.schema([
    # identity
    ("run_id", pa.string()),
    ("endpoint", pa.string()),
    ("topology", pa.string()),
    ("workload", pa.string()),
    ("request_class", pa.string()),
    ("stage", pa.int32()),  # index of the load stage (QPS ladder step); 0 when one stage
    ("request_id", pa.string()),
    ("session_id", pa.string()),
    ("turn", pa.int32()),
    ("worker", pa.string()),  # host:pid
    # shape
    ("prompt_tokens", pa.int64()),  # as the server reported (null when it did not)
    ("prompt_tokens_client", pa.int64()),
    ("shared_prefix_tokens", pa.int64()),
    ("max_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),  # server usage; client count when usage is absent
    ("completion_tokens_client", pa.int64()),
    ("cached_tokens", pa.int64()),  # usage.prompt_tokens_details.cached_tokens, null if absent
    # timing
    ("t_scheduled", pa.int64()),  # epoch ns: when the pacing meant to send it
    ("t_sent", pa.int64()),  # epoch ns: when the request bytes were written
    ("connect_ns", pa.int64()),  # connection setup charged to this request (0 when reused)
    ("ttft_ns", pa.int64()),  # first chunk carrying a generated token, from t_sent
    ("chunk_offsets_ns", pa.list_(pa.int64())),  # arrival of each token-carrying chunk
    ("chunk_tokens", pa.list_(pa.int32())),  # tokens in each such chunk
    ("e2e_ns", pa.int64()),  # last byte of the response, from t_sent
    ("status", pa.string()),
    ("http_status", pa.int32()),
    ("error", pa.string()),
    # server side, when the endpoint tells (response headers)
    ("server_queue_ns", pa.int64()),
    ("server_prefill_ns", pa.int64()),
    ("server_kv_transfer_ns", pa.int64()),
    ("server_first_decode_ns", pa.int64()),
    ("server_replica", pa.string()),
    ("server_region", pa.string()),
    ("retry_after_s", pa.float64()),  # the server's Retry-After (seconds), when it sent one
    # the request id the server answered with (X-Request-Id); the client sends the record's
    # request_id as X-Request-Id, so records join the server's logs and traces
    ("server_request_id", pa.string()),
    # agentic replay (issue 36): False when the request was sent without streaming (its answer
    # one JSON body: no chunks and no TTFT by design); null in runs written before it, which
    # streamed every request. The session that spawned this one ("" for a top-level session)
    # and the sub-agent's index among its siblings (-1 for a top-level session). Columns are
    # only ever added at the end: a file without them reads them as nulls (``core.shards``).
    ("streamed", pa.bool_()),
    ("parent_session_id", pa.string()),
    ("subagent_index", pa.int32()),
])

GPU = pa.schema([
    ("t_ns", pa.int64()),
    ("host", pa.string()),
    ("gpu", pa.int32()),
    ("role", pa.string()),  # prefill | decode | colocated | cache | unknown
    ("source", pa.string()),  # nvml | dcgm
    ("endpoint", pa.string()),
    ("gpu_util_pct", pa.float64()),
    ("mem_util_pct", pa.float64()),  # memory-controller busy
    ("sm_active", pa.float64()),  # 0..1 (GPM / DCGM_FI_PROF_SM_ACTIVE)
    ("sm_occupancy", pa.float64()),  # 0..1
    ("dram_active", pa.float64()),  # 0..1 (HBM bandwidth utilisation)
    ("hbm_used_bytes", pa.int64()),
    ("hbm_total_bytes", pa.int64()),
    ("power_w", pa.float64()),
    ("sm_clock_mhz", pa.float64()),
    ("temperature_c", pa.float64()),
    ("pcie_rx_bytes_s", pa.float64()),
    ("pcie_tx_bytes_s", pa.float64()),
    ("nvlink_rx_bytes", pa.int64()),
    ("nvlink_tx_bytes", pa.int64()),
])

ENGINE = pa.schema([
    ("t_ns", pa.int64()),
    ("endpoint", pa.string()),
    ("metric", pa.string()),  # sample name, e.g. vllm:prefix_cache_hits_total
    ("labels", pa.map_(pa.string(), pa.string())),
    ("value", pa.float64()),
])

# One row per request span a server exported over OTLP during the run (vLLM's ``llm_request``
# spans: its own queue, prefill and decode times); joined to records by request id in reports.
SPANS = pa.schema([
    ("t_ns", pa.int64()),  # span start, epoch ns (the server's clock)
    ("service", pa.string()),  # the exporting resource's service.name
    ("span_name", pa.string()),
    ("trace_request_id", pa.string()),  # gen_ai.request.id as the server wrote it
    ("queue_ns", pa.int64()),
    ("prefill_ns", pa.int64()),
    ("decode_ns", pa.int64()),
    ("ttft_ns", pa.int64()),  # the server's own time to first token
    ("e2e_ns", pa.int64()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
])

TABLES = {"requests": REQUESTS, "gpu": GPU, "engine": ENGINE, "spans": SPANS}


def empty_table(name: str) -> pa.Table:
    return TABLES[name].empty_table()
