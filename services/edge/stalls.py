"""Streams that stopped getting records: ended with an error instead of left open forever.

A backstop: a worker resends a batch Kafka did not take, in order, for a bounded time
(ADR 0048), and past it re-runs the request; a worker that dies in an outage, or a request
lost with it, may still never write a stream's final record, and without this the client
would wait forever on an open socket. Pure, with the caller's clock:

- a stream is watched once a record of it arrived, or once a broker outage it was open
  through is over (it may have lost its request then);
- silence counts only while the broker is reachable: `outage_over` restarts every clock;
- a queued stream with no record yet is not watched (queueing may be long by design).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class Watched(Protocol):
    """What the rule reads and writes of a stream (`streams.ResultStream`)."""

    progress_at: float | None


W = TypeVar("W", bound=Watched)


class StallGuard:
    """The stall rule over streams; each stream keeps its own `progress_at`.

    Caller: the edge (`seen` per result record, `outage_over` when the broker is back,
    `due` and `next_at` from housekeeping). Affects: the streams' `progress_at`.
    """

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s

    @staticmethod
    def seen(stream: Watched, now: float) -> None:
        stream.progress_at = now

    @staticmethod
    def outage_over(streams: Iterable[Watched], now: float) -> None:
        """The broker is back: silence until now does not count, and open streams are watched."""
        for stream in streams:
            stream.progress_at = now

    def due(self, streams: Iterable[W], now: float) -> list[W]:
        """Streams silent for `stall_s`; they are no longer watched (the caller ends them)."""
        out = [
            s for s in streams if s.progress_at is not None and now - s.progress_at >= self.stall_s
        ]
        for stream in out:
            stream.progress_at = None
        return out

    def next_at(self, streams: Iterable[Watched]) -> float | None:
        watched = [s.progress_at for s in streams if s.progress_at is not None]
        return min(watched) + self.stall_s if watched else None
