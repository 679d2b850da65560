"""Takes, renews and gives back this edge's result partition through the lease log."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, for_code
from aiokafka.structs import RecordMetadata

from services.edge.leases import Lease, LeaseBook, LeaseRecord
from shared.kafka import cluster_replication, encode, make_consumer, new_topic
from shared.messages import error_message
from shared.producers import RenewingProducer
from shared.records import read
from shared.settings import TokenbusSettings

log = structlog.get_logger()

TOPIC_ALREADY_EXISTS = 36
LOG_APPEND_TIME = 1
# Longest an edge waits for the lease topic's switch to append time to reach the log.
APPEND_TIME_WAIT_S = 120.0


class TopicNotReady(Exception):
    """A topic the lease needs is not in the cluster's metadata (yet): retried, not fatal."""


class LeaseLost(Exception):
    """The lease log shows another edge holding this edge's partition: stop reading it."""


def lease_topic_configs(ttl_s: float) -> dict[str, str]:
    # Broker append time is the one clock every reader agrees on. Compaction keeps the log
    # short, but never touches records younger than many TTLs: every live lease's latest
    # renewal is always read as it was written.
    return {
        "cleanup.policy": "compact",
        "message.timestamp.type": "LogAppendTime",
        "min.compaction.lag.ms": str(max(60_000, int(ttl_s * 6_000))),
        "segment.ms": str(max(600_000, int(ttl_s * 60_000))),
    }


async def ensure_lease_topic(admin: AIOKafkaAdminClient, topic: str, ttl_s: float) -> None:
    """Create the lease topic, or make an existing one use broker append time."""
    configs = lease_topic_configs(ttl_s)
    replication = await cluster_replication(admin)
    response = await admin.create_topics([new_topic(topic, 1, replication, configs)])
    errors = [e for _, e, *_ in response.topic_errors if e not in (0, TOPIC_ALREADY_EXISTS)]
    if errors:
        message = f"could not create the lease topic {topic}: error codes {errors}"
        if all(for_code(e).retriable for e in errors):
            raise TopicNotReady(message)  # a controller moving, a node away: tried again
        raise RuntimeError(message)
    if any(e == TOPIC_ALREADY_EXISTS for _, e, *_ in response.topic_errors):
        # Made by someone else (`tokenbus topics create` makes it with default configs):
        # the edge owns this topic's configs.
        resource = ConfigResource(ConfigResourceType.TOPIC, topic, {"message.timestamp.type": None})
        described = (await admin.describe_configs([resource]))[0].to_object()
        entries = described["resources"][0]["config_entries"]
        current = {e["config_names"]: e["config_value"] for e in entries}
        if current.get("message.timestamp.type") != configs["message.timestamp.type"]:
            await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs)])
            log.info("lease_topic.configured", topic=topic, configs=configs)


class LeaseKeeper:
    """Owns this edge's lease: `acquire` once, `keep` while serving, `release` at shutdown.

    The lease only keeps two live edges from reading the same partition; only the log decides
    who holds it. While this edge cannot reach the broker, no other edge can append a claim
    either, so an edge keeps serving through a broker outage and settles the question by the
    log once the broker answers again (see `keep`).
    """

    def __init__(
        self,
        settings: TokenbusSettings,
        topic: str,
        holder: str,
        producer: Callable[[], AIOKafkaProducer | RenewingProducer],
        ttl_s: float,
        on_send: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """`producer()` gives the producer to send with now (the edge may replace it);
        `on_send` hears how each renewal went (None: it was stored)."""
        self._settings = settings
        self._tp = TopicPartition(topic, 0)
        self.holder = holder
        self._producer = producer
        self._ttl_ms = int(ttl_s * 1000)
        self._on_send = on_send or (lambda error: None)
        self.partition: int | None = None
        self._epoch = 0
        self._valid_until_ms = 0  # broker time, as every reader of the log computes it

    async def acquire(self, partitions: int, wanted: int | None, timeout_s: float) -> int:
        """Win a lease on `wanted`, or on the lowest free partition; wait up to `timeout_s`.

        A wanted partition still leased by a dead edge frees itself when its lease lapses,
        so waiting about one TTL is normal after a crash.
        """
        async with self._lease_log() as (consumer, book):
            deadline = time.monotonic() + timeout_s
            while True:
                await self._read_to(consumer, book, None)
                now_ms = int(time.time() * 1000)
                choices = [wanted] if wanted is not None else book.free_at(partitions, now_ms)
                choice = next((p for p in choices if book.holder_at(p, now_ms) is None), None)
                if choice is not None:
                    lease = await self._claim(consumer, book, choice)
                    if lease is not None and lease.holder == self.holder:
                        self._hold(lease)
                        log.info("lease.acquired", partition=choice, epoch=lease.epoch)
                        return choice
                    log.info("lease.lost_race", partition=choice)
                    continue  # someone appended first: look again at once
                if time.monotonic() >= deadline:
                    held = {p: book.holder_at(p, now_ms) for p in range(partitions)}
                    raise RuntimeError(
                        f"no result partition free after {timeout_s:.0f} s"
                        f" (wanted={wanted}, holders={held})"
                    )
                await asyncio.sleep(min(1.0, self._ttl_ms / 4000))

    async def keep(self) -> None:
        """Renew every third of a TTL until cancelled; raise LeaseLost only if taken.

        A renewal that cannot be sent (broker unreachable) is retried at the next beat; the
        edge goes on serving meanwhile. A renewal the broker appended after the lease lapsed
        (the broker was away or hung longer than the TTL) means the partition was free for a
        moment: the edge claims it again through the log, and gives up only if another edge's
        claim is in the log first.
        """
        assert self.partition is not None, "acquire first"
        interval = self._ttl_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                meta = await asyncio.wait_for(
                    self._send("renew", self.partition, self._epoch), timeout=interval
                )
            except (KafkaError, TimeoutError) as exc:
                self._on_send(exc)
                log.warning("lease.renew_failed", partition=self.partition, error=repr(exc))
                continue
            self._on_send(None)
            if meta.timestamp_type == LOG_APPEND_TIME and meta.timestamp < self._valid_until_ms:
                self._valid_until_ms = meta.timestamp + self._ttl_ms
                continue
            log.warning("lease.lapsed", partition=self.partition, epoch=self._epoch)
            try:
                await asyncio.wait_for(self.reassert(), timeout=self._ttl_ms / 1000)
            except (KafkaError, TimeoutError) as exc:
                self._on_send(exc)
                log.warning("lease.reassert_failed", partition=self.partition, error=repr(exc))

    async def reassert(self) -> None:
        """Claim this edge's partition again after a lapse; LeaseLost if another edge has it.

        The claim names the next epoch and wins only if nobody holds the partition at its
        append time; reading the log up to it gives the verdict every reader reaches. A
        live lease of this holder (an earlier renewal landed after all) is kept as it is.
        """
        assert self.partition is not None, "acquire first"
        partition = self.partition
        async with self._lease_log() as (consumer, book):
            await self._read_to(consumer, book, None)
            lease = await self._claim(consumer, book, partition)
        if lease is None or lease.holder != self.holder:
            holder = None if lease is None else lease.holder
            raise LeaseLost(f"partition {partition}: taken by {holder} while this edge was away")
        self._hold(lease)
        log.info("lease.reasserted", partition=partition, epoch=lease.epoch)

    async def release(self) -> None:
        """Free the partition at once for the next edge (best effort: else it lapses)."""
        if self.partition is None:
            return
        try:
            await asyncio.wait_for(self._send("release", self.partition, self._epoch), 5)
            log.info("lease.released", partition=self.partition)
        except (KafkaError, TimeoutError) as exc:
            log.warning("lease.release_failed", partition=self.partition, error=repr(exc))
        self.partition = None

    def _hold(self, lease: Lease) -> None:
        self.partition, self._epoch = lease.partition, lease.epoch
        self._valid_until_ms = lease.valid_until_ms

    async def _claim(
        self, consumer: AIOKafkaConsumer, book: LeaseBook, partition: int
    ) -> Lease | None:
        """Append a claim of the next epoch; return the lease of `partition` it leads to."""
        waiting_since = time.monotonic()
        while True:
            meta = await self._send("claim", partition, book.next_epoch(partition))
            if meta.timestamp_type == LOG_APPEND_TIME:
                break
            # The topic's config change has not reached the broker's log yet (slow on a
            # busy fresh broker); readers ignore this claim, so claiming again is safe.
            if time.monotonic() - waiting_since >= APPEND_TIME_WAIT_S:
                raise RuntimeError(f"{self._tp.topic} does not use LogAppendTime")
            await asyncio.sleep(0.2)
        await self._read_to(consumer, book, meta.offset + 1)
        lease = book.lease(partition)
        return lease if lease is not None and lease.live_at(meta.timestamp) else None

    @contextlib.asynccontextmanager
    async def _lease_log(self) -> AsyncIterator[tuple[AIOKafkaConsumer, LeaseBook]]:
        """A consumer at the start of the lease log, and an empty book to apply it to."""
        consumer = make_consumer(self._settings, group_id=None, client_id=f"{self.holder}-leases")
        await consumer.start()
        try:
            consumer.assign([self._tp])
            await consumer.seek_to_beginning(self._tp)
            yield consumer, LeaseBook()
        finally:
            await consumer.stop()

    async def _send(self, kind: str, partition: int, epoch: int) -> RecordMetadata:
        record = LeaseRecord.model_validate(
            {
                "kind": kind,
                "partition": partition,
                "holder": self.holder,
                "epoch": epoch,
                "ttl_ms": self._ttl_ms,
            }
        )
        meta: RecordMetadata = await self._producer().send_and_wait(
            self._tp.topic, encode(record), key=str(partition).encode(), partition=0
        )
        return meta

    async def _read_to(
        self, consumer: AIOKafkaConsumer, book: LeaseBook, offset: int | None
    ) -> None:
        """Apply every lease record up to `offset` (exclusive), or to the current log end."""
        if offset is None:
            offset = (await consumer.end_offsets([self._tp]))[self._tp]
        while await consumer.position(self._tp) < offset:
            fetched = await consumer.getmany(self._tp, timeout_ms=1000)
            for record in fetched.get(self._tp, []):
                if record.timestamp_type != LOG_APPEND_TIME:
                    continue  # written before the topic was switched to append time
                try:
                    lease = read(LeaseRecord, record.value or b"")
                except ValueError as exc:
                    log.error("lease.invalid", offset=record.offset, error=error_message(exc))
                    continue
                book.apply(lease, record.timestamp)
