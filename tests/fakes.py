"""Fakes shared by the unit tests of pure logic: each stands in for one real part, by name."""

from __future__ import annotations

from dataclasses import dataclass


class FakeClock:
    """A monotonic clock moved only by the test (`clock.now += 5`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class FakeTopicPartition:
    """Stands in for aiokafka's `TopicPartition`: hashable, compared by topic and partition."""

    topic: str
    partition: int
