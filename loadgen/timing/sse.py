"""The one incremental Server-Sent Events parser: bytes in (split anywhere), events out.

Follows the WHATWG event-stream rules: lines end in CRLF, LF or CR; ``:`` starts a comment
(keep-alives); ``data`` lines of one event join with ``\\n``; a blank line dispatches; an event
with no data is not dispatched. Events are ``(event_type, data)`` tuples, ``event_type`` is
``None`` for the default ``message`` type and ``data`` is bytes (fed to orjson unchanged).

Linear time in the stream's length however it is split: each byte is scanned for line ends once,
when it arrives, and an unterminated line grows in a ``bytearray`` (amortised appends), never by
joining the whole tail again. A line, or one event's data, longer than ``max_line_bytes`` raises
``SSELimitError`` (a ``ValueError``: the client records it as a ``protocol_error``).
"""

from __future__ import annotations

Event = tuple  # (event_type: str | None, data: bytes)

MAX_LINE_BYTES = 16 << 20  # 16 MiB: a completion chunk is a few hundred bytes; a whole
# non-streamed answer of a 128k-token context in one event is still under it


class SSELimitError(ValueError):
    """The stream holds a line or an event larger than the parser's limit."""


class SSEParser:
    __slots__ = ("_tail", "_cr", "_data", "_data_bytes", "_event", "max_line_bytes")

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._tail = bytearray()  # the unterminated line at the end of the stream so far
        self._cr = False  # the last line ended in CR: a LF first in the next read is its pair
        self._data: list[bytes] = []  # data lines of the event being built
        self._data_bytes = 0
        self._event: str | None = None
        self.max_line_bytes = max_line_bytes

    def feed(self, chunk: bytes) -> list[Event]:
        """Events completed by ``chunk`` (possibly none), in stream order."""
        if not chunk:
            return []
        if self._cr:
            self._cr = False
            if chunk[:1] == b"\n":  # the second half of a CRLF split between reads
                chunk = chunk[1:]
        if (chunk[:6] == b"data: " and chunk[-2:] == b"\n\n" and not self._tail
                and not self._data and self._event is None and b"\r" not in chunk
                and len(chunk) <= self.max_line_bytes):
            # Fast path, the same result as the line loop: whole single-line ``data: `` events
            # and nothing else (every LF belongs to a separating blank line).
            lf = chunk.count(b"\n")
            if lf == 2:
                return [(None, chunk[6:-2])]
            if lf == 2 + 2 * chunk.count(b"\n\ndata: "):
                return [(None, part[6:]) for part in chunk[:-2].split(b"\n\n")]
        cut = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if cut < 0:  # no line end: the open line grows (only the new bytes are touched)
            self._tail += chunk
            if len(self._tail) > self.max_line_bytes:
                self._over("a line")
            return []
        if cut == len(chunk) - 1 and chunk[cut] == 13:  # a CR last: a LF opening the next
            self._cr = True  # read is its pair
        if self._tail:  # the block keeps its last line end, so a CRLF in it stays one
            self._tail += chunk[:cut + 1]
            block = bytes(self._tail)
        else:
            block = chunk[:cut + 1]
        self._tail = bytearray(chunk[cut + 1:])
        if len(self._tail) > self.max_line_bytes:
            self._over("a line")
        if b"\r" in block:
            block = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return self._lines(block[:-1])

    def _over(self, what: str) -> None:
        limit = self.max_line_bytes
        self._tail = bytearray()
        self._data, self._data_bytes, self._event = [], 0, None
        raise SSELimitError(f"the event stream sent {what} longer than {limit:,} bytes "
                            f"(the parser's limit, max_line_bytes); raise it if the server "
                            "really sends such events")

    def _lines(self, block: bytes) -> list[Event]:
        out: list[Event] = []
        data = self._data
        limit = self.max_line_bytes
        for line in block.split(b"\n"):
            if not line:
                if data:
                    out.append((self._event, data[0] if len(data) == 1 else b"\n".join(data)))
                    data = self._data = []
                    self._data_bytes = 0
                self._event = None
                continue
            if len(line) > limit:
                self._over("a line")
            if line[:5] == b"data:":
                value = line[6:] if line[5:6] == b" " else line[5:]
            elif line[:1] == b":":
                continue  # comment / keep-alive
            else:
                name, sep, value = line.partition(b":")
                if sep and value[:1] == b" ":
                    value = value[1:]
                if name == b"event":
                    self._event = value.decode("utf-8", "replace") or None
                    continue
                if name != b"data":  # "data" with no colon is an empty data line
                    continue  # "id", "retry" and unknown fields: nothing a completion needs
            data.append(value)
            self._data_bytes += len(value) + 1
            if self._data_bytes > limit:
                self._over("an event")
        return out

    def finish(self) -> list[Event]:
        """At end of stream: an event whose data lines were complete but whose blank line
        never came is still returned (lenient; the spec would drop it)."""
        out: list[Event] = []
        self._cr = False
        if self._tail:
            tail, self._tail = bytes(self._tail), bytearray()
            out.extend(self.feed(tail + b"\n"))
        if self._data:
            out.append((self._event, b"\n".join(self._data)))
            self._data, self._data_bytes = [], 0
        self._event = None
        return out

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished event are held."""
        return bool(self._tail or self._data)
