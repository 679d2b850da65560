"""Result records on their way out: every run's records, produced in batches per reply partition.

A run puts its records here without waiting (`put`); one lane per reply partition takes
whatever has queued meanwhile and produces it as one Kafka record batch, so N records cost
one produce call and one future instead of N of each. A lane keeps at most one batch
queued behind the one in flight (aiokafka's own rule for a partition), and records of one
run go out in the order they were put. Each record says to its `Ticket` whether it was
stored. A batch that cannot be queued (no metadata for the topic, a full buffer) is
retried with backoff for up to `within_s`, then its records fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from aiokafka.structs import RecordMetadata

from shared.kafka import Headers
from shared.messages import ReplyTo
from shared.results import WRITE_ERRORS
from shared.retry import retrying

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

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> asyncio.Future[RecordMetadata]: ...


@dataclass(slots=True)
class _Record:
    key: bytes
    value: bytes
    headers: Headers | None
    ticket: Ticket


@dataclass
class _Lane:
    topic: str
    partition: int | None  # None: the producer's partitioner places each record by key
    queue: deque[_Record] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class ResultOutbox:
    """Caller: every run's `ReplyWriter` (`put`); the worker owns it (`async with`)."""

    def __init__(self, producer: BatchProducer, *, within_s: float) -> None:
        self._producer = producer
        self._within_s = within_s
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
        where = (reply_to.topic, reply_to.partition)
        lane = self._lanes.get(where)
        if lane is None:
            lane = self._lanes[where] = _Lane(*where)
            task = asyncio.get_running_loop().create_task(self._run(lane))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        lane.queue.append(_Record(key, value, headers, ticket))
        lane.wakeup.set()

    async def _run(self, lane: _Lane) -> None:
        try:
            while True:
                if not lane.queue:
                    lane.wakeup.clear()
                    try:
                        async with asyncio.timeout(LANE_IDLE_S):
                            await lane.wakeup.wait()
                    except TimeoutError:
                        if not lane.queue:
                            return
                if lane.partition is None:
                    await self._send_one(lane)
                else:
                    await self._send_batch(lane, lane.partition)
        finally:
            if self._lanes.get((lane.topic, lane.partition)) is lane:
                del self._lanes[(lane.topic, lane.partition)]
            for record in lane.queue:  # cancelled at shutdown: nobody waits for these
                record.ticket.failed(asyncio.CancelledError())

    async def _send_batch(self, lane: _Lane, partition: int) -> None:
        batch = self._producer.create_batch()
        taken: list[Ticket] = []
        queue = lane.queue
        while queue:
            record = queue[0]
            if (
                batch.append(
                    key=record.key, value=record.value, timestamp=None, headers=record.headers or []
                )
                is None
            ):
                break  # full: the rest goes in the next batch
            queue.popleft()
            taken.append(record.ticket)
        future = await self._queued(
            lambda: self._producer.send_batch(batch, lane.topic, partition=partition),
            taken,
            lane.topic,
        )
        if future is not None:
            future.add_done_callback(_settle(taken))

    async def _send_one(self, lane: _Lane) -> None:
        record = lane.queue.popleft()
        future = await self._queued(
            lambda: self._producer.send(
                lane.topic, record.value, key=record.key, headers=record.headers
            ),
            [record.ticket],
            lane.topic,
        )
        if future is not None:
            future.add_done_callback(_settle([record.ticket]))

    async def _queued(
        self,
        send: Callable[[], Any],
        tickets: list[Ticket],
        topic: str,
    ) -> asyncio.Future[RecordMetadata] | None:
        """The future of a batch queued by `send`, retried; None if it could not be queued."""
        try:
            future: asyncio.Future[RecordMetadata] = await retrying(
                send,
                within_s=self._within_s,
                what="results",
                retry_on=WRITE_ERRORS,
                topic=topic,
                records=len(tickets),
            )
        except WRITE_ERRORS as exc:
            for ticket in tickets:
                ticket.failed(exc)
            return None
        return future


def _settle(tickets: list[Ticket]) -> Callable[[asyncio.Future[RecordMetadata]], None]:
    def settle(future: asyncio.Future[RecordMetadata]) -> None:
        error: BaseException | None
        error = asyncio.CancelledError() if future.cancelled() else future.exception()
        for ticket in tickets:
            if error is None:
                ticket.stored()
            else:
                ticket.failed(error)

    return settle
