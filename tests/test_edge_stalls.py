"""The stall rule, with a plain clock: only started streams, and never an outage's silence."""

from __future__ import annotations

from services.edge.stalls import StallGuard

STALL_S = 60.0


def test_a_started_stream_silent_for_the_stall_time_is_due_once() -> None:
    guard = StallGuard(STALL_S)
    guard.seen("a", 0.0)
    guard.seen("b", 0.0)
    guard.seen("b", 30.0)  # b made progress
    assert guard.due(STALL_S - 1) == []
    assert guard.due(STALL_S) == ["a"]
    assert guard.due(STALL_S + 1) == []  # a is forgotten once reported
    assert guard.next_at() == 30.0 + STALL_S
    assert guard.due(30.0 + STALL_S) == ["b"]
    assert len(guard) == 0


def test_an_ended_stream_is_not_watched() -> None:
    guard = StallGuard(STALL_S)
    guard.seen("a", 0.0)
    guard.forget("a")
    assert guard.due(10 * STALL_S) == []
    assert guard.next_at() is None


def test_silence_during_an_outage_does_not_count_and_open_streams_are_watched_after() -> None:
    guard = StallGuard(STALL_S)
    guard.seen("started", 0.0)
    # The broker was away from 10 to 100: "queued" was open through it without a record.
    guard.outage_over(["started", "queued"], 100.0)
    assert guard.due(100.0 + STALL_S - 1) == []
    assert sorted(guard.due(100.0 + STALL_S)) == ["queued", "started"]
