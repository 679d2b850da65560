"""Which broker nodes the edge's writes wait on in vain, and where a new request goes.

Pure: the edge reports each write's outcome with the node that led its partition and its
clock, and asks where to write a new request. A node whose write has not landed in the
produce timeout is avoided for `avoid_s`: with one node of three away (killed, hung, cut
off) its partitions have no usable leader until the controller elects new ones (after
`broker.session.timeout.ms`) or the node answers again, and a request keyed to one of them
would wait that long. New requests go to a partition of the same topic led by a node that
answers, as the Java client's adaptive partitioner does (KIP-794); with every node
answering, the keyed partition, as before.

The evidence kept here also separates "one leader is away" from "the broker is away": a
call that failed while other calls landed is the first (ADR 0049).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from aiokafka.partitioner import murmur2


def keyed_partition(key: bytes, partitions: int) -> int:
    """The partition the Kafka clients' default partitioner gives `key` (murmur2)."""
    hashed: int = murmur2(key)
    return (hashed & 0x7FFFFFFF) % partitions


@dataclass
class Leaders:
    """The edge's view of the partition leaders its writes go to.

    Caller: the broker link, after each bounded Kafka call (`landed`, `waited`) and before
    each new request's write (`choose`). Affects: which partition a request is written to;
    whether a failure means the broker is away (`answered_since`).
    """

    avoid_s: float
    _avoid_until: dict[int, float] = field(default_factory=dict)
    landed_at: float = float("-inf")  # caller's clock, when a call last succeeded

    def landed(self, node: int | None, now: float) -> None:
        """A call succeeded (to `node`, where known): that node answers."""
        self.landed_at = now
        if node is not None:
            self._avoid_until.pop(node, None)

    def waited(self, node: int | None, now: float) -> bool:
        """A write to `node` did not land in the produce timeout: avoid it for a while.
        True if that begins its avoidance (it was in use until now)."""
        if node is None:
            return False
        began = self._avoid_until.get(node, float("-inf")) <= now
        self._avoid_until[node] = now + self.avoid_s
        return began

    def answered_since(self, since: float) -> bool:
        """Whether some call landed after `since`: the cluster answers, if not every node."""
        return self.landed_at > since

    def avoided(self, now: float) -> frozenset[int]:
        return frozenset(n for n, until in self._avoid_until.items() if until > now)

    def choose(self, key: bytes, leaders: Mapping[int, int | None], now: float) -> int | None:
        """The partition for a new request keyed `key`; None: leave it to the producer.

        `leaders`: each partition of the topic and its leader node (None or negative while
        it has none). The keyed partition while its leader answers; else one of the
        partitions whose leader does, by the same hash; None when no partition has one
        (the write then waits or fails as the producer decides).
        """
        if not leaders:
            return None
        partitions = sorted(leaders)
        keyed = partitions[keyed_partition(key, len(partitions))]
        avoided = self.avoided(now)

        def usable(p: int) -> bool:
            leader = leaders[p]
            return leader is not None and leader >= 0 and leader not in avoided

        if usable(keyed):
            return keyed
        good = [p for p in partitions if usable(p)]
        return good[keyed_partition(key, len(good))] if good else None
