"""The DLQ copy of a record that was not admitted: its bytes, bounded, and why, in headers."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from services.ingest.admission import Rejected

Headers = dict[str, str]

# The DLQ record's own headers, one place for their names (tests and tools read them).
REASON = "tokenbus-reason"
ERROR_CODE = "tokenbus-error-code"
ERROR = "tokenbus-error"
SOURCE = "tokenbus-source"
REQUEST_ID = "tokenbus-request-id"
REPLY = "tokenbus-reply"
REPLY_ERROR = "tokenbus-reply-error"
TRUNCATED = "tokenbus-truncated"

# Room for the record batch's framing and the producer's trace headers (traceparent,
# tracestate: W3C bounds both) on top of what is counted here.
FRAMING_BYTES = 1024
# A key longer than this is not kept (the original is still named by `tokenbus-source`).
MAX_KEY_BYTES = 1024


class ReplyStatus(StrEnum):
    """What became of the error result meant for the record's `reply_to`."""

    delivered = "delivered"
    undeliverable = "undeliverable"
    none = "none"  # no usable reply_to or request id: nobody to tell


@dataclass(frozen=True)
class Source:
    """Where a record was read: names it in the DLQ, and dedupes its DLQ copy on restart."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"

    @property
    def position(self) -> tuple[str, int, int]:
        """What dedupes its DLQ copy: the shared and every application's topic apart."""
        return (self.topic, self.partition, self.offset)

    @classmethod
    def parse(cls, text: str) -> Source | None:
        topic, _, rest = text.rpartition("/")
        topic, _, partition = topic.rpartition("/")
        if not (topic and partition.isdigit() and rest.isdigit()):
            return None
        return cls(topic, int(partition), int(rest))


@dataclass(frozen=True)
class DeadLetter:
    key: bytes | None
    value: bytes
    headers: Headers


def dead_letter(
    value: bytes,
    key: bytes | None,
    source: Source,
    rejected: Rejected,
    reply: ReplyStatus,
    reply_error: str | None,
    max_record_bytes: int,
) -> DeadLetter:
    """The DLQ record: the original value, cut to fit `max_record_bytes` with a header saying so.

    The value is the record as written (it is as sensitive as `tokenbus.requests` itself);
    the headers carry only tokenbus's own messages, never a value from the record.
    """
    headers: Headers = {
        REASON: rejected.reason.value,
        ERROR_CODE: rejected.code.value,
        ERROR: _utf8(rejected.message),
        SOURCE: _utf8(str(source)),
        REPLY: reply.value,
    }
    if rejected.request_id is not None:
        headers[REQUEST_ID] = rejected.request_id
    if reply_error is not None:
        headers[REPLY_ERROR] = _utf8(reply_error[:1000])
    if key is not None and len(key) > MAX_KEY_BYTES:
        key = rejected.request_id.encode() if rejected.request_id else None
    room = (
        max_record_bytes
        - FRAMING_BYTES
        - len(key or b"")
        - sum(len(name) + len(text.encode()) + 64 for name, text in headers.items())
    )
    if len(value) > room:
        headers[TRUNCATED] = str(len(value))
        value = value[: max(0, room - 64)]
    return DeadLetter(key, value, headers)


def _utf8(text: str) -> str:
    """`text`, certain to encode as UTF-8: a lone surrogate would become an escape."""
    return text.encode("utf-8", "backslashreplace").decode()
