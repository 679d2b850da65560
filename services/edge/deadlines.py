"""Keys that fall due at a time: disconnect grace periods, per-request topic retention."""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

K = TypeVar("K")


class Deadlines(Generic[K]):
    """At most one deadline per key; setting a key again moves it. Pure: the caller's clock."""

    def __init__(self) -> None:
        self._due: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._tick = 0  # breaks ties so keys themselves are never compared

    def set(self, key: K, at: float) -> None:
        self._due[key] = at
        self._tick += 1
        heapq.heappush(self._heap, (at, self._tick, key))

    def cancel(self, key: K) -> bool:
        """Forget `key`; True if it was pending."""
        return self._due.pop(key, None) is not None

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def __len__(self) -> int:
        return len(self._due)

    def next_at(self) -> float | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[K]:
        """Keys whose deadline is at or before `now`, earliest first; they are forgotten."""
        out: list[K] = []
        while True:
            self._drop_stale()
            if not self._heap or self._heap[0][0] > now:
                return out
            _, _, key = heapq.heappop(self._heap)
            del self._due[key]
            out.append(key)

    def _drop_stale(self) -> None:
        # Heap entries of moved or cancelled keys are skipped lazily.
        while self._heap:
            at, _, key = self._heap[0]
            if self._due.get(key) == at:
                return
            heapq.heappop(self._heap)
