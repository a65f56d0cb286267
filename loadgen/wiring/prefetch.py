"""Requests built ahead, while the event loop has nothing else to do.

Building a request (its prompt text, template, token counts) costs 40-70 us for a chat prompt
and milliseconds for a long-context one. Built at the moment it is sent, that work lands where
sends bunch up (users whose answers ended together, an arrival burst) and every stream's chunks
wait behind it. ``Prefetch`` keeps up to ``ahead`` items of an iterator built by a greenlet that
runs only when the loop is idle (``gevent.idle``), one item per idle turn; ``next`` takes a
built one, or builds inline when the buffer ran dry. The items come out in the iterator's own
order, so what is sent is exactly what it would be without it.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

import gevent
import gevent.event

_END = object()


class Prefetch:
    """An iterator over ``items`` with up to ``ahead`` of them built in idle time."""

    def __init__(self, items: Iterator, ahead: int, prefill: bool = False) -> None:
        """``prefill``: build the first ``ahead`` now (before the load: at its start every
        user wants one at once and the loop is never idle)."""
        self._items = iter(items)
        self._buf: deque = deque()
        self._ahead = max(1, int(ahead))
        self._ended = False
        self._busy = False  # the iterator is being advanced (never by two greenlets at once)
        self._room = gevent.event.Event()  # set while the buffer has room
        self._room.set()
        while prefill and len(self._buf) < self._ahead and not self._ended:
            item = self._advance()
            if item is _END:
                self._ended = True
            self._buf.append(item)
        self._filler = gevent.spawn(self._fill)

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        if self._buf:
            item = self._buf.popleft()
            self._room.set()
            if item is _END:
                self._buf.appendleft(_END)
                raise StopIteration
            return item
        if self._ended:
            raise StopIteration
        item = self._advance()
        if item is _END:
            self._ended = True
            raise StopIteration
        return item

    def _advance(self):
        self._busy = True
        try:
            return next(self._items, _END)
        finally:
            self._busy = False

    def _fill(self) -> None:
        while not self._ended:
            if len(self._buf) >= self._ahead:
                self._room.clear()
                self._room.wait()
                continue
            gevent.idle()  # only when nothing else is ready to run
            if self._ended or self._busy or len(self._buf) >= self._ahead:
                continue
            item = self._advance()
            if item is _END:
                self._ended = True
            self._buf.append(item)

    def close(self) -> None:
        """End it: nothing more is built; what was built ahead can still be taken."""
        self._ended = True
        self._room.set()
        self._filler.kill(block=False)
