"""Takes, renews and gives back this edge's result partition through the lease log."""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from services.edge.leases import LeaseBook, LeaseRecord
from shared.kafka import cluster_replication, encode, make_consumer, new_topic
from shared.settings import TokenbusSettings

log = structlog.get_logger()

TOPIC_ALREADY_EXISTS = 36
LOG_APPEND_TIME = 1
# An edge stops trusting its lease this much before the broker would call it lapsed:
# room for clock-rate drift between the edge and the broker.
SAFETY_FRACTION = 0.2


class LeaseLost(Exception):
    """This edge can no longer prove it holds its partition; it must stop serving from it."""


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
        raise RuntimeError(f"could not create the lease topic {topic}: error codes {errors}")
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
    """Owns this edge's lease: `acquire` once, `keep` while serving, `release` at shutdown."""

    def __init__(
        self,
        settings: TokenbusSettings,
        topic: str,
        holder: str,
        producer: AIOKafkaProducer,
        ttl_s: float,
    ) -> None:
        self._settings = settings
        self._tp = TopicPartition(topic, 0)
        self.holder = holder
        self._producer = producer
        self._ttl_ms = int(ttl_s * 1000)
        self.partition: int | None = None
        self._epoch = 0
        self._valid_until_ms = 0  # broker time, as every reader of the log computes it
        self._trust_until = 0.0  # local monotonic time this edge stops trusting the lease

    async def acquire(self, partitions: int, wanted: int | None, timeout_s: float) -> int:
        """Win a lease on `wanted`, or on the lowest free partition; wait up to `timeout_s`.

        A wanted partition still leased by a dead edge frees itself when its lease lapses,
        so waiting about one TTL is normal after a crash.
        """
        consumer = make_consumer(self._settings, group_id=None, client_id=f"{self.holder}-leases")
        await consumer.start()
        try:
            consumer.assign([self._tp])
            await consumer.seek_to_beginning(self._tp)
            book = LeaseBook()
            deadline = time.monotonic() + timeout_s
            while True:
                await self._read_to(consumer, book, None)
                now_ms = int(time.time() * 1000)
                choices = [wanted] if wanted is not None else book.free_at(partitions, now_ms)
                choice = next((p for p in choices if book.holder_at(p, now_ms) is None), None)
                if choice is not None:
                    epoch = book.next_epoch(choice)
                    sent = time.monotonic()
                    meta = await self._send("claim", choice, epoch)
                    if meta.timestamp_type != LOG_APPEND_TIME:
                        # The topic's config change has not reached the broker's log yet;
                        # readers ignore this claim, so claiming again is safe.
                        if time.monotonic() >= deadline:
                            raise RuntimeError(f"{self._tp.topic} does not use LogAppendTime")
                        await asyncio.sleep(0.1)
                        continue
                    await self._read_to(consumer, book, meta.offset + 1)
                    lease = book.lease(choice)
                    if lease is not None and lease.holder == self.holder and lease.epoch == epoch:
                        self.partition, self._epoch = choice, epoch
                        self._valid_until_ms = lease.valid_until_ms
                        self._trust_until = sent + self._ttl_ms / 1000 * (1 - SAFETY_FRACTION)
                        log.info("lease.acquired", partition=choice, epoch=epoch)
                        return choice
                    log.info("lease.lost_race", partition=choice, epoch=epoch)
                    continue  # someone appended first: look again at once
                if time.monotonic() >= deadline:
                    held = {p: book.holder_at(p, now_ms) for p in range(partitions)}
                    raise RuntimeError(
                        f"no result partition free after {timeout_s:.0f} s"
                        f" (wanted={wanted}, holders={held})"
                    )
                await asyncio.sleep(min(1.0, self._ttl_ms / 4000))
        finally:
            await consumer.stop()

    async def keep(self) -> None:
        """Renew every third of a TTL until cancelled; raise LeaseLost when it cannot."""
        assert self.partition is not None, "acquire first"
        interval = self._ttl_ms / 3000
        while True:
            await asyncio.sleep(interval)
            sent = time.monotonic()
            budget = self._trust_until - sent
            if budget <= 0:
                raise LeaseLost(f"partition {self.partition}: no renewal landed in time")
            try:
                meta = await asyncio.wait_for(
                    self._send("renew", self.partition, self._epoch), timeout=budget
                )
            except (KafkaError, TimeoutError) as exc:
                log.warning("lease.renew_failed", partition=self.partition, error=repr(exc))
                continue
            if meta.timestamp_type != LOG_APPEND_TIME or meta.timestamp >= self._valid_until_ms:
                raise LeaseLost(f"partition {self.partition}: renewal appended after the lapse")
            self._valid_until_ms = meta.timestamp + self._ttl_ms
            self._trust_until = sent + self._ttl_ms / 1000 * (1 - SAFETY_FRACTION)

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
        meta: RecordMetadata = await self._producer.send_and_wait(
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
                    lease = LeaseRecord.model_validate_json(record.value or b"")
                except ValueError as exc:
                    log.error("lease.invalid", offset=record.offset, error=str(exc))
                    continue
                book.apply(lease, record.timestamp)
