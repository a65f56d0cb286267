"""The OTLP/HTTP receiver against real exports of the OpenTelemetry SDK: spans shaped as vLLM
writes them (``llm_request``, ``gen_ai.*`` attributes in seconds, the request id as vLLM forms it
from X-Request-Id) land in the run's spans table and join the records by request id, so the
report splits TTFT into the server's queue, prefill and front end and what lies outside it."""

import gzip
import urllib.error
import urllib.request

import pyarrow as pa
import pytest

from kvbench.core.schema import REQUESTS
from kvbench.core.store import read_table
from kvbench.reports.analysis import server_traces as T
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.runs.otlp import OtlpReceiver, rows_of

sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk (test extra)")
otlp_http = pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                                reason="opentelemetry-exporter-otlp-proto-http (test extra)")


def export(url, spans, compression=None):
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = sdk.TracerProvider(resource=Resource.create({"service.name": "vllm"}))
    exporter = otlp_http.OTLPSpanExporter(
        endpoint=url, compression=Compression.Gzip if compression else Compression.NoCompression)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.llm_engine")
    for rid, attrs in spans:
        with tracer.start_as_current_span("llm_request") as span:
            if rid is not None:
                span.set_attribute("gen_ai.request.id", rid)
            for k, v in attrs.items():
                span.set_attribute(k, v)
    provider.shutdown()


def vllm_attrs(queue_s, prefill_s, ttft_s, decode_s=0.05):
    return {"gen_ai.latency.time_in_queue": queue_s,
            "gen_ai.latency.time_in_model_prefill": prefill_s,
            "gen_ai.latency.time_to_first_token": ttft_s,
            "gen_ai.latency.time_in_model_decode": decode_s,
            "gen_ai.latency.e2e": ttft_s + decode_s,
            "gen_ai.usage.prompt_tokens": 100, "gen_ai.usage.completion_tokens": 8}


def records(rows):
    n = len(rows)
    cols = {f.name: pa.nulls(n, f.type) for f in REQUESTS}
    cols["request_id"] = pa.array([r[0] for r in rows], pa.string())
    cols["server_request_id"] = pa.array([r[0] for r in rows], pa.string())
    cols["endpoint"] = pa.array([r[1] for r in rows], pa.string())
    cols["status"] = pa.array(["ok"] * n, pa.string())
    cols["ttft_ns"] = pa.array([r[2] for r in rows], pa.int64())
    return pa.table(cols, schema=REQUESTS)


def test_sdk_exports_join_records_and_split_ttft(tmp_path):
    rec = OtlpReceiver(tmp_path, port=0).start()
    try:
        export(rec.url, [("cmpl-mix-000001-0", vllm_attrs(0.010, 0.200, 0.215)),
                         ("chatcmpl-rag-000002", vllm_attrs(0.030, 0.100, 0.140)),
                         (None, {"http.method": "POST"})])  # not a request span: skipped
        export(rec.url, [("cmpl-mix-000003#1-0", vllm_attrs(0.020, 0.300, 0.330))],
               compression="gzip")
    finally:
        seen = rec.stop()
    assert seen == {"spans": 3, "exports": 4, "rejected": []}
    spans = read_table(tmp_path, "spans")
    assert sorted(spans["trace_request_id"].to_pylist()) == [
        "chatcmpl-rag-000002", "cmpl-mix-000001-0", "cmpl-mix-000003#1-0"]
    assert set(spans["service"].to_pylist()) == {"vllm"}
    req = records([("mix-000001", "vllm-a", 250_000_000), ("rag-000002", "vllm-a", 160_000_000),
                   ("mix-000003#1", "vllm-b", 400_000_000), ("mix-000004", "vllm-b", 1)])
    joined = T.join(req, spans)
    assert sorted(joined["request_id"]) == ["mix-000001", "mix-000003#1", "rag-000002"]
    by = {r["endpoint"]: r for r in T.breakdown(joined)}
    b = by["vllm-b"]
    assert b["requests"] == 1 and b["queue_ms"] == pytest.approx(20.0)
    assert b["prefill_ms"] == pytest.approx(300.0) and b["frontend_ms"] == pytest.approx(10.0)
    assert b["outside_ms"] == pytest.approx(70.0) and b["client_ttft_ms"] == pytest.approx(400)
    a = by["vllm-a"]
    assert a["requests"] == 2 and a["queue_ms"] == pytest.approx(20.0)  # median of 10 and 30


def test_rejects_what_is_not_otlp_protobuf(tmp_path):
    rec = OtlpReceiver(tmp_path, port=0).start()
    try:
        def post(body, ctype, path="/v1/traces", enc=None):
            req = urllib.request.Request(rec.url.replace("/v1/traces", path), data=body,
                                         headers={"Content-Type": ctype,
                                                  **({"Content-Encoding": enc} if enc else {})})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()

        code, body = post(b"{}", "application/json")
        assert code == 415 and b"http/protobuf" in body
        assert post(b"\xff\xff\xff", "application/x-protobuf")[0] == 400
        assert post(gzip.compress(b""), "application/x-protobuf", enc="gzip")[0] == 200
        assert post(b"", "application/x-protobuf", path="/v1/metrics")[0] == 404
    finally:
        seen = rec.stop()
    assert seen["spans"] == 0 and len(seen["rejected"]) == 1


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_decoder_refuses_garbage_with_one_error_type(body):
    try:
        rows = rows_of(body)
    except ValueError:
        return
    assert all(isinstance(r["trace_request_id"], str) for r in rows)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_id_candidates_are_the_id_then_shorter_prefixes(span_id):
    got = list(T.candidates(span_id))
    assert got[0] == span_id
    assert all(len(b) < len(a) for a, b in zip(got, got[1:]))


def test_id_candidates():
    assert list(T.candidates("cmpl-rag-000002-0")) == [
        "cmpl-rag-000002-0", "rag-000002-0", "rag-000002", "rag"]
    assert list(T.candidates("abc")) == ["abc"]


def test_a_repeated_id_joins_the_record_sent_nearest_the_span():
    """A run whose jobs replay one workload sends each request id once per job (vLLM sees the
    same X-Request-Id again): each span joins the record of its own job, by send time."""
    from kvbench.core.schema import SPANS

    req = records([("rag-000000", "vllm", 300), ("rag-000001", "vllm", 100),
                   ("rag-000000", "vllm", 200)])
    req = req.set_column(req.schema.get_field_index("t_sent"), "t_sent",
                         pa.array([1_000, 2_000, 60_000_000_000], pa.int64()))
    spans = pa.Table.from_pylist([
        {"t_ns": 60_000_050_000, "trace_request_id": "cmpl-rag-000000-0", "ttft_ns": 150},
        {"t_ns": 1_050, "trace_request_id": "cmpl-rag-000000-0", "ttft_ns": 250},
        {"t_ns": 2_050, "trace_request_id": "cmpl-rag-000001-0", "ttft_ns": 90}], schema=SPANS)
    joined = T.join(req, spans).sort_values("ttft_ns")
    assert joined["ttft_ns"].tolist() == [100, 200, 300]  # every record once
    assert joined["server_ttft_ns"].tolist() == [90, 150, 250]  # each with its own span
