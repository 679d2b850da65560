"""Records nobody can handle: read what can be read of them, and dead-letter them with why.

Every reader of a tokenbus topic follows one rule for a record it cannot handle (not JSON,
not an object, too deep, invalid text, wrong types, an unknown kind): answer it with an
`error` result if a `request_id` and `reply_to` can still be read from it, copy it to the
dead-letter topic (`<prefix>.requests.dlq`) with the reason and where it came from in
headers, and go on with the next record. Never retried, never a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord
from prometheus_client import Counter
from pydantic import ConfigDict, Field, ValidationError

from shared.kafka import Headers
from shared.messages import REQUEST_ID, Model, ReplyTo
from shared.results import WRITE_ERRORS
from shared.retry import retrying

log = structlog.get_logger()

# Header names (ingest writes the first three too).
CODE_HEADER = "tokenbus-error-code"
REASON_HEADER = "tokenbus-error"
SOURCE_HEADER = "tokenbus-source"  # "topic/partition/offset"
SOURCE_TOPIC_HEADER = "tokenbus-source-topic"
SOURCE_PARTITION_HEADER = "tokenbus-source-partition"
SOURCE_OFFSET_HEADER = "tokenbus-source-offset"
READER_HEADER = "tokenbus-dead-lettered-by"

REASON_LIMIT = 1000  # characters of the reason kept in its header


@dataclass(frozen=True)
class Source:
    """Where a record was read."""

    topic: str
    partition: int
    offset: int

    @classmethod
    def of(cls, record: ConsumerRecord[bytes, bytes]) -> Source:
        return cls(record.topic, record.partition, record.offset)

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"


# On the process's default registry, so every service's /metrics shows its dead letters
# (alert `TokenbusDeadLettersGrowing`, deploy/monitoring/rules/tokenbus.rules.yml).
DEAD_LETTERS = Counter(
    "tokenbus_dead_letters",
    "Records copied to the dead-letter topic, by reason code and the topic they came from.",
    ["code", "source_topic"],
)
DEAD_LETTER_FAILURES = Counter(
    "tokenbus_dead_letter_failures",
    "Records that could not be stored on the dead-letter topic (skipped all the same).",
    ["source_topic"],
)


def dead_letter_headers(source: Source, code: str, reason: str, reader: str) -> Headers:
    return [
        (CODE_HEADER, code.encode()),
        (REASON_HEADER, reason[:REASON_LIMIT].encode(errors="replace")),
        (SOURCE_HEADER, str(source).encode()),
        (SOURCE_TOPIC_HEADER, source.topic.encode()),
        (SOURCE_PARTITION_HEADER, str(source.partition).encode()),
        (SOURCE_OFFSET_HEADER, str(source.offset).encode()),
        (READER_HEADER, reader.encode(errors="replace")),
    ]


async def dead_letter(
    producer: AIOKafkaProducer,
    dlq: str,
    record: ConsumerRecord[bytes, bytes],
    *,
    code: str,
    reason: str,
    reader: str,
    within_s: float,
) -> bool:
    """Copy `record` to the DLQ; retried with backoff for up to `within_s`.

    False if it could not be stored (logged with the record's coordinates): the caller
    skips the record all the same, so a broker outage never turns into a stall.
    """
    return await dead_letter_value(
        producer,
        dlq,
        record.value or b"",
        key=record.key,
        source=Source.of(record),
        code=code,
        reason=reason,
        reader=reader,
        within_s=within_s,
    )


async def dead_letter_value(
    producer: AIOKafkaProducer,
    dlq: str,
    value: bytes,
    *,
    key: bytes | None,
    source: Source,
    code: str,
    reason: str,
    reader: str,
    within_s: float,
) -> bool:
    """`dead_letter` of a part of a record (one request of a batch): `source` is the record."""

    async def write() -> None:
        await producer.send_and_wait(
            dlq, value, key=key, headers=dead_letter_headers(source, code, reason, reader)
        )

    try:
        await retrying(
            write, within_s=within_s, what="dead_letter", retry_on=WRITE_ERRORS, source=str(source)
        )
    except WRITE_ERRORS as exc:
        log.error("record.dead_letter_failed", source=str(source), code=code, error=repr(exc))
        DEAD_LETTER_FAILURES.labels(source.topic).inc()
        return False
    DEAD_LETTERS.labels(code, source.topic).inc()
    log.warning("record.dead_lettered", source=str(source), code=code, reason=reason[:300])
    return True


class Addressed(Model):
    """The least of a request that can be answered: who, which attempt, and where to."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    request_id: str = Field(pattern=REQUEST_ID)
    reply_to: ReplyTo
    attempt: int = Field(default=0, ge=0)


def address_of(value: object) -> Addressed | None:
    """The answerable part of a parsed record, if it has one."""
    if not isinstance(value, dict):
        return None
    try:
        return Addressed.model_validate(value)
    except ValidationError:
        return None


def read_address(raw: bytes) -> Addressed | None:
    """The answerable part of a record that failed strict validation.

    Parsed leniently (Python's json accepts lone surrogates, which the strict parser
    refuses), so a request broken only in its prompt is still answered; anything that is
    not JSON, too deeply nested or not an object has no address.
    """
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return address_of(value)
