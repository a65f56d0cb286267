import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.loadgen.timing.openai import StreamState, error_message, request_body
from kvbench.loadgen.timing.sse import SSEParser


def parse_all(chunks):
    p = SSEParser()
    out = []
    for c in chunks:
        out.extend(p.feed(c))
    out.extend(p.finish())
    return out


STREAM = (b": keep-alive\r\n\r\n"
          b"data: {\"a\": 1}\r\n\r\n"
          b"event: error\ndata: {\"error\": {\"message\": \"boom\"}}\n\n"
          b"data: line one\ndata: line two\n\n"
          b"data:nospace\r\r"
          b"id: 7\nretry: 10\n\n"  # no data: not dispatched
          b":comment only\n"
          b"data\n\n"  # a data field without colon: one empty data line
          b"data: [DONE]\n\n")
EXPECTED = [(None, b"{\"a\": 1}"), ("error", b"{\"error\": {\"message\": \"boom\"}}"),
            (None, b"line one\nline two"), (None, b"nospace"), (None, b""), (None, b"[DONE]")]


def test_edge_cases_in_one_read():
    assert parse_all([STREAM]) == EXPECTED


def test_byte_by_byte():
    assert parse_all([STREAM[i:i + 1] for i in range(len(STREAM))]) == EXPECTED


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=30))
def test_any_split_gives_the_same_events(cuts):
    cuts = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0] + cuts, cuts + [len(STREAM)])]
    assert parse_all(pieces) == EXPECTED


line_end = st.sampled_from([b"\n", b"\r\n", b"\r"])
payload = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(payload, min_size=1, max_size=3), line_end), max_size=8),
       st.data())
def test_generated_streams_any_line_ending_any_split(events, data):
    stream = b""
    expected = []
    for lines, eol in events:
        for ln in lines:
            stream += b"data: " + ln + eol
        stream += eol
        expected.append((None, b"\n".join(lines)))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=20))))
    pieces = [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]
    assert parse_all(pieces) == expected


def test_unterminated_last_event_is_returned_at_finish():
    p = SSEParser()
    assert p.feed(b"data: [DONE]") == []
    assert p.pending
    assert p.finish() == [(None, b"[DONE]")]


def ev(obj):
    return (None, orjson.dumps(obj))


def chat(content=None, role=None, finish=None, **delta):
    d = dict(delta)
    if role:
        d["role"] = role
    if content is not None:
        d["content"] = content
    return ev({"choices": [{"index": 0, "delta": d, "finish_reason": finish}]})


def usage(p, c, cached=None):
    u = {"prompt_tokens": p, "completion_tokens": c}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def test_vllm_chat_stream_with_role_and_usage_chunk():
    s = StreamState(t0_ns=1000, keep_text=True)
    s.on_events([chat("", role="assistant")], 1500)
    s.on_events([chat("Hi"), chat(" there")], 2000)
    s.on_events([chat("", finish="stop")], 2500)  # EOS: counted by the server
    s.on_events([ev({"choices": [], "usage": usage(10, 3, cached=8)}), (None, b"[DONE]")], 2600)
    assert s.settle(True) == ("ok", None)
    assert s.offsets_ns == [1000, 1000, 1500]
    assert s.text == "Hi there"
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (10, 3, 8)


def test_llamacpp_completion_usage_on_finish_chunk_not_a_token():
    s = StreamState(t0_ns=0)
    for i in range(3):
        s.on_events([ev({"choices": [{"text": "x", "index": 0, "finish_reason": None}]})], 10 + i)
    s.on_events([ev({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                     "usage": usage(5, 3, cached=0), "timings": {}})], 20)
    s.on_events([(None, b"[DONE]")], 21)
    assert s.settle(True) == ("ok", None)
    assert s.tokens == [1, 1, 1] and s.cached_tokens == 0


def test_empty_text_chunks_are_tokens_and_reasoning_counts():
    s = StreamState(t0_ns=0)
    s.on_events([ev({"choices": [{"text": "", "finish_reason": None}]})], 5)  # partial UTF-8
    s.on_events([chat(reasoning_content="think")], 6)
    s.on_events([chat(reasoning="more")], 7)
    s.on_events([ev({"choices": [], "usage": usage(1, 3)}), (None, b"[DONE]")], 8)
    assert s.settle(True) == ("ok", None)
    assert s.offsets_ns == [5, 6, 7]


def test_statuses():
    s = StreamState(0)
    s.on_events([chat("a"), (None, b"{\"error\": {\"message\": \"overloaded\", \"code\": 503}}")], 1)
    assert s.settle(True) == ("http_error", "stream error: overloaded (code 503)")
    s = StreamState(0)
    s.on_events([chat("a")], 1)
    assert s.settle(False)[0] == "disconnected"
    assert s.settle(True)[0] == "protocol_error"  # no [DONE], no finish_reason
    s = StreamState(0)
    s.on_events([(None, b"{not json")], 1)
    assert s.settle(True)[0] == "protocol_error"
    s = StreamState(0)  # more token-carrying chunks than tokens
    s.on_events([chat("a"), chat("b"), ev({"choices": [], "usage": usage(1, 1)}),
                 (None, b"[DONE]")], 1)
    assert s.settle(True) == ("protocol_error",
                              "usage reports 1 tokens but 2 token-carrying chunks arrived")
    s = StreamState(0)  # fewer chunks than tokens, but the stream did not end properly
    s.on_events([chat("a b"), ev({"choices": [], "usage": usage(1, 2)})], 1)
    assert s.settle(True)[0] == "protocol_error" and s.tokens == [1]
    s = StreamState(0)  # no usage at all (llama-cpp-python): the client count stands
    s.on_events([chat("a"), chat("b", finish="stop")], 1)
    assert s.settle(True) == ("ok", None) and len(s.tokens) == 2


def test_bodies_and_error_messages():
    class R:
        messages = ({"role": "user", "content": "hi"},)
        prompt = None
        max_tokens = 7
    body = orjson.loads(request_body(R(), "m"))
    assert body == {"model": "m", "max_tokens": 7, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream_options": {"include_usage": True}}
    assert error_message(b'{"object": "error", "message": "too long", "code": 400}') == \
        "too long (code 400)"
    assert error_message(b"plain failure\n") == "plain failure"


# --- the fast path (whole single-line ``data:`` events in one read) against the line loop

field_value = st.binary(max_size=30).filter(lambda b: b"\r" not in b and b"\n" not in b)


@st.composite
def sse_event(draw):
    """One event's bytes, any of the shapes a server may send, any line ending."""
    eol = draw(line_end)
    kind = draw(st.sampled_from(["data", "data", "data", "multi", "comment", "typed", "idonly",
                                 "nospace"]))
    v = draw(field_value)
    if kind == "data":
        lines = [b"data: " + v]
    elif kind == "multi":
        lines = [b"data: " + v, b"data: " + draw(field_value)]
    elif kind == "comment":
        lines = [b": " + v]
    elif kind == "typed":
        lines = [b"event: error", b"data: " + v]
    elif kind == "idonly":
        lines = [b"id: " + v]
    else:
        lines = [b"data:" + v]
    return b"".join(ln + eol for ln in lines) + eol


@settings(max_examples=300, deadline=None)
@given(st.lists(sse_event(), max_size=10), st.data())
def test_reads_of_whole_events_match_the_line_loop(events, data):
    # reads that end on event boundaries (where the fast path applies), sometimes also cut
    # inside an event; a byte at a time never takes the fast path: the reference
    bounds = [0]
    for e in events:
        bounds.append(bounds[-1] + len(e))
    stream = b"".join(events)
    cuts = set(data.draw(st.lists(st.sampled_from(bounds), max_size=10)))
    cuts |= set(data.draw(st.lists(st.integers(0, len(stream)), max_size=3)))
    cuts = sorted(cuts)
    pieces = [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)]) if b > a]
    assert parse_all(pieces) == parse_all([stream[i:i + 1] for i in range(len(stream))])


def test_fast_path_cases():
    p = SSEParser()
    assert p.feed(b"data: {\"a\":1}\n\n") == [(None, b"{\"a\":1}")]
    assert p.feed(b"data: x\n\ndata: \n\ndata: [DONE]\n\n") == \
        [(None, b"x"), (None, b""), (None, b"[DONE]")]
    assert p.feed(b"event: error\n") == []  # a typed event split before its data line
    assert p.feed(b"data: boom\n\n") == [("error", b"boom")]
    assert p.feed(b"data: a\ndata: b\n\n") == [(None, b"a\nb")]  # two lines: the line loop
    assert p.feed(b"data: a\n\n\n\ndata: b\n\n") == [(None, b"a"), (None, b"b")]
    assert not p.pending


def test_malformed_chunks_are_protocol_errors_not_exceptions():
    for bad in (b'{"choices": [1]}', b'{"choices": [{"delta": "x"}]}', b'{"usage": 5}',
                b'{"usage": {"prompt_tokens": "many"}}', b'{"choices": {"a": 1}}'):
        s = StreamState(0)
        s.on_events([chat("a"), (None, bad), (None, b"[DONE]")], 1)
        status, err = s.settle(True)
        assert status == "protocol_error" and "malformed chunk" in err, bad


# --- linear time and the line limit

import pytest  # noqa: E402

from kvbench.loadgen.timing.sse import MAX_LINE_BYTES, SSELimitError  # noqa: E402


def split_at(stream, cuts):
    cuts = sorted(set(cuts))
    return [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), line_end), min_size=1, max_size=4), st.data())
def test_long_lines_any_split_and_empty_reads(lines, data):
    stream = b"".join(b"data: " + b"y" * n + eol + eol for n, eol in lines)
    expected = [(None, b"y" * n) for n, _ in lines]
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=40))
    pieces = split_at(stream, cuts)
    # empty reads anywhere (a CR that ended the last read must still pair with the next LF)
    for i in sorted(data.draw(st.lists(st.integers(0, len(pieces)), max_size=5)), reverse=True):
        pieces.insert(i, b"")
    assert parse_all(pieces) == expected
    assert parse_all([stream]) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(8, 300), st.sampled_from(["line", "event"]), st.booleans(), st.data())
def test_the_limit_holds_at_any_split(limit, shape, over, data):
    size = limit + (1 if over else 0)
    if shape == "line":  # one line of ``size`` bytes, the "data: " field name included
        stream = b"data: " + b"z" * (size - 6) + b"\n\n"
    else:  # ``size`` empty data lines: an event of size - 1 newlines, counted a byte each
        stream = b"data\n" * size + b"\n"
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    p = SSEParser(max_line_bytes=limit)
    try:
        for piece in split_at(stream, cuts):
            p.feed(piece)
        p.finish()
        raised = False
    except SSELimitError as exc:
        raised = True
        assert f"longer than {limit:,} bytes" in str(exc)
    assert raised == (size > limit)


def test_default_limit_and_a_40_mib_line_in_small_reads():
    assert MAX_LINE_BYTES == 16 << 20
    line = b"data: " + b"x" * (40 << 20) + b"\n\n"
    p = SSEParser(max_line_bytes=64 << 20)
    out = []
    for i in range(0, len(line), 16384):
        out.extend(p.feed(line[i:i + 16384]))
    assert out == [(None, line[6:-2])]
    p = SSEParser()
    with pytest.raises(SSELimitError, match="longer than 16,777,216 bytes"):
        for i in range(0, len(line), 16384):
            p.feed(line[i:i + 16384])
    assert not p.pending  # what it held is dropped
