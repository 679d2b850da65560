"""Which offsets may be committed: only those below the oldest record still in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka import TopicPartition


@dataclass
class OffsetTracker:
    """Tracks records taken from Kafka until the work they stand for is handed on.

    Kafka commits one offset per partition, so a record finished early cannot be committed
    past an older one still in flight; `committable()` returns the safe positions.
    """

    _pending: dict[TopicPartition, set[int]] = field(default_factory=dict)
    _next: dict[TopicPartition, int] = field(default_factory=dict)
    _committed: dict[TopicPartition, int] = field(default_factory=dict)

    def taken(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        self._pending.get(tp, set()).discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        """Positions to commit that move forward since the last `mark_committed`."""
        out: dict[TopicPartition, int] = {}
        for tp, nxt in self._next.items():
            pending = self._pending.get(tp)
            position = min(pending) if pending else nxt
            if position > self._committed.get(tp, -1):
                out[tp] = position
        return out

    def mark_committed(self, positions: dict[TopicPartition, int]) -> None:
        self._committed.update(positions)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drop partitions this process no longer owns (after a rebalance)."""
        for tp in partitions:
            self._pending.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)

    def in_flight(self) -> int:
        return sum(len(p) for p in self._pending.values())
