"""The one rebalance listener: a consumer group's partition changes handed to their owner.

aiokafka calls it inside the rebalance, so what `revoked` awaits (a last commit, a batch in
hand finishing) happens before another member may read those partitions, and what
`assigned` awaits (a scan, a refill of a memory) before this member reads the new ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from aiokafka import ConsumerRebalanceListener, TopicPartition

Handler = Callable[[set[TopicPartition]], Awaitable[None]]


class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Calls `revoked` and `assigned` with the partitions as sets."""

    def __init__(self, *, revoked: Handler, assigned: Handler) -> None:
        self._revoked = revoked
        self._assigned = assigned

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._assigned(set(assigned))
