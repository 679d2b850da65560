"""A bound on bytes the edge holds for all its clients together: the request bodies being
read (`openai/routes.py` `read_body`) and the frames queued for clients (`outbox.py`).
Each use has one; a taker that would pass it is refused, and gives back what it took."""

from __future__ import annotations


class ByteBudget:
    """Bytes held against `limit`, taken and given back by the event loop's callers."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size
