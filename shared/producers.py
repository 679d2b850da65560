"""An idempotent producer that starts afresh when Kafka says its sequence numbers broke.

aiokafka (0.14; aio-libs/aiokafka#1017, open) never resets an idempotent producer's
sequence numbers: when batches fail during a broker outage, every later write to those
partitions is refused with `OutOfOrderSequenceNumber`, and a failure inside its sender
makes the producer unusable for good. The Java client bumps the producer epoch instead
(KIP-360). Here the broken producer is replaced by a new one (a new producer id, so
sequences restart) built by the same factory; records in flight on the old one fail, and
their writers' own retries carry them on the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    InvalidProducerEpoch,
    KafkaError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    ProducerFenced,
    UnknownProducerId,
)
from aiokafka.structs import RecordMetadata

from shared.kafka import Headers
from shared.retry import retrying

log = structlog.get_logger()

# Errors after which a producer never writes again.
BROKEN = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch, ProducerFenced)
STOP_TIMEOUT_S = 5.0
# One try at starting a fresh producer; a broker that hangs is tried again, not waited on.
START_TIMEOUT_S = 5.0


class RenewingProducer:
    """The part of `AIOKafkaProducer` tokenbus uses, on a producer renewed when broken.

    Caller: one owner (a service's app); `client` and the send methods always reach the
    current producer.
    """

    def __init__(self, make: Callable[[], AIOKafkaProducer]) -> None:
        self._make = make
        self._inner = make()
        self._renewal: asyncio.Task[None] | None = None
        self.renewals = 0

    @property
    def client(self) -> Any:
        return self._inner.client

    async def start(self) -> None:
        await self._inner.start()

    async def settled(self) -> None:
        """Return once no renewal is under way."""
        if self._renewal is not None:
            await asyncio.shield(self._renewal)

    async def renew(self) -> None:
        """Start afresh now, as if broken: for a writer that gave up on a write and cannot
        tell whether it left the producer broken (the edge, after a timeout)."""
        self._broken(self._inner, TimeoutError("a bounded write gave up"))
        await self.settled()

    async def stop(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
        await self._inner.stop()

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        producer = self._inner
        return await self._queued(
            producer,
            producer.send(topic, value, key=key, partition=partition, headers=headers),
        )

    def create_batch(self) -> Any:
        """An empty record batch to fill and hand to `send_batch` (aiokafka's `BatchBuilder`)."""
        return self._inner.create_batch()

    async def partitions_for(self, topic: str) -> set[int]:
        """The topic's partitions, as the producer's metadata has them (waits for it)."""
        partitions: set[int] = await self._inner.partitions_for(topic)
        return partitions

    async def partition_for(self, topic: str, key: bytes) -> int:
        """The partition the producer's partitioner gives `key` in `topic`, as `send` would
        place it (waits for the topic's metadata, like `send`)."""
        producer = self._inner
        await producer.partitions_for(topic)
        partition: int = producer._partition(topic, None, key, None, key, None)
        return partition

    async def send_batch(
        self, batch: Any, topic: str, *, partition: int
    ) -> asyncio.Future[RecordMetadata]:
        """Queue a filled batch for one partition; the future says whether it was stored."""
        producer = self._inner
        return await self._queued(producer, producer.send_batch(batch, topic, partition=partition))

    async def _queued(
        self,
        producer: AIOKafkaProducer,
        send: Awaitable[asyncio.Future[RecordMetadata]],
    ) -> asyncio.Future[RecordMetadata]:
        """Await one of `producer`'s sends: a broken producer is renewed, a stored record seen."""
        try:
            future = await send
        except (*BROKEN, ProducerClosed) as exc:
            self._broken(producer, exc)
            raise
        except KafkaError as exc:
            if self._sender_dead(producer):
                self._broken(producer, exc)
            raise
        future.add_done_callback(functools.partial(self._stored, producer))
        return future

    async def send_and_wait(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> RecordMetadata:
        return await (await self.send(topic, value, key=key, partition=partition, headers=headers))

    def _stored(self, producer: AIOKafkaProducer, future: asyncio.Future[RecordMetadata]) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if isinstance(exc, BROKEN) or (exc is not None and self._sender_dead(producer)):
            self._broken(producer, exc)

    @staticmethod
    def _sender_dead(producer: AIOKafkaProducer) -> bool:
        sender = getattr(producer, "_sender", None)
        task = getattr(sender, "sender_task", None)
        return task is not None and task.done()

    def _broken(self, producer: AIOKafkaProducer, exc: BaseException) -> None:
        if producer is not self._inner or self._renewal is not None:
            return  # an old producer's late failure, or a renewal already under way
        log.warning("producer.broken", error=repr(exc))
        self._renewal = asyncio.get_running_loop().create_task(self._renew(producer))

    async def _renew(self, broken: AIOKafkaProducer) -> None:
        async def start_fresh() -> AIOKafkaProducer:
            fresh = self._make()
            try:
                async with asyncio.timeout(START_TIMEOUT_S):  # TimeoutError is an OSError
                    await fresh.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    await fresh.stop()
                raise
            return fresh

        try:
            self._inner = await retrying(
                start_fresh, within_s=None, what="producer_start", retry_on=(KafkaError, OSError)
            )
            self.renewals += 1
            log.warning("producer.renewed", renewals=self.renewals)
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await broken.stop()
            except (KafkaError, TimeoutError) as exc:
                log.warning("producer.stop_failed", error=repr(exc))
        finally:
            self._renewal = None
