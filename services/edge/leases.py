"""Result-partition leases: the rules that decide, from the lease log, which edge owns which.

The lease log is one Kafka partition (compacted, `message.timestamp.type=LogAppendTime`).
Every edge that reads it applies the same records in the same order with the same broker
timestamps, so every edge reaches the same verdict: the log is the referee, no clock of an
edge decides who holds a partition. Pure: the I/O is in `lease_keeper.py`.

Rules, for one partition, with `ts` the record's broker append time:
- `claim(holder, epoch)` wins if `epoch` is above the current epoch and the current lease is
  absent, released or expired at `ts`. Two edges racing for one partition both propose the
  same next epoch; the first appended wins, the second is below-or-equal and loses.
- `renew(holder, epoch)` extends the lease to `ts + ttl` if it is the current epoch and the
  lease has not expired at `ts`. Only the winner of an epoch ever renews it, so a renewal of
  an epoch the reader did not see won (compaction removed the claim) is believed.
- `release(holder, epoch)` frees the partition at once (clean shutdown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from shared.messages import Model


class LeaseRecord(Model):
    """One record of the lease log; the key is the partition number."""

    kind: Literal["claim", "renew", "release"]
    partition: int = Field(ge=0)
    holder: str = Field(min_length=1, max_length=200)
    epoch: int = Field(ge=1)
    ttl_ms: int = Field(gt=0)


@dataclass(frozen=True)
class Lease:
    partition: int
    holder: str
    epoch: int
    valid_until_ms: int
    released: bool = False

    def live_at(self, now_ms: int) -> bool:
        return not self.released and now_ms < self.valid_until_ms


class LeaseBook:
    """The state of every partition's lease after the records applied so far."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}

    def apply(self, record: LeaseRecord, at_ms: int) -> bool:
        """Apply one record appended at broker time `at_ms`; True if it took effect."""
        current = self._leases.get(record.partition)
        until = at_ms + record.ttl_ms
        if record.kind == "claim":
            if current is not None and (record.epoch <= current.epoch or current.live_at(at_ms)):
                return False
            self._leases[record.partition] = Lease(
                record.partition, record.holder, record.epoch, until
            )
            return True
        if record.kind == "renew":
            if current is None or record.epoch > current.epoch:
                # This reader missed the winning claim (compacted away): only a winner renews.
                self._leases[record.partition] = Lease(
                    record.partition, record.holder, record.epoch, until
                )
                return True
            if record.epoch < current.epoch or current.released:
                return False
            if current.holder == record.holder and not current.live_at(at_ms):
                return False  # too late: the lease had already lapsed
            # Same epoch: either the holder renewing in time, or this reader saw a losing
            # claim of the same epoch as the survivor of compaction; the renewal names the
            # real winner.
            self._leases[record.partition] = Lease(
                record.partition, record.holder, record.epoch, until
            )
            return True
        if current is None or current.epoch != record.epoch or current.holder != record.holder:
            return False
        self._leases[record.partition] = Lease(
            record.partition, record.holder, record.epoch, current.valid_until_ms, released=True
        )
        return True

    def lease(self, partition: int) -> Lease | None:
        return self._leases.get(partition)

    def next_epoch(self, partition: int) -> int:
        current = self._leases.get(partition)
        return 1 if current is None else current.epoch + 1

    def holder_at(self, partition: int, now_ms: int) -> str | None:
        current = self._leases.get(partition)
        return current.holder if current is not None and current.live_at(now_ms) else None

    def free_at(self, partitions: int, now_ms: int) -> list[int]:
        """Partitions below `partitions` that nobody holds at `now_ms`, lowest first."""
        return [p for p in range(partitions) if self.holder_at(p, now_ms) is None]
