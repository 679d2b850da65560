"""The stall rule, with a plain clock: only started streams, and never an outage's silence."""

from __future__ import annotations

from dataclasses import dataclass

from services.edge.stalls import StallGuard

STALL_S = 60.0


@dataclass
class Stream:
    name: str
    progress_at: float | None = None


def names(streams: list[Stream]) -> list[str]:
    return sorted(s.name for s in streams)


def test_a_started_stream_silent_for_the_stall_time_is_due_once() -> None:
    guard = StallGuard(STALL_S)
    a, b = Stream("a"), Stream("b")
    guard.seen(a, 0.0)
    guard.seen(b, 0.0)
    guard.seen(b, 30.0)  # b made progress
    streams = [a, b]
    assert guard.due(streams, STALL_S - 1) == []
    assert names(guard.due(streams, STALL_S)) == ["a"]
    assert guard.due(streams, STALL_S + 1) == []  # a is no longer watched once reported
    assert guard.next_at(streams) == 30.0 + STALL_S
    assert names(guard.due(streams, 30.0 + STALL_S)) == ["b"]
    assert guard.next_at(streams) is None


def test_a_queued_stream_is_not_watched() -> None:
    guard = StallGuard(STALL_S)
    queued = Stream("queued")  # no record yet: queueing may be long by design
    assert guard.due([queued], 10 * STALL_S) == []
    assert guard.next_at([queued]) is None


def test_silence_during_an_outage_does_not_count_and_open_streams_are_watched_after() -> None:
    guard = StallGuard(STALL_S)
    started, queued = Stream("started"), Stream("queued")
    guard.seen(started, 0.0)
    # The broker was away from 10 to 100: "queued" was open through it without a record.
    guard.outage_over([started, queued], 100.0)
    assert guard.due([started, queued], 100.0 + STALL_S - 1) == []
    assert names(guard.due([started, queued], 100.0 + STALL_S)) == ["queued", "started"]
