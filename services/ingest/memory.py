"""Ingest's dedupe memory, rebuilt from the logs it writes: the tier topics and the DLQ.

Kafka already holds every outcome: a forwarded request is a record keyed by its id on a
tier topic, a dead-lettered one names its source offset in a DLQ header. Reading back
their recent tails on each partition assignment makes the memory survive a restart at no
per-record cost (see docs/decisions/0013-ingest-fault-tolerance.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from services.ingest.admission import Recent, RecentIds
from services.ingest.dead_letter import SOURCE, Source
from shared.kafka import make_consumer
from shared.settings import TokenbusSettings
from shared.topics import Topics

log = structlog.get_logger()


@dataclass
class Memory:
    """What ingest has handed on. Owner: the ingest shell; `recall` refills it."""

    forwarded: RecentIds
    dead_lettered: Recent[tuple[int, int]] = field(default_factory=Recent)  # (partition, offset)

    @classmethod
    def of_size(cls, size: int) -> Memory:
        return cls(RecentIds(size), Recent(size))


async def recall(
    memory: Memory,
    topics: Topics,
    admin: AIOKafkaAdminClient,
    settings: TokenbusSettings,
    window: int,
) -> int:
    """Read the last `window` records of the tier topics (spread over their partitions) and
    of the DLQ into `memory`; return how many records were read."""
    started = time.monotonic()
    consumer = make_consumer(settings, group_id=None, client_id="ingest-recall")
    await consumer.start()
    try:
        tiers = await _partitions(admin, topics.tiers)
        dlq = await _partitions(admin, (topics.dlq,))
        starts: dict[TopicPartition, int] = {}
        for parts in (tiers, dlq):
            per_partition = -(-window // max(1, len(parts)))
            if parts:
                ends = await consumer.end_offsets(parts)
                begins = await consumer.beginning_offsets(parts)
                for tp in parts:
                    starts[tp] = max(begins[tp], ends[tp] - per_partition)
        ends = await consumer.end_offsets(list(starts)) if starts else {}
        todo = [tp for tp in starts if ends[tp] > starts[tp]]
        consumer.assign(todo)
        for tp in todo:
            consumer.seek(tp, starts[tp])
        read = 0
        while todo:
            for tp, records in (await consumer.getmany(*todo, timeout_ms=500)).items():
                for record in records:
                    if record.offset < ends[tp]:
                        read += 1
                        _remember(memory, topics, record)
            todo = [tp for tp in todo if await consumer.position(tp) < ends[tp]]
    finally:
        await consumer.stop()
    log.info(
        "memory.recalled",
        records=read,
        forwarded=len(memory.forwarded),
        dead_lettered=len(memory.dead_lettered),
        seconds=round(time.monotonic() - started, 3),
    )
    return read


async def _partitions(admin: AIOKafkaAdminClient, names: tuple[str, ...]) -> list[TopicPartition]:
    """Every partition of the topics that exist (a missing one has nothing to recall)."""
    found: list[TopicPartition] = []
    for topic in await admin.describe_topics(list(names)):
        if topic["error_code"] == 0:
            found.extend(
                TopicPartition(topic["topic"], p["partition"]) for p in topic["partitions"]
            )
    return found


def _remember(memory: Memory, topics: Topics, record: ConsumerRecord[bytes, bytes]) -> None:
    if record.topic != topics.dlq:
        if record.key is not None:
            memory.forwarded.remember(record.key.decode(errors="replace"))
        return
    for name, data in record.headers:
        if name == SOURCE and data is not None:
            source = Source.parse(data.decode(errors="replace"))
            if source is not None and source.topic == topics.requests:
                memory.dead_lettered.remember((source.partition, source.offset))
