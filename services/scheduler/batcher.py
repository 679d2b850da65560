"""The bus rule: a tier's batch leaves when full or when its oldest passenger waited enough."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from shared.messages import Tier

T = TypeVar("T")

DispatchReason = Literal["full", "timeout"]


@dataclass(frozen=True)
class TierPolicy:
    max_batch_size: int
    max_wait_ms: float


@dataclass(frozen=True)
class Passenger(Generic[T]):
    item: T
    arrived: float


@dataclass(frozen=True)
class Departure(Generic[T]):
    tier: Tier
    items: list[T]
    reason: DispatchReason


@dataclass
class BusRule(Generic[T]):
    """Per-tier FIFO queues; `due(now)` returns the batches that leave now, interactive first."""

    policies: dict[Tier, TierPolicy]
    _queues: dict[Tier, deque[Passenger[T]]] = field(default_factory=dict)

    def add(self, tier: Tier, item: T, now: float) -> None:
        self._queues.setdefault(tier, deque()).append(Passenger(item, now))

    def due(self, now: float) -> list[Departure[T]]:
        out: list[Departure[T]] = []
        for tier in (Tier.interactive, Tier.background):
            queue = self._queues.get(tier)
            policy = self.policies[tier]
            while queue:
                if len(queue) >= policy.max_batch_size:
                    reason: DispatchReason = "full"
                elif (now - queue[0].arrived) * 1000.0 >= policy.max_wait_ms:
                    reason = "timeout"
                else:
                    break
                take = min(len(queue), policy.max_batch_size)
                items = [queue.popleft().item for _ in range(take)]
                out.append(Departure(tier, items, reason))
        return out

    def next_departure(self) -> float | None:
        """The clock time at which the oldest waiting passenger's wait runs out."""
        times = [
            q[0].arrived + self.policies[t].max_wait_ms / 1000.0
            for t, q in self._queues.items()
            if q
        ]
        return min(times) if times else None

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())
