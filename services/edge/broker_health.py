"""Whether this edge can reach the broker now, judged from its own bounded Kafka calls.

Pure: the edge reports the outcome of each bounded call (a request's produce, a lease
renewal, a probe) with its clock, and asks before it writes a new request. While the broker
is unreachable a new request is refused at once with `overloaded` and a `retry_after_ms`,
instead of being queued in the producer, where it would be sent after the broker returns
to a client that was told it failed.
"""

from __future__ import annotations

from dataclasses import dataclass


class BrokerUnavailable(Exception):
    """A bounded Kafka call of the edge timed out or failed: the broker is unreachable now."""


@dataclass
class BrokerHealth:
    """The edge's view of the broker.

    Caller: the edge, after each bounded Kafka call (`failed`, `succeeded`).
    Affects: `reachable`, which decides whether a new request is written or refused.
    """

    retry_after_ms: int
    reachable: bool = True
    changed_at: float = 0.0  # caller's clock, when `reachable` last flipped

    def failed(self, now: float) -> bool:
        """A call failed; True if this turned the broker unreachable."""
        if not self.reachable:
            return False
        self.reachable, self.changed_at = False, now
        return True

    def succeeded(self, now: float) -> bool:
        """A call succeeded; True if this turned the broker reachable again."""
        if self.reachable:
            return False
        self.reachable, self.changed_at = True, now
        return True

    def down_for(self, now: float) -> float:
        """Seconds the broker has been unreachable (0 while reachable)."""
        return 0.0 if self.reachable else now - self.changed_at
