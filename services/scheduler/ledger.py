"""Which tier-topic records are handed on, committed so that a restart knows it exactly.

Kafka commits one position per partition, but the scheduler hands requests on out of
order (priority, buckets, deadlines). Like Confluent's Parallel Consumer, each commit's
metadata carries what the position alone cannot say: which offsets between the position
and the highest offset read are still pending (everything else there is handed on), and
the batch-topic floors: for every batches partition, an offset at or below any batch this
scheduler can produce after the commit. After a crash, the new owner of the partition
skips what the commit says is handed on, and finds the requests dispatched between the
last commit and the crash by reading the batches topic from the floors.

Pure: offsets in, positions and metadata strings out.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiokafka import TopicPartition

METADATA_VERSION = 1


@dataclass
class PartitionLedger:
    """One tier partition: what is pending, and what a previous owner already handed on."""

    position: int
    high: int  # one past the highest offset read (or known from a restored commit)
    pending: set[int] = field(default_factory=set)
    # From the commit this ledger was restored from: in [position, restored_high), every
    # offset not in restored_pending was handed on before.
    restored_high: int = 0
    restored_pending: frozenset[int] = frozenset()

    def read(self, offset: int) -> bool:
        """Note a record read at `offset`; False if it was handed on already (skip it)."""
        self.high = max(self.high, offset + 1)
        if offset < self.position:
            return False
        if offset < self.restored_high and offset not in self.restored_pending:
            return False
        self.pending.add(offset)
        return True

    def handed_on(self, offset: int) -> None:
        self.pending.discard(offset)

    def commit_position(self) -> int:
        """Everything below is handed on; gaps (transaction markers) count as handed on."""
        if self.pending:
            return min(self.pending)  # all pending offsets lie below `high`
        unread = [o for o in self.restored_pending if o >= self.high]
        if unread:
            return min(unread)
        return max(self.high, self.restored_high, self.position)

    def span(self) -> int:
        """How far reading has run ahead of the oldest record not handed on."""
        return self.high - self.commit_position()

    def metadata(self, floors: Mapping[int, int]) -> str:
        position = self.commit_position()
        top = max(self.high, self.restored_high)
        still = self.pending | {o for o in self.restored_pending if o >= self.high}
        return encode_metadata(position, top, still, floors)


def encode_metadata(position: int, high: int, pending: set[int], floors: Mapping[int, int]) -> str:
    bits = bytearray((max(0, high - position) + 7) // 8)
    for offset in pending:
        i = offset - position
        if 0 <= i < high - position:
            bits[i // 8] |= 1 << (i % 8)
    packed = base64.b64encode(zlib.compress(bytes(bits), 9)).decode()
    body = {
        "v": METADATA_VERSION,
        "h": high,
        "p": packed,
        "f": {str(k): v for k, v in floors.items()},
    }
    return json.dumps(body, separators=(",", ":"))


@dataclass(frozen=True)
class Restored:
    high: int
    pending: frozenset[int]
    floors: dict[int, int] | None  # None: unknown, read the batches topic from its start


def decode_metadata(position: int, metadata: str) -> Restored:
    """What a commit says; an empty or foreign metadata string says nothing beyond `position`."""
    try:
        body = json.loads(metadata)
        if not isinstance(body, dict) or body.get("v") != METADATA_VERSION:
            raise ValueError("not tokenbus scheduler metadata")
        high = int(body["h"])
        bits = zlib.decompress(base64.b64decode(body["p"]))
        floors = {int(k): int(v) for k, v in body["f"].items()}
    except (ValueError, KeyError, TypeError, zlib.error):
        return Restored(position, frozenset(), None)
    pending = frozenset(
        position + i for i in range(max(0, high - position)) if bits[i // 8] >> (i % 8) & 1
    )
    return Restored(high, pending, floors)


class Ledger:
    """Every tier partition this scheduler owns."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, PartitionLedger] = {}
        self._committed: dict[TopicPartition, tuple[int, str]] = {}

    def restore(self, tp: TopicPartition, committed: int | None, metadata: str) -> Restored:
        """Start owning `tp` from its last commit (None: never committed)."""
        if committed is None or committed < 0:
            self._parts[tp] = PartitionLedger(position=0, high=0)
            return Restored(0, frozenset(), None)
        restored = decode_metadata(committed, metadata)
        self._parts[tp] = PartitionLedger(
            position=committed,
            high=committed,
            restored_high=restored.high,
            restored_pending=restored.pending,
        )
        self._committed[tp] = (committed, metadata)
        return restored

    def owns(self, tp: TopicPartition) -> bool:
        return tp in self._parts

    def read(self, tp: TopicPartition, offset: int) -> bool:
        """Note a record of an owned partition; False if it was handed on already."""
        return self._parts[tp].read(offset)

    def handed_on(self, tp: TopicPartition, offset: int) -> None:
        part = self._parts.get(tp)
        if part is not None:
            part.handed_on(offset)

    def span(self, tp: TopicPartition) -> int:
        part = self._parts.get(tp)
        return 0 if part is None else part.span()

    def behind(self, tp: TopicPartition, offset: int) -> int:
        """How far reading has run past `offset` of `tp` (0 if not owned)."""
        part = self._parts.get(tp)
        return 0 if part is None else part.high - offset

    def owned(self) -> list[TopicPartition]:
        return list(self._parts)

    def pending(self) -> int:
        return sum(len(p.pending) for p in self._parts.values())

    def committable(self, floors: Mapping[int, int]) -> dict[TopicPartition, tuple[int, str]]:
        """(position, metadata) of every partition whose commit would change."""
        out: dict[TopicPartition, tuple[int, str]] = {}
        for tp, part in self._parts.items():
            entry = (part.commit_position(), part.metadata(floors))
            if self._committed.get(tp) != entry:
                out[tp] = entry
        return out

    def mark_committed(self, entries: Mapping[TopicPartition, tuple[int, str]]) -> None:
        self._committed.update(entries)

    def forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self._parts.pop(tp, None)
            self._committed.pop(tp, None)
