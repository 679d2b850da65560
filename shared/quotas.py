"""A token bucket on the caller's clock: the one rate rule of the edge's and ingest's quotas."""

from __future__ import annotations


class TokenBucket:
    """`capacity` units, refilled at `rate` per second; the caller's clock."""

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self._at = now

    def resize(self, rate: float, capacity: float) -> None:
        """New limits (the keys file changed): keep what was used, not more than fits."""
        self.rate = rate
        self.capacity = capacity
        self.level = min(self.level, capacity)

    def wait_s(self, cost: float, now: float) -> float | None:
        """Seconds until `cost` units are there (0: now); None if they never can be."""
        if cost > self.capacity:
            return None
        self._fill(now)
        return max(0.0, (cost - self.level) / self.rate)

    def take(self, cost: float, now: float) -> None:
        self._fill(now)
        self.level -= cost

    def _fill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = max(self._at, now)
