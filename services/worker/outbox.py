"""Result records on their way out: every run's records, produced in batches per reply partition.

A run puts its records here without waiting (`put`); one lane per reply partition takes
whatever has queued meanwhile and produces it as one Kafka record batch, so N records cost
one produce call and one future instead of N of each. Records of one run go out in the
order they were put, and **a lane never sends a record before every earlier one is stored**:
it has one batch out at a time (aiokafka sends one per partition at a time anyway), and a
batch Kafka did not take (not queued, or not stored: expired in a broker outage, failed with
the producer's broken sequence numbers) is sent again, the same records in the same order,
with backoff, for up to `resend_s` since its first failure (ADR 0048). Only then do its
records fail, together with every later record of the same runs still queued, so a stream
on the log never has a hole: it stops, and the run is handed back as the next attempt. A
re-send may store a record twice (the first try was stored, its answer lost): the same
bytes at the same `(attempt, seq)`, which every reader drops.

A record without a partition (a keyed cache write, a `reply_to` naming only a topic) is
placed first, by the producer's partitioner, on its partition's lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from shared.kafka import Headers
from shared.messages import ReplyTo
from shared.results import WRITE_ERRORS
from shared.retry import Backoff, retrying

log = structlog.get_logger()

LANE_IDLE_S = 60.0  # a lane with nothing to send for this long ends (reply topics come and go)


class Ticket(Protocol):
    """Who is told the fate of a record: one run's writer. Called from the event loop."""

    def stored(self) -> None: ...

    def failed(self, error: BaseException) -> None: ...


class BatchProducer(Protocol):
    """What the outbox needs of a producer (`RenewingProducer`, or a fake in unit tests)."""

    def create_batch(self) -> Any: ...

    async def send_batch(
        self, batch: Any, topic: str, *, partition: int
    ) -> asyncio.Future[RecordMetadata]: ...

    async def partition_for(self, topic: str, key: bytes) -> int: ...


@dataclass(slots=True)
class _Record:
    key: bytes
    value: bytes
    headers: Headers | None
    ticket: Ticket


@dataclass
class _Lane:
    topic: str
    partition: int | None  # None: records are placed on their partition's lane first
    queue: deque[_Record] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    sending: list[_Record] = field(default_factory=list)  # the batch out, until it is stored


class ResultOutbox:
    """Caller: every run's `ReplyWriter` (`put`); the worker owns it (`async with`)."""

    def __init__(self, producer: BatchProducer, *, resend_s: float) -> None:
        self._producer = producer
        self._resend_s = resend_s
        self._lanes: dict[tuple[str, int | None], _Lane] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> ResultOutbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def put(
        self, reply_to: ReplyTo, key: bytes, value: bytes, headers: Headers | None, ticket: Ticket
    ) -> None:
        """Queue one record for `reply_to`, after every record put before it."""
        self._append(reply_to.topic, reply_to.partition, _Record(key, value, headers, ticket))

    def _append(self, topic: str, partition: int | None, record: _Record) -> None:
        lane = self._lanes.get((topic, partition))
        if lane is None:
            lane = self._lanes[(topic, partition)] = _Lane(topic, partition)
            task = asyncio.get_running_loop().create_task(self._run(lane))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        lane.queue.append(record)
        lane.wakeup.set()

    async def _run(self, lane: _Lane) -> None:
        try:
            while True:
                if not lane.queue:  # (a failed run's records may have been taken out)
                    lane.wakeup.clear()
                    try:
                        async with asyncio.timeout(LANE_IDLE_S):
                            await lane.wakeup.wait()
                    except TimeoutError:
                        if not lane.queue:
                            return
                    continue
                if lane.partition is None:
                    await self._place(lane)
                else:
                    await self._deliver(lane, lane.partition)
        finally:
            if self._lanes.get((lane.topic, lane.partition)) is lane:
                del self._lanes[(lane.topic, lane.partition)]
            # Cancelled at shutdown: nobody waits for these.
            for record in [*lane.sending, *lane.queue]:
                record.ticket.failed(asyncio.CancelledError())

    async def _place(self, lane: _Lane) -> None:
        """Move the next record to its partition's lane (the producer's partitioner decides)."""
        record = lane.queue[0]
        partition = 0
        error: BaseException | None = None
        try:
            partition = await retrying(
                lambda: self._producer.partition_for(lane.topic, record.key),
                within_s=self._resend_s,
                what="results_placement",
                retry_on=WRITE_ERRORS,
                topic=lane.topic,
            )
        except WRITE_ERRORS as exc:  # no metadata for the topic: nothing of it was sent
            error = exc
        if not lane.queue or lane.queue[0] is not record:
            return  # its run failed meanwhile: already taken out and told by `_fail`
        lane.queue.popleft()
        if error is not None:
            self._fail(lane.topic, [record], error)
        else:
            self._append(lane.topic, partition, record)

    async def _deliver(self, lane: _Lane, partition: int) -> None:
        """Send the next batch of `lane` until it is stored, or fail it after `resend_s`."""
        lane.sending = records = self._take(lane)
        backoff = Backoff()
        first_failure: float | None = None
        tries = 0
        while True:
            tries += 1
            error = await self._send_once(lane.topic, partition, records)
            if error is None:
                lane.sending = []
                for record in records:
                    record.ticket.stored()
                return
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            wait = backoff.next()
            gives_up = now - first_failure + wait > self._resend_s
            log.warning(
                "results.gave_up" if gives_up else "results.resend",
                topic=lane.topic,
                partition=partition,
                records=len(records),
                tries=tries,
                error=repr(error)[:300],
            )
            if gives_up:
                lane.sending = []
                self._fail(lane.topic, records, error)
                return
            await asyncio.sleep(wait)  # meanwhile a broken producer is renewed (producers.py)

    def _take(self, lane: _Lane) -> list[_Record]:
        """The records at the head of `lane` that fit in one batch."""
        batch = self._producer.create_batch()
        taken: list[_Record] = []
        queue = lane.queue
        # An empty batch takes any one record, however large: Kafka judges it.
        while queue and _append_to(batch, queue[0]):
            taken.append(queue.popleft())
        return taken

    async def _send_once(
        self, topic: str, partition: int, records: list[_Record]
    ) -> BaseException | None:
        """One try at storing `records` as one batch; the error if it failed."""
        batch = self._producer.create_batch()
        for record in records:
            _append_to(batch, record)
        try:
            future = await self._producer.send_batch(batch, topic, partition=partition)
            await asyncio.wait((future,))
        except WRITE_ERRORS as exc:
            return exc
        error: BaseException | None
        if future.cancelled():  # its producer was stopped (renewed) with the batch in it
            error = KafkaError("the batch was cancelled with its producer")
        else:
            error = future.exception()
        return error

    def _fail(self, topic: str, records: list[_Record], error: BaseException) -> None:
        """Fail `records`, and every record of the same runs still queued for `topic`: a
        run's later record must never be stored after an earlier one was not."""
        runs = {id(r.ticket) for r in records}
        for record in records:
            record.ticket.failed(error)
        for lane in list(self._lanes.values()):
            if lane.topic != topic:
                continue
            later = [r for r in lane.queue if id(r.ticket) in runs]
            if later:
                lane.queue = deque(r for r in lane.queue if id(r.ticket) not in runs)
                for record in later:
                    record.ticket.failed(error)


def _append_to(batch: Any, record: _Record) -> bool:
    """Add `record` to an aiokafka `BatchBuilder`; False if the batch is full."""
    appended = batch.append(
        key=record.key, value=record.value, timestamp=None, headers=record.headers or []
    )
    return appended is not None
