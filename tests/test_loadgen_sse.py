import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.openai import StreamState, error_message, request_body
from loadgen.sse import SSEParser


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
    s = StreamState(0)
    s.on_events([chat("a"), ev({"choices": [], "usage": usage(1, 5)}), (None, b"[DONE]")], 1)
    assert s.settle(True) == ("protocol_error",
                              "token count mismatch: 1 token chunks, usage says 5")
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
