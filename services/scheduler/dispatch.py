"""Carrying out a plan's dispatches: each batch formed, sent to its worker, stored for sure.

The batches of one step are sent together and then awaited, so they share produce
requests. A batch's passengers have left the backlog, so there is no way back: a broker
outage holds the step until each batch is stored. Should a failed send have been stored
after all, the worker skips the second copy (it remembers batch ids).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import structlog
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from services.scheduler.admission import Waiting
from services.scheduler.policy import Dispatch
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.workers import WorkerRegistry
from shared.kafka import Headers, encode
from shared.messages import Batch
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS
from shared.retry import retrying

log = structlog.get_logger()


@dataclass(frozen=True)
class Outgoing:
    """A batch on its way to its worker's partition, encoded once."""

    dispatch: Dispatch[Waiting]
    batch: Batch
    partition: int
    value: bytes
    headers: Headers


class Dispatcher:
    """Sends batches; remembers the last offset written per batches partition.

    Caller: the scheduler's stepper, one step at a time.
    """

    def __init__(
        self,
        topic: str,
        producer: RenewingProducer,
        telemetry: SchedulerTelemetry,
        workers: WorkerRegistry,
    ) -> None:
        self._topic = topic
        self._producer = producer
        self._telemetry = telemetry
        self._workers = workers
        self.last_produced: dict[int, int] = {}  # batches partition -> last offset we wrote

    def outgoing(self, dispatch: Dispatch[Waiting], now: float) -> Outgoing:
        """Form the batch of a dispatch; its requests carry their `batch_form` context."""
        requests = [p.item.request for p in dispatch.passengers]
        batch_id, formed_at = uuid.uuid4().hex, time.time()
        trace = self._telemetry.batch_formed(
            batch_id=batch_id,
            tier=dispatch.tier,
            reason=dispatch.reason,
            requests=requests,
            departed_at=now,
            formed_at=formed_at,
        )
        batch = Batch(
            batch_id=batch_id,
            tier=dispatch.tier,
            requests=[
                r.model_copy(update={"trace": t})
                for r, t in zip(requests, trace.request_traces, strict=True)
            ],
            reason=dispatch.reason,
            formed_at=formed_at,
            worker_id=dispatch.worker_id,
        )
        partition = self._workers.partition_of(dispatch.worker_id)
        return Outgoing(dispatch, batch, partition, encode(batch), trace.headers)

    async def dispatch(self, dispatches: list[Dispatch[Waiting]], now: float) -> list[Outgoing]:
        """Send every batch and wait until each is stored; returns them in order."""
        sends: list[tuple[Outgoing, asyncio.Future[RecordMetadata] | None]] = []
        for d in dispatches:
            out = self.outgoing(d, now)
            future: asyncio.Future[RecordMetadata] | None
            try:
                future = await self._send(out)
            except WRITE_ERRORS as exc:
                log.warning("batch.send_failed", batch_id=out.batch.batch_id, error=repr(exc))
                future = None
            sends.append((out, future))
        for out, future in sends:
            sent = await self._stored(out, future)
            self._telemetry.batch_sent(out.batch.batch_id)
            self._workers.dispatched(out.dispatch.worker_id, sent.offset, len(out.batch.requests))
            self.last_produced[sent.partition] = max(
                sent.offset, self.last_produced.get(sent.partition, -1)
            )
            d = out.dispatch
            log.info(
                "batch.dispatched",
                batch_id=out.batch.batch_id,
                worker_id=d.worker_id,
                tier=d.tier.value,
                size=len(d.passengers),
                filled=d.filled,
                tokens=d.tokens,
                reason=d.reason,
                partition=sent.partition,
                offset=sent.offset,
            )
        return [out for out, _ in sends]

    async def _send(self, out: Outgoing) -> asyncio.Future[RecordMetadata]:
        return await self._producer.send(
            self._topic,
            out.value,
            key=out.batch.batch_id.encode(),
            partition=out.partition,
            headers=out.headers,
        )

    async def _stored(
        self, out: Outgoing, future: asyncio.Future[RecordMetadata] | None
    ) -> RecordMetadata:
        """The batch record's metadata once stored: sent again (with backoff) until it is."""
        if future is not None:
            try:
                return await future
            except KafkaError as exc:
                log.warning("batch.send_failed", batch_id=out.batch.batch_id, error=repr(exc))

        async def resend() -> RecordMetadata:
            return await (await self._send(out))

        return await retrying(
            resend, within_s=None, what="batch", retry_on=WRITE_ERRORS, batch_id=out.batch.batch_id
        )
