"""Ingest's dedupe memory, rebuilt from the logs it writes: the tier topics and the DLQ.

Kafka already holds every outcome: a forwarded request is a record keyed by its id on a
tier topic, a dead-lettered one names its source offset in a DLQ header. Reading back
their recent tails on each partition assignment makes the memory survive a restart at no
per-record cost (see docs/decisions/0013-ingest-fault-tolerance.md).

The tails are read by one group-less consumer that lives as long as the process (built in
app.py), not one per recall: closing a TLS connection while a response is still on its way
(the metadata refresh that `assign` starts, a fetch) waited uvloop's 30 s SSL shutdown
timeout, which every recall on a SASL_SSL cluster then waited out (ADR 0037; the services'
loop now bounds that wait to 1 s, ADR 0040, and one consumer still saves a TLS handshake
and a login per recall).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import TopicAuthorizationFailedError, for_code

from services.ingest.admission import Recent, RecentIds
from shared.dead_letters import source_of
from shared.topics import Topics

log = structlog.get_logger()

# Kafka's error codes in a DescribeTopics (metadata) answer that recall tells apart.
_UNKNOWN_TOPIC = 3  # not made yet: nothing to recall
_TOPIC_AUTHORIZATION_FAILED = 29


class RecallRefused(Exception):
    """The broker refuses ingest's principal what recall needs on a topic (an ACL is missing).

    `operation` is the ACL operation to grant: DESCRIBE to find the topic's partitions and
    offsets, READ to read its records (READ implies DESCRIBE).
    """

    def __init__(self, topic: str, operation: str) -> None:
        super().__init__(
            f"not authorized to {operation} topic {topic!r}: ingest's principal needs "
            f"{operation} on it to rebuild its dedupe memory "
            "(`tokenbus topics create --acls` grants it; tokenbus/acls.py)"
        )
        self.topic = topic
        self.operation = operation


@dataclass
class Memory:
    """What ingest has handed on. Owner: the ingest shell; `recall` refills it."""

    forwarded: RecentIds
    # Source.position: (topic, partition, offset) of each record read from a requests topic.
    dead_lettered: Recent[tuple[str, int, int]] = field(default_factory=Recent)

    @classmethod
    def of_size(cls, size: int) -> Memory:
        return cls(RecentIds(size), Recent(size))


async def recall(
    memory: Memory,
    topics: Topics,
    admin: AIOKafkaAdminClient,
    tails: AIOKafkaConsumer,
    window: int,
) -> int:
    """Read the last `window` records of the tier topics (spread over their partitions) and
    of the DLQ into `memory`; return how many records were read.

    `tails` is a started group-less consumer kept for the process's life (see the module's
    docstring); recall assigns it what it reads and leaves it with nothing assigned.
    Raises `RecallRefused` at once when an ACL is missing, rather than waiting it out.
    """
    started = time.monotonic()
    tiers = await _partitions(admin, topics.tiers)
    dlq = await _partitions(admin, (topics.dlq,))
    starts: dict[TopicPartition, int] = {}
    for parts in (tiers, dlq):
        per_partition = -(-window // max(1, len(parts)))
        if parts:
            ends = await tails.end_offsets(parts)
            begins = await tails.beginning_offsets(parts)
            for tp in parts:
                starts[tp] = max(begins[tp], ends[tp] - per_partition)
    ends = await tails.end_offsets(list(starts)) if starts else {}
    todo = [tp for tp in starts if ends[tp] > starts[tp]]
    read = 0
    if todo:
        tails.assign(todo)
        try:
            for tp in todo:
                tails.seek(tp, starts[tp])
            while todo:
                batches = await _fetched(tails, todo)
                for tp, records in batches.items():
                    for record in records:
                        if record.offset < ends[tp]:
                            read += 1
                            _remember(memory, topics, record)
                todo = [tp for tp in todo if await tails.position(tp) < ends[tp]]
        finally:
            tails.unsubscribe()  # no fetching between recalls
    log.info(
        "memory.recalled",
        records=read,
        forwarded=len(memory.forwarded),
        dead_lettered=len(memory.dead_lettered),
        seconds=round(time.monotonic() - started, 3),
    )
    return read


async def _fetched(
    tails: AIOKafkaConsumer, todo: list[TopicPartition]
) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
    try:
        fetched: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
        fetched = await tails.getmany(*todo, timeout_ms=500)
    except TopicAuthorizationFailedError as exc:
        # aiokafka names the topic as the error's only argument.
        topic = str(exc.args[0]) if exc.args else ", ".join(sorted({tp.topic for tp in todo}))
        raise RecallRefused(topic, "READ") from exc
    return fetched


async def _partitions(admin: AIOKafkaAdminClient, names: tuple[str, ...]) -> list[TopicPartition]:
    """Every partition of the topics that exist (a missing one has nothing to recall).

    Raises `RecallRefused` for a topic the principal may not DESCRIBE: Kafka answers as if
    it were missing only to principals that may not know it exists, so it is not skipped.
    """
    found: list[TopicPartition] = []
    for topic in await admin.describe_topics(list(names)):
        code = topic["error_code"]
        if code == _TOPIC_AUTHORIZATION_FAILED:
            raise RecallRefused(topic["topic"], "DESCRIBE")
        if code == _UNKNOWN_TOPIC:
            continue
        if code != 0:
            raise for_code(code)(f"describing topic {topic['topic']!r} for recall")
        found.extend(TopicPartition(topic["topic"], p["partition"]) for p in topic["partitions"])
    return found


def _remember(memory: Memory, topics: Topics, record: ConsumerRecord[bytes, bytes]) -> None:
    if record.topic != topics.dlq:
        if record.key is not None:
            memory.forwarded.remember(record.key.decode(errors="replace"))
        return
    # `tokenbus-source`: written by every version of every writer (shared/dead_letters.py).
    source = source_of(record.headers)
    if source is not None:
        memory.dead_lettered.remember(source.position)
