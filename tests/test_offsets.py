"""Commit positions never pass a record still in flight."""

from __future__ import annotations

from aiokafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from shared.offsets import OffsetTracker

TP = TopicPartition("t", 0)


def test_commit_stops_at_the_oldest_in_flight() -> None:
    t = OffsetTracker()
    for o in (10, 11, 12):
        t.taken(TP, o)
    t.done(TP, 11)
    assert t.committable() == {TP: 10}
    t.done(TP, 10)
    assert t.committable() == {TP: 12}
    t.mark_committed({TP: 12})
    assert t.committable() == {}
    t.done(TP, 12)
    assert t.committable() == {TP: 13}


@given(st.permutations(list(range(20))), st.integers(min_value=0, max_value=20))
def test_committed_position_is_below_every_unfinished_offset(order: list[int], n: int) -> None:
    t = OffsetTracker()
    for o in range(20):
        t.taken(TP, o)
    finished = set(order[:n])
    for o in order[:n]:
        t.done(TP, o)
    position = t.committable().get(TP)
    unfinished = set(range(20)) - finished
    if unfinished:
        assert position == min(unfinished)
    else:
        assert position == 20
