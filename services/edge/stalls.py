"""Streams that stopped getting records: ended with an error instead of left open forever.

A worker whose records were lost in a broker outage (an idempotent producer cannot resend a
failed batch in order) may never write a stream's final record; without this the client
would wait forever on an open socket. Pure, with the caller's clock:

- a stream is watched once a record of it arrived, or once a broker outage it was open
  through is over (it may have lost its request then);
- silence counts only while the broker is reachable: `outage_over` restarts every clock;
- a queued stream with no record yet is not watched (queueing may be long by design).
"""

from __future__ import annotations

from collections.abc import Iterable


class StallGuard:
    """request_id -> when it last showed progress.

    Caller: the edge (`seen` per result record, `forget` when a stream ends, `outage_over`
    when the broker is back, `due` from housekeeping).
    """

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._last: dict[str, float] = {}

    def seen(self, request_id: str, now: float) -> None:
        self._last[request_id] = now

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def outage_over(self, open_ids: Iterable[str], now: float) -> None:
        """The broker is back: silence until now does not count, and open streams are watched."""
        for request_id in open_ids:
            self._last[request_id] = now
        for request_id in self._last:
            self._last[request_id] = now

    def due(self, now: float) -> list[str]:
        """Streams silent for `stall_s`; they are forgotten (the caller ends them)."""
        out = [rid for rid, at in self._last.items() if now - at >= self.stall_s]
        for request_id in out:
            del self._last[request_id]
        return out

    def next_at(self) -> float | None:
        return min(self._last.values()) + self.stall_s if self._last else None

    def __len__(self) -> int:
        return len(self._last)
