"""Records nobody can handle: read what can be read of them, and dead-letter them with why.

Every reader of a tokenbus topic follows one rule for a record it cannot handle (not JSON,
not an object, too deep, invalid text, wrong types, an unknown kind; for ingest, any record
it does not admit): answer it with an `error` result if a `request_id` and `reply_to` can
still be read from it, copy it to the dead-letter topic (`<prefix>.requests.dlq`) with why
and where it came from in headers, and go on with the next record.

Every writer (ingest, the scheduler, the workers) builds its dead letter with `letter` and
stores it with `dead_letter`, so every dead letter carries the one header set of `HEADERS`
(the contract, docs/asyncapi.yaml, is generated from it): `REQUIRED` on every letter, the
rest when they apply. Ingest's dedupe memory reads `tokenbus-source` back (`source_of`),
which every version of every writer has written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

import structlog
from aiokafka.structs import ConsumerRecord
from prometheus_client import Counter
from pydantic import ConfigDict, Field, ValidationError

from shared.kafka import Headers
from shared.messages import REQUEST_ID, Model, ReplyTo
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS
from shared.retry import Backoff, retrying

log = structlog.get_logger()

# The header set, one place for its names (tests and tools read them).
REASON = "tokenbus-reason"
ERROR_CODE = "tokenbus-error-code"
ERROR = "tokenbus-error"
SOURCE = "tokenbus-source"  # "topic/partition/offset"
SOURCE_TOPIC = "tokenbus-source-topic"
SOURCE_PARTITION = "tokenbus-source-partition"
SOURCE_OFFSET = "tokenbus-source-offset"
DEAD_LETTERED_BY = "tokenbus-dead-lettered-by"
REPLY = "tokenbus-reply"
REQUEST_ID_HEADER = "tokenbus-request-id"
REPLY_ERROR = "tokenbus-reply-error"
TRUNCATED = "tokenbus-truncated"

# What each header says: the one description, rendered into docs/asyncapi.yaml.
HEADERS: dict[str, str] = {
    REASON: "Why, as a stable slug: ingest's rejection reason (`not_json`, `reply_to_missing`,"
    " …), or `invalid_record` / `undeliverable` from the scheduler and workers.",
    ERROR_CODE: "The protocol's error code (`invalid_request`, …), as in the error result.",
    ERROR: "Why, in words (at most 1000 characters; never a value of the record).",
    SOURCE: "Where it was read: `topic/partition/offset` (ingest's dedupe memory reads it back).",
    SOURCE_TOPIC: "The topic it was read from.",
    SOURCE_PARTITION: "The partition it was read from.",
    SOURCE_OFFSET: "The offset it was read at.",
    DEAD_LETTERED_BY: "Which reader dead-lettered it: `ingest:<host>-<pid>`,"
    " `scheduler:<id>`, `worker:<id>` (a broadcast topic's readers each write their own).",
    REPLY: "What became of the error result for its `reply_to`: `delivered`, `undeliverable`,"
    " or `none` (nobody to tell: no usable `reply_to` or request id, or not one request).",
    REQUEST_ID_HEADER: "When one could be read: the request_id.",
    REPLY_ERROR: "With `undeliverable`: why the error result could not be delivered.",
    TRUNCATED: "When the copy was cut to fit a record: the original value's length.",
}
# On every dead letter; the others of `HEADERS` only when they apply.
REQUIRED = frozenset(
    {
        REASON,
        ERROR_CODE,
        ERROR,
        SOURCE,
        SOURCE_TOPIC,
        SOURCE_PARTITION,
        SOURCE_OFFSET,
        DEAD_LETTERED_BY,
        REPLY,
    }
)

# The `tokenbus-reason` slugs of the scheduler and the workers (ingest's: its `Reason`).
INVALID_RECORD = "invalid_record"  # it could not be read as what its topic carries
UNDELIVERABLE = "undeliverable"  # a request whose error result cannot be delivered

REASON_LIMIT = 1000  # characters of a text kept in its header
# A key longer than this is not kept (the original is still named by `tokenbus-source`).
MAX_KEY_BYTES = 1024
# Room for the record batch's framing and the producer's trace headers (traceparent,
# tracestate: W3C bounds both) on top of what `letter` counts.
FRAMING_BYTES = 1024
# What a failed write of a letter that must be stored (`within_s=None`) is retried on:
# every write failure, a refusal (too large, not authorised) included.
_ANY_WRITE_ERROR = (*WRITE_ERRORS, OSError)


class ReplyStatus(StrEnum):
    """What became of the error result meant for the record's `reply_to`."""

    delivered = "delivered"
    undeliverable = "undeliverable"
    none = "none"  # no usable reply_to or request id, or not one request: nobody to tell


@dataclass(frozen=True)
class Source:
    """Where a record was read: names it in the DLQ, and dedupes ingest's copy on restart."""

    topic: str
    partition: int
    offset: int

    @classmethod
    def of(cls, record: ConsumerRecord[bytes, bytes]) -> Source:
        return cls(record.topic, record.partition, record.offset)

    @classmethod
    def parse(cls, text: str) -> Source | None:
        """The `Source` a `tokenbus-source` header names; None if it names none."""
        topic, _, rest = text.rpartition("/")
        topic, _, partition = topic.rpartition("/")
        if not (topic and partition.isdigit() and rest.isdigit()):
            return None
        return cls(topic, int(partition), int(rest))

    @property
    def position(self) -> tuple[str, int, int]:
        """What dedupes a DLQ copy: the shared and every application's topic apart."""
        return (self.topic, self.partition, self.offset)

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"


def source_of(headers: Iterable[tuple[str, bytes | None]]) -> Source | None:
    """Where the dead letter with these headers was read, if it says (any version does)."""
    for name, data in headers:
        if name == SOURCE and data is not None:
            return Source.parse(data.decode(errors="replace"))
    return None


@dataclass(frozen=True)
class DeadLetter:
    """One record for the DLQ: the value and key as read (cut to fit), and its headers."""

    key: bytes | None
    value: bytes
    headers: dict[str, str]

    @property
    def source(self) -> str:
        return self.headers[SOURCE]

    def kafka_headers(self) -> Headers:
        return [(name, text.encode()) for name, text in self.headers.items()]


def letter(
    value: bytes,
    *,
    key: bytes | None,
    source: Source,
    reason: str,
    code: str,
    error: str,
    reader: str,
    reply: ReplyStatus,
    request_id: str | None = None,
    reply_error: str | None = None,
    max_record_bytes: int | None = None,
    keep_bytes: int | None = None,
) -> DeadLetter:
    """The dead letter of `value` read at `source`: `reason` a stable slug, `error` in words.

    The value is the record as written (as sensitive as the topic it came from); the
    headers carry only tokenbus's own messages, never a value from the record. With
    `max_record_bytes`, a value that would not fit a record is cut, `tokenbus-truncated`
    saying so; with `keep_bytes`, the value is cut to its first `keep_bytes` bytes (a
    record refused unread, over its writer's quota: a flood's copies stay small).
    """
    headers = {
        REASON: _text(reason),
        ERROR_CODE: _text(code),
        ERROR: _text(error),
        SOURCE: _text(str(source)),
        SOURCE_TOPIC: _text(source.topic),
        SOURCE_PARTITION: str(source.partition),
        SOURCE_OFFSET: str(source.offset),
        DEAD_LETTERED_BY: _text(reader),
        REPLY: reply.value,
    }
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = _text(request_id)
    if reply_error is not None:
        headers[REPLY_ERROR] = _text(reply_error)
    if key is not None and len(key) > MAX_KEY_BYTES:
        key = request_id.encode() if request_id else None
    if max_record_bytes is not None:
        room = (
            max_record_bytes
            - FRAMING_BYTES
            - len(key or b"")
            - sum(len(name) + len(text.encode()) + 64 for name, text in headers.items())
        )
        if len(value) > room:
            keep_bytes = max(0, room - 64) if keep_bytes is None else min(keep_bytes, room - 64)
    if keep_bytes is not None and len(value) > keep_bytes:
        headers[TRUNCATED] = str(len(value))
        value = value[: max(0, keep_bytes)]
    return DeadLetter(key, value, headers)


def _text(text: str) -> str:
    """`text` bounded, certain to encode as UTF-8: a lone surrogate becomes an escape."""
    return text[:REASON_LIMIT].encode("utf-8", "backslashreplace").decode()


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


async def dead_letter(
    producer: RenewingProducer,
    dlq: str,
    dead: DeadLetter,
    *,
    within_s: float | None,
    backoff: Backoff | None = None,
) -> bool:
    """Store `dead` on the DLQ, retried with `backoff`; True once stored.

    `within_s`: give up after this long and return False, logged with the record's
    coordinates and counted; the caller skips the record all the same, so a broker outage
    never turns into a stall (the scheduler, the workers). None: until stored, every failure
    retried, a refusal (the DLQ's size limit, its ACLs) included, for a reader whose record
    ends only with its dead letter (ingest: its memory reads the DLQ back); an operator has
    to fix the DLQ topic, and each failed try is logged with why.
    """
    source = dead.source
    topic = dead.headers[SOURCE_TOPIC]
    code = dead.headers[ERROR_CODE]

    async def write() -> None:
        await producer.settled()  # a producer being renewed: retry on the new one
        await producer.send_and_wait(dlq, dead.value, key=dead.key, headers=dead.kafka_headers())

    try:
        await retrying(
            write,
            within_s=within_s,
            what="dead_letter",
            retry_on=WRITE_ERRORS if within_s is not None else _ANY_WRITE_ERROR,
            backoff=backoff,
            source=source,
        )
    except WRITE_ERRORS as exc:
        log.error("record.dead_letter_failed", source=source, code=code, error=repr(exc))
        DEAD_LETTER_FAILURES.labels(topic).inc()
        return False
    DEAD_LETTERS.labels(code, topic).inc()
    log.warning("record.dead_lettered", source=source, code=code, reason=dead.headers[REASON])
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
