"""The streaming client against a server that logs the send time of every chunk."""

import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.loadgen.timing.client import ChunkedDecoder

ROOT = Path(__file__).resolve().parent.parent

# The client runs in its own process (gevent, one core), the server in another, like a real run.
SCRIPT = textwrap.dedent("""
    from gevent import monkey; monkey.patch_all()
    import sys, orjson, urllib.request
    import gevent
    import stream_server as testing
    from kvbench.loadgen.timing.client import ConnectionPool, StreamingClient, Target
    proc, url = testing.start(ttft_ms=40, itl_ms=10)
    out = {}
    try:
        pool = ConnectionPool(Target.parse(url))
        assert pool.warm(2) == 2
        c = StreamingClient(pool, deadline_s=10)
        body = orjson.dumps({"model": "test-model", "prompt": "a b c", "max_tokens": 30,
                             "stream": True, "stream_options": {"include_usage": True}})
        rows = []
        for i in range(6):  # light load: one request at a time
            r = c.post_stream("/v1/completions", body, headers={"x-request-id": f"r{i}"})
            rows.append({"id": f"r{i}", "t0": r.t_sent_mono_ns, "offs": r.offsets_ns,
                         "ttft": r.ttft_ns, "status": r.status, "connect": r.connect_ns,
                         "ct": r.completion_tokens, "pt": r.prompt_tokens,
                         "q": r.server_queue_ns, "replica": r.server_replica})
        out["light"] = rows
        cold = ConnectionPool(Target.parse(url), cold=True)
        r = StreamingClient(cold).post_stream("/v1/completions", body,
                                              headers={"x-request-id": "cold"})
        out["cold_connect"] = r.connect_ns
        out["cold_status"] = r.status
        fast = StreamingClient(pool, deadline_s=0.3)
        r = fast.post_stream("/v1/completions", body, headers={"x-test-fault": "hang"})
        out["deadline"] = [r.status, r.error]
        # read timeout: one timer a request, re-armed from the last read; a 340 ms stream
        # whose gaps are all under 150 ms is fine, silence after the headers is not
        idle = StreamingClient(ConnectionPool(Target.parse(url), read_timeout_s=0.15),
                               deadline_s=10)
        r = idle.post_stream("/v1/completions", body)
        out["idle_ok"] = [r.status, len(r.offsets_ns), r.e2e_ns]
        r = idle.post_stream("/v1/completions", body, headers={"x-test-fault": "hang"})
        out["idle_hang"] = [r.status, r.error, r.e2e_ns]
        # gevent's own recv, the path TLS connections take
        tls_like = ConnectionPool(Target.parse(url))
        cn = tls_like.open()
        cn.rwatch.close()
        cn.rwatch = None
        tls_like.idle.append(cn)
        r = StreamingClient(tls_like, deadline_s=10).post_stream("/v1/completions", body)
        out["fallback"] = [r.status, len(r.offsets_ns), r.completion_tokens]
        r = c.post_stream("/v1/completions", body.replace(b"test-model", b"nope"))
        out["http"] = [r.status, r.http_status, r.error]
        out["log"] = orjson.loads(urllib.request.urlopen(url + "/log").read())
    finally:
        testing.stop(proc)
    sys.stdout.write(orjson.dumps(out).decode())
""")


def test_light_load_timings_match_the_server_log():
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    out = orjson.loads(p.stdout)
    lags, gap_err, ttft_err = [], [], []
    for row in out["light"]:
        assert row["status"] == "ok" and row["ct"] == 30 and row["pt"] == 3
        assert row["connect"] == 0  # warmed keep-alive connection: no setup in the request
        assert row["q"] == 1_500_000 and row["replica"] == "r0"
        truth = out["log"][row["id"]]["sends_ns"]
        assert len(truth) == len(row["offs"]) == 30
        arrivals = [row["t0"] + o for o in row["offs"]]
        lags += [a - s for a, s in zip(arrivals, truth)]
        # ITL: client gaps against the server's gaps (buffering would lump them)
        gap_err += [abs((row["offs"][k] - row["offs"][k - 1]) - (truth[k] - truth[k - 1]))
                    for k in range(1, 30)]
        # TTFT: from the client's send to the server's first send, plus loopback
        ttft_err.append(row["ttft"] - (truth[0] - out["log"][row["id"]]["recv_ns"]))
    # medians: buffering lumps chunks and moves most of them by an ITL or more (Locust's
    # iter_lines reader: median lag ~45 ms), while a busy shared host delays only some reads
    lags.sort()
    gap_err.sort()
    ttft_err.sort()
    assert lags[0] >= 0  # the client never sees a chunk before it was sent
    assert lags[len(lags) // 2] < 3e6
    assert gap_err[len(gap_err) // 2] < 3e6
    assert 0 <= ttft_err[len(ttft_err) // 2] < 3e6
    assert out["cold_status"] == "ok" and out["cold_connect"] > 0
    assert out["deadline"][0] == "timeout"
    assert out["fallback"] == ["ok", 30, 30]
    assert out["idle_ok"][:2] == ["ok", 30] and out["idle_ok"][2] > 0.3e9
    assert out["idle_hang"][:2] == [  # headers came, then silence
        "timeout", "the response stopped: no bytes for 0.15 s (the read timeout)"]
    assert out["http"][:2] == ["http_error", 404] and "does not exist" in out["http"][2]


def chunked(parts, trailers=b""):
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n" + trailers + \
        b"\r\n"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=50), max_size=8),
       st.sampled_from([b"", b"x-trailer: 1\r\n"]), st.data())
def test_chunked_decoder_any_split(parts, trailers, data):
    wire = chunked(parts, trailers)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(wire)), max_size=12))))
    d = ChunkedDecoder()
    got = b""
    for a, b in zip([0] + cuts, cuts + [len(wire)]):
        got += d.feed(wire[a:b])
    assert got == b"".join(parts)
    assert d.done


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8),
       st.sampled_from(["%x", "%X", "%04x", "%x;ext=1"]))
def test_chunked_decoder_one_chunk_per_read(parts, size_fmt):
    # how servers write SSE: one whole chunk a read (the decoder's fast path), then the end
    d = ChunkedDecoder()
    for p in parts:
        wire = (size_fmt % len(p)).encode() + b"\r\n" + p + b"\r\n"
        assert d.feed(wire) == p and not d.done
    assert d.feed(b"0\r\n\r\n") == b"" and d.done
