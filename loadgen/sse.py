"""The one incremental Server-Sent Events parser: bytes in (split anywhere), events out.

Follows the WHATWG event-stream rules: lines end in CRLF, LF or CR; ``:`` starts a comment
(keep-alives); ``data`` lines of one event join with ``\\n``; a blank line dispatches; an event
with no data is not dispatched. Events are ``(event_type, data)`` tuples, ``event_type`` is
``None`` for the default ``message`` type and ``data`` is bytes (fed to orjson unchanged).
"""

from __future__ import annotations

Event = tuple  # (event_type: str | None, data: bytes)


class SSEParser:
    __slots__ = ("_buf", "_data", "_event")

    def __init__(self) -> None:
        self._buf = b""  # unterminated tail of the stream (no complete line in it)
        self._data: list[bytes] = []  # data lines of the event being built
        self._event: str | None = None

    def feed(self, chunk: bytes) -> list[Event]:
        """Events completed by ``chunk`` (possibly none), in stream order."""
        if (chunk[:6] == b"data: " and chunk[-2:] == b"\n\n" and not self._buf
                and not self._data and self._event is None and b"\r" not in chunk):
            # Fast path, the same result as the line loop: whole single-line ``data: `` events
            # and nothing else (every LF belongs to a separating blank line).
            lf = chunk.count(b"\n")
            if lf == 2:
                return [(None, chunk[6:-2])]
            if lf == 2 + 2 * chunk.count(b"\n\ndata: "):
                return [(None, part[6:]) for part in chunk[:-2].split(b"\n\n")]
        buf = self._buf + chunk if self._buf else chunk
        hold = b""
        if b"\r" in buf:
            if buf[-1:] == b"\r":
                # A CR at the end may be the first half of a CRLF: decide when more bytes come.
                hold = b"\r"
                buf = buf[:-1]
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        cut = buf.rfind(b"\n")
        if cut < 0:
            self._buf = buf + hold
            return []
        self._buf = buf[cut + 1:] + hold
        return self._lines(buf[:cut])

    def _lines(self, block: bytes) -> list[Event]:
        out: list[Event] = []
        data = self._data
        for line in block.split(b"\n"):
            if not line:
                if data:
                    out.append((self._event, data[0] if len(data) == 1 else b"\n".join(data)))
                    data = self._data = []
                self._event = None
            elif line[:5] == b"data:":
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line[:1] == b":":
                continue  # comment / keep-alive
            else:
                name, sep, value = line.partition(b":")
                if sep and value[:1] == b" ":
                    value = value[1:]
                if name == b"data":  # "data" with no colon: an empty data line
                    data.append(value)
                elif name == b"event":
                    self._event = value.decode("utf-8", "replace") or None
                # "id", "retry" and unknown fields carry nothing a completion stream needs
        return out

    def finish(self) -> list[Event]:
        """At end of stream: an event whose data lines were complete but whose blank line
        never came is still returned (lenient; the spec would drop it)."""
        out: list[Event] = []
        if self._buf:
            tail, self._buf = self._buf, b""
            out.extend(self.feed(tail.rstrip(b"\r") + b"\n"))
        if self._data:
            out.append((self._event, b"\n".join(self._data)))
            self._data = []
        self._event = None
        return out

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished event are held."""
        return bool(self._buf or self._data)
