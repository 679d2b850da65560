"""A request held long far behind its tier partition's reading moves to the partition's tail.

A tier partition's commit position is its oldest record not handed on (ledger.py), and
reading stops `TOKENBUS_SCHEDULER_MAX_OPEN_OFFSETS` (16,000) ahead of it. One request that
waits for good (pinned to a variant no worker declares, a model whose pool cannot start,
no deadline) held that position until the unserved hold answered it (600 s), and a busy
partition paused for every tenant meanwhile, across restarts (issue 37, N3).

So a request that has waited `TOKENBUS_SCHEDULER_REQUEUE_AFTER_S` (30 s) and lies more
than half that span behind the partition's reading is written again at the partition's
tail, `requeued` one higher, and its old record is handed on: the position moves past it.
It keeps its creation time (its deadline, its age, the unserved hold) and its request id,
attempt and trace; only its place in the partition changes. The copy is written, and
stored, before the old record is handed on, so a crash between the two leaves both on the
partition, never neither; admission lets exactly one of them in (admission.py: the copy
this process moved, or the first read).

Caller: the scheduler's step (`Steps`), under its lock, before it commits; it hands on the
records moved. Affects: the backlog (takes the request out), admission's memory of moved
copies, the tier topic (the copy, sent again until stored, as a batch is).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from aiokafka import TopicPartition
from aiokafka.structs import RecordMetadata

from services.scheduler.admission import Admission, Waiting
from services.scheduler.backlog import Passenger
from services.scheduler.ledger import Ledger
from services.scheduler.policy import Policy
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS
from shared.retry import retrying

log = structlog.get_logger()

MOST_PER_STEP = 64  # moved in one step at most (each is one write)


def due(
    passengers: list[Passenger[Waiting]],
    behind: Callable[[TopicPartition, int], int],
    limit: int,
    after_s: float,
    now: float,
) -> list[Passenger[Waiting]]:
    """The waiting requests to move: waited `after_s`, and more than `limit // 2` offsets
    behind their partition's reading (`behind(tp, offset)`); oldest offset first."""
    out = [
        p
        for p in passengers
        if now - p.arrived >= after_s and behind(p.item.tp, p.item.offset) > limit // 2
    ]
    out.sort(key=lambda p: p.item.offset)
    return out[:MOST_PER_STEP]


class Requeue:
    """Moves requests held far behind to their partition's tail (see the module)."""

    def __init__(
        self,
        policy: Policy[Waiting],
        ledger: Ledger,
        admission: Admission,
        producer: RenewingProducer,
        limit: int,
        after_s: float,
    ) -> None:
        self._policy = policy
        self._ledger = ledger
        self._admission = admission
        self._producer = producer
        self._limit = limit
        self._after_s = after_s

    def _spread(self) -> set[TopicPartition]:
        """Partitions read more than half the limit ahead of their oldest record."""
        return {tp for tp in self._ledger.owned() if self._ledger.span(tp) > self._limit // 2}

    async def step(self, now: float) -> list[Waiting]:
        """Move what is due; the records moved away, each to be handed on (their copies
        are stored)."""
        spread = self._spread()
        if not spread:
            return []
        waiting = [p for p in self._policy.backlog.passengers() if p.item.tp in spread]
        moved = due(waiting, self._ledger.behind, self._limit, self._after_s, now)
        for p in moved:
            await self._move(p, now)
        return [p.item for p in moved]

    async def _move(self, p: Passenger[Waiting], now: float) -> None:
        w = p.item
        copy = w.request.model_copy(update={"requeued": w.request.requeued + 1})
        value = copy.model_dump_json().encode()
        # Out of the backlog, and the copy awaited, before it can be read back.
        self._policy.backlog.remove(p)
        self._admission.moved(w)

        async def send() -> RecordMetadata:
            return await self._producer.send_and_wait(
                w.tp.topic, value, key=w.request.request_id.encode(), partition=w.tp.partition
            )

        # Sent again until stored, as a batch is: a second copy stored is dropped when read.
        stored = await retrying(
            send, within_s=None, what="requeue", retry_on=WRITE_ERRORS, request_id=copy.request_id
        )
        log.info(
            "request.requeued",
            request_id=copy.request_id,
            topic=w.tp.topic,
            partition=w.tp.partition,
            offset=w.offset,
            to_offset=stored.offset,
            requeued=copy.requeued,
            waited_s=round(now - p.arrived, 3),
        )
