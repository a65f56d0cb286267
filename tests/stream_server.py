"""A scripted OpenAI-style SSE server that logs the exact send time of every chunk.

For the client's accuracy tests and ``bench/loadgen_capacity.py``: the truth the client's
timestamps are compared with. Decoding is stepped like an engine (every ``itl_ms`` each running
stream gets one token), so thousands of streams cost one timer. Times are ``time.monotonic_ns``
(CLOCK_MONOTONIC, the clock ``time.perf_counter_ns`` reads on Linux, shared by all processes).

Run: ``python tests/stream_server.py --port 0 [--ttft-ms 50 --itl-ms 10 --style vllm]``; it prints
``stream_server: listening on http://HOST:PORT``. ``GET /log`` returns and clears the send
log. Request header ``x-test-fault`` injects: ``http500``, ``error`` (error object after 2
chunks), ``disconnect`` (drop after 2 chunks), ``no-done``, ``empty`` (empty-text tokens),
``mismatch`` (usage says one token fewer than the chunks carried), ``keepalive`` (comment
lines between chunks), ``hang`` (headers, then nothing). Request header ``x-test-chunk-tokens: K``
sends K tokens a chunk (the last chunk holds the rest), as speculative decoding or a stream
interval does; usage counts tokens, not chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import orjson

_now = time.monotonic_ns


class Stream:
    __slots__ = ("w", "rid", "left", "n", "chat", "fault", "sends", "recv_ns", "prompt_tokens",
                 "closed", "per_chunk")

    def __init__(self, w, rid, max_tokens, chat, fault, recv_ns, prompt_tokens, per_chunk=1):
        self.w, self.rid, self.left, self.n = w, rid, max_tokens, 0
        self.per_chunk = per_chunk
        self.chat, self.fault, self.recv_ns = chat, fault, recv_ns
        self.sends: list[int] = []
        self.prompt_tokens = prompt_tokens
        self.closed = False


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class Server:
    def __init__(self, ttft_ms: float, itl_ms: float, style: str, model: str,
                 max_model_len: int, prompt_token_scale: float = 1.0) -> None:
        self.scale = prompt_token_scale  # usage/tokenize count scale x the built-in count
        self.ttft_s = ttft_ms / 1000
        self.itl_s = itl_ms / 1000
        self.style = style
        self.model = model
        self.max_model_len = max_model_len
        self.active: list[Stream] = []
        self.log: dict[str, dict] = {}
        self._await: dict[Stream, asyncio.Future] = {}  # the handler waiting for each stream
        self._tok = None
        # {chat: chunk of one " tok" token} for streams without a fault, as emit() writes it
        self._plain = {chat: _chunk(b"data: " + orjson.dumps(self.token_payload(
            Stream(None, "", 1, chat, "", 0, 0), " tok")) + b"\n\n") for chat in (False, True)}

    def count(self, text: str) -> int:
        if self._tok is None:
            from kvbench.workloads.tokenizer import get_tokenizer

            self._tok = get_tokenizer("builtin")
        return self._tok.count(text)

    def prompt_tokens(self, body: dict) -> int:
        if "messages" in body:
            from kvbench.workloads.tokenizer import render_chat_builtin

            return round(self.scale * self.count(render_chat_builtin(body["messages"])))
        return round(self.scale * self.count(body.get("prompt") or ""))

    async def ticker(self) -> None:
        loop = asyncio.get_running_loop()
        nxt = loop.time()
        while True:
            nxt += self.itl_s
            await asyncio.sleep(max(0.0, nxt - loop.time()))
            if nxt < loop.time() - 1.0:
                nxt = loop.time()  # fell far behind: do not burst to catch up
            if self.active:
                for s in list(self.active):
                    self.emit(s)

    def token_payload(self, s: Stream, text: str, finish=None) -> bytes:
        if s.chat:
            obj = {"id": "c", "object": "chat.completion.chunk", "model": self.model,
                   "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
        else:
            obj = {"id": "c", "object": "text_completion", "model": self.model,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        return obj

    def emit(self, s: Stream) -> None:
        if s.closed or s.w.is_closing():
            self.finish(s)
            return
        if s.left > 1 and not s.fault and s.per_chunk == 1:  # the common chunk: bytes built once
            s.left -= 1
            s.n += 1
            s.sends.append(_now())
            s.w.write(self._plain[s.chat])
            return
        k = min(s.per_chunk, s.left)
        text = "" if s.fault == "empty" else " tok" * k
        out = []
        if s.fault == "keepalive":
            out.append(_chunk(b": ping\n\n"))
        s.left -= k
        s.n += k
        last = s.left == 0
        obj = self.token_payload(s, text)
        usage = {"prompt_tokens": s.prompt_tokens,
                 "completion_tokens": s.n - (1 if s.fault == "mismatch" else 0),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if last and self.style == "llamacpp" and not s.chat:
            out.append(_chunk(b"data: " + orjson.dumps(obj) + b"\n\n"))
            fin = self.token_payload(s, "", "length")
            fin["usage"] = usage
            out.append(_chunk(b"data: " + orjson.dumps(fin) + b"\n\n"))
        elif last:
            obj["choices"][0]["finish_reason"] = "length"
            out.append(_chunk(b"data: " + orjson.dumps(obj) + b"\n\n"))
            out.append(_chunk(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n"))
        else:
            out.append(_chunk(b"data: " + orjson.dumps(obj) + b"\n\n"))
        if s.fault == "error" and s.n == 2:
            out.append(_chunk(b'data: {"error": {"message": "injected", "code": 500}}\n\n'))
            last = True
        if last and s.fault != "no-done":
            out.append(_chunk(b"data: [DONE]\n\n"))
        if last:
            out.append(b"0\r\n\r\n")
        payload = b"".join(out)
        s.sends.append(_now())  # just before the write: a client can never see it earlier
        s.w.write(payload)
        if s.fault == "disconnect" and s.n == 2:
            s.w.transport.abort()
            last = True
        if last:
            self.finish(s)

    def finish(self, s: Stream) -> None:
        if s.closed:
            return
        s.closed = True
        try:
            self.active.remove(s)
        except ValueError:
            pass
        self.log[s.rid] = {"recv_ns": s.recv_ns, "sends_ns": s.sends}
        fut = self._await.pop(s, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def start_stream(self, s: Stream) -> None:
        if s.w.is_closing():
            self.finish(s)
            return
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\nx-kvbench-queue-ms: 1.5\r\n"
                b"x-kvbench-prefill-ms: %.3f\r\nx-kvbench-replica: r0\r\n"
                b"x-kvbench-region: test\r\nx-request-id: %s\r\n\r\n"
                % (self.ttft_s * 1000, s.rid.encode("latin-1")))
        pre = b""
        if s.chat and self.style == "vllm":
            pre = _chunk(b"data: " + orjson.dumps(
                {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None}]}) + b"\n\n")
        s.w.write(head + pre)
        if s.fault == "hang":
            return
        self.active.append(s)
        self.emit(s)  # the first token goes out with the headers

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                recv_ns = _now()
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                hdr = {}
                for ln in lines[1:]:
                    k, _, v = ln.partition(":")
                    hdr[k.strip().lower()] = v.strip()
                n = int(hdr.get("content-length", "0"))
                body = await reader.readexactly(n) if n else b""
                if method == "GET" and path == "/log":
                    payload, self.log = orjson.dumps(self.log), {}
                    self.respond(writer, 200, payload)
                elif method == "GET" and path == "/v1/models":
                    self.respond(writer, 200, orjson.dumps({"object": "list", "data": [
                        {"id": self.model, "object": "model", "max_model_len": self.max_model_len}]}))
                elif method == "POST" and path == "/tokenize":
                    req = orjson.loads(body)
                    c = self.prompt_tokens(req)
                    self.respond(writer, 200, orjson.dumps(
                        {"count": c, "max_model_len": self.max_model_len}))
                elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    req = orjson.loads(body)
                    fault = hdr.get("x-test-fault", "")
                    if req.get("model") != self.model:
                        self.respond(writer, 404, orjson.dumps({"error": {
                            "message": f"model {req.get('model')} does not exist", "code": 404}}))
                        continue
                    if fault == "http500":
                        self.respond(writer, 500, b'{"error": {"message": "injected failure"}}')
                        continue
                    rid = hdr.get("x-request-id") or f"anon-{len(self.log)}-{recv_ns}"
                    s = Stream(writer, rid, max(1, int(req.get("max_tokens") or 16)),
                               "messages" in req, fault, recv_ns, self.prompt_tokens(req),
                               max(1, int(hdr.get("x-test-chunk-tokens") or 1)))
                    done = asyncio.get_running_loop().create_future()
                    asyncio.get_running_loop().call_later(self.ttft_s, self.start_stream, s)
                    if fault == "hang":
                        await reader.read()  # until the client gives up and closes
                        self.finish(s)
                        break
                    self._await[s] = done
                    await done
                    if fault == "disconnect":
                        break
                else:
                    self.respond(writer, 404, b'{"error": {"message": "not found"}}')
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def respond(self, w, status: int, payload: bytes) -> None:
        w.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (status, len(payload), payload))


async def _main(args) -> None:
    srv = Server(args.ttft_ms, args.itl_ms, args.style, args.model, args.max_model_len,
                 args.prompt_token_scale)
    server = await asyncio.start_server(srv.handle, args.host, args.port, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    asyncio.get_running_loop().create_task(srv.ticker())
    print(f"stream_server: listening on http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python tests/stream_server.py")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--style", choices=["vllm", "llamacpp"], default="vllm")
    p.add_argument("--model", default="test-model")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--prompt-token-scale", type=float, default=1.0,
                   help="count prompt tokens as this many times the built-in tokenizer does "
                        "(a server whose tokenizer is not the client's)")
    asyncio.run(_main(p.parse_args(argv)))


def start(**opts) -> tuple[subprocess.Popen, str]:
    """Start the server in a subprocess; returns (process, base URL). Options are the CLI's
    (``ttft_ms=20, itl_ms=5, style="llamacpp"``)."""
    cmd = [sys.executable, os.path.abspath(__file__)]
    for k, v in opts.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"test server did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL (the way kvbench run stops its built-in endpoints)."""
    from kvbench.runs.builtin import stop as stop_server

    stop_server(proc)


if __name__ == "__main__":
    main()


class TinyWorkload:
    """A small hand-made workload for tests and the bench (``--kvbench-workload
    loadgen.testing:tiny_workload``): chat sessions of ``TINY_TURNS`` turns whose later turns
    quote the previous response, ``max_tokens`` from ``TINY_MAX_TOKENS``."""

    name = "tiny"
    request_class = "chat"
    has_arrivals = True

    def __init__(self, sessions: int = 50, turns: int = 2, max_tokens: int = 8,
                 rate_rps: float = 50.0) -> None:
        self.n_sessions, self.turns, self.max_tokens = sessions, turns, max_tokens
        self.rate_rps = rate_rps

    def sessions(self):
        from kvbench.workloads.base import Request

        tiny = self

        class S:
            def __init__(self, i):
                self.session_id = f"s{i}"
                self.turn = 0
                self.history = [{"role": "user", "content": f"question {i}"}]

            def next_request(self):
                if self.turn >= tiny.turns:
                    return None
                t = self.turn
                self.turn += 1
                return Request(request_id=f"{self.session_id}-t{t}", request_class="chat",
                               max_tokens=tiny.max_tokens, prompt_tokens=0,
                               shared_prefix_tokens=0, session_id=self.session_id, turn=t,
                               messages=tuple(self.history), think_time_s=0.01,
                               workload="tiny")

            def feed_response(self, text):
                self.history = self.history + [{"role": "assistant", "content": text},
                                               {"role": "user", "content": "go on"}]

        return (S(i) for i in range(self.n_sessions))

    def requests(self):
        k = 0
        for s in self.sessions():
            while (req := s.next_request()) is not None:
                from dataclasses import replace

                yield replace(req, arrival_offset_s=k / self.rate_rps)
                k += 1
                s.feed_response(" tok" * self.max_tokens)


def tiny_workload() -> TinyWorkload:
    return TinyWorkload(sessions=int(os.environ.get("TINY_SESSIONS", "50")),
                        turns=int(os.environ.get("TINY_TURNS", "2")),
                        max_tokens=int(os.environ.get("TINY_MAX_TOKENS", "8")),
                        rate_rps=float(os.environ.get("TINY_RATE", "50")))
