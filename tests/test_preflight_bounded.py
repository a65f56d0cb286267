"""The JSON calls of preflight, the cache protocol and the probes read a bounded answer: a
server that streams without end (as fast as the socket takes it, or a byte at a time) ends the
call with an error in its deadline, holding at most a megabyte, instead of filling the
process's memory (issue 33: preflight reached 23.6 GB)."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvbench.runs.preflight import MAX_JSON_BYTES, http_json


class Endless(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        chunk = b"[" + b"1," * 32768
        slow = self.path.endswith("/drip")
        try:
            while True:
                self.wfile.write(b"1," if slow else chunk)
                self.wfile.flush()
                if slow:
                    time.sleep(0.05)
        except OSError:
            pass  # the client went away

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_an_endless_fast_answer_is_cut_at_the_size_cap(server):
    with pytest.raises(ValueError, match="more than"):
        http_json(server + "/v1/models", timeout=60)


def test_an_endless_trickle_is_cut_at_the_total_deadline(server):
    """Each wait for bytes is short, so urllib's own timeout never fires: the call's deadline
    does (the server-side pause is 50 ms, the deadline 1 s; the bound below is generous)."""
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still answering"):
        http_json(server + "/drip", timeout=1.0)
    assert time.monotonic() - t0 < 30
    assert MAX_JSON_BYTES == 1 << 20
