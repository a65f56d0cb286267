"""Requests built ahead in idle time come out exactly as the workload's iterator yields them,
however taking and idle time interleave, and never more than ``ahead`` are held."""

import gevent
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.loadgen.wiring.prefetch import Prefetch


class Counting:
    """An iterator over 0..n-1 that records how far it was advanced."""

    def __init__(self, n: int) -> None:
        self.n, self.made = n, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.made >= self.n:
            raise StopIteration
        self.made += 1
        return self.made - 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 60), ahead=st.integers(1, 8),
       pauses=st.lists(st.sampled_from([0, 0, 1, 2]), max_size=80))
def test_same_items_same_order_bounded_lookahead(n, ahead, pauses):
    src = Counting(n)
    p = Prefetch(src, ahead)
    got = []
    for i in range(n + 3):
        for _ in range(pauses[i] if i < len(pauses) else 0):
            gevent.sleep(0)  # idle turns: the filler builds ahead
            assert src.made - len(got) <= ahead  # never more than ``ahead`` held
        item = next(p, None)
        if item is None:
            break
        got.append(item)
    assert got == list(range(n))
    assert next(p, None) is None  # ended stays ended
    p.close()


def test_idle_time_builds_ahead_and_close_stops_it():
    src = Counting(100)
    p = Prefetch(src, 5)
    gevent.sleep(0.05)  # an idle loop: five built, no more
    assert src.made == 5
    assert [next(p) for _ in range(3)] == [0, 1, 2]
    gevent.sleep(0.05)
    assert src.made == 8  # refilled to five ahead
    p.close()
    gevent.sleep(0.05)
    assert src.made == 8  # closed: nothing more built in the background
    assert list(p) == [3, 4, 5, 6, 7]  # what was built stays available; then it ends


def test_prefill_builds_before_the_load():
    src = Counting(10)
    p = Prefetch(src, 4, prefill=True)
    assert src.made == 4  # built at once, no idle turn needed
    assert list(p) == list(range(10))
    short = Counting(2)
    assert list(Prefetch(short, 4, prefill=True)) == [0, 1]
