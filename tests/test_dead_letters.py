"""One dead-letter writer, one header set: ingest, the scheduler and the workers alike.

Each service's own dead-lettering path runs against `FakeProducer` (test_ingest_handling.py:
it records what would be written and fails on a script); the real broker's copies are
checked in test_ingest_poison.py and test_poison_records.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

from services.ingest.memory import Memory, _remember
from services.scheduler.admission import Waiting
from services.scheduler.answers import Answerer
from services.scheduler.settings import SchedulerSettings
from services.worker.answers import Answers
from services.worker.settings import WorkerSettings
from shared.dead_letters import (
    DEAD_LETTERED_BY,
    ERROR_CODE,
    HEADERS,
    REASON,
    REPLY,
    REPLY_ERROR,
    REQUEST_ID_HEADER,
    REQUIRED,
    SOURCE_OFFSET,
    ReplyStatus,
    Source,
    dead_letter,
    letter,
)
from shared.messages import ErrorCode, ErrorResult, ReplyTo
from shared.producers import RenewingProducer
from shared.retry import Backoff
from shared.topics import Topics
from tests.factories import consumer_record, queued_request
from tests.test_ingest_handling import FakeProducer, make

# Ingest recalls nothing from the DLQ: these producers are fakes (conftest.py).
pytestmark = pytest.mark.usefixtures("no_recall")

PREFIX = "tb"
DLQ = Topics(PREFIX).dlq
POISON = b"\xff not json"
GONE = ReplyTo(topic="gone", partition=0)  # a reply topic that does not exist


class FakeTargets:
    """Stands in for `ReplyTargets`: every `reply_to` is one that does not exist."""

    async def problem(self, reply_to: ReplyTo) -> str:
        return f"reply_to {reply_to.topic} does not exist"


def consumed(
    topic: str, value: bytes, offset: int = 3, headers: list[tuple[str, bytes]] | None = None
) -> Any:
    return consumer_record(topic, value, partition=1, offset=offset, headers=tuple(headers or ()))


def producer(fake: FakeProducer) -> RenewingProducer:
    return fake  # type: ignore[return-value]  # the part of the producer the writers use


def answerer(fake: FakeProducer) -> Answerer:
    settings = SchedulerSettings(topic_prefix=PREFIX, scheduler_id="s1")
    answers = Answerer(settings, Topics(PREFIX), producer(fake))
    answers._targets = FakeTargets()  # type: ignore[assignment]
    return answers


def answers(fake: FakeProducer) -> Answers:
    settings = WorkerSettings(topic_prefix=PREFIX, worker_id="w1")
    worker = Answers(producer(fake), settings)
    worker._targets = FakeTargets()  # type: ignore[assignment]
    return worker


def headers_of(fake: FakeProducer) -> dict[str, str]:
    [written] = fake.on(DLQ)
    headers: dict[str, str] = written["headers"]
    return headers


async def test_every_reader_dead_letters_an_unreadable_record_with_the_same_headers() -> None:
    by_ingest, by_scheduler, by_worker = FakeProducer(), FakeProducer(), FakeProducer()
    ingest = make(by_ingest)
    await ingest.recall()
    await ingest.handle(consumed(f"{PREFIX}.requests", POISON))
    await answerer(by_scheduler).dead_letter(consumed(f"{PREFIX}.heartbeats", POISON), "bad")
    await answers(by_worker).dead_letter(consumed(f"{PREFIX}.batches", POISON), "invalid batch")
    letters = [headers_of(w) for w in (by_ingest, by_scheduler, by_worker)]
    for headers in letters:
        assert set(headers) == REQUIRED, headers
        assert headers[REPLY] == ReplyStatus.none
        assert headers[ERROR_CODE] == ErrorCode.invalid_request
        assert headers[SOURCE_OFFSET] == "3"
    assert [h[DEAD_LETTERED_BY].split(":")[0] for h in letters] == ["ingest", "scheduler", "worker"]
    assert [h[REASON] for h in letters] == ["not_json", "invalid_record", "invalid_record"]


async def test_every_reader_dead_letters_an_undeliverable_request_with_the_same_headers() -> None:
    by_ingest, by_scheduler, by_worker = FakeProducer(), FakeProducer(), FakeProducer()
    ingest = make(by_ingest)
    await ingest.recall()
    body = {"request_id": "r1", "prompt": "hi", "reply_to": {"topic": "gone"}}
    await ingest.handle(consumed(f"{PREFIX}.requests", json.dumps(body).encode()))
    tp = TopicPartition(f"{PREFIX}.requests.interactive", 1)
    request = queued_request("r2", reply_to=GONE)
    error = ErrorResult.for_request(request, ErrorCode.deadline_exceeded, "too late")
    await answerer(by_scheduler).answer(Waiting(request, tp, 3), error)
    await answers(by_worker).undeliverable(
        queued_request("r3", reply_to=GONE), Source(tp.topic, 1, 3), "it is gone"
    )
    letters = [headers_of(w) for w in (by_ingest, by_scheduler, by_worker)]
    for headers in letters:
        assert set(headers) == REQUIRED | {REQUEST_ID_HEADER, REPLY_ERROR}, headers
        assert headers[REPLY] == ReplyStatus.undeliverable
        assert "gone" in headers[REPLY_ERROR]
    assert [h[REQUEST_ID_HEADER] for h in letters] == ["r1", "r2", "r3"]


def test_every_header_a_letter_can_carry_is_documented() -> None:
    full = letter(
        b"x" * 5000,
        key=b"k" * 2000,
        source=Source("tb.requests", 0, 1),
        reason="not_json",
        code=ErrorCode.invalid_request.value,
        error="bad \udcff",  # a lone surrogate is escaped, never refused
        reader="ingest:h-1",
        reply=ReplyStatus.undeliverable,
        request_id="r1",
        reply_error="gone",
        max_record_bytes=4000,
    )
    assert set(full.headers) == set(HEADERS)
    assert full.key == b"r1"  # a key over 1 KiB is replaced by the request id
    assert set(HEADERS) > REQUIRED
    for name, text in full.kafka_headers():
        assert name in HEADERS
        text.decode()  # strict UTF-8


def test_the_memory_finds_ingests_dead_letters_old_and_new_and_the_others() -> None:
    memory = Memory.of_size(10)
    topics = Topics(PREFIX)
    # As ingest wrote them before the one header set (ADR 0013's list).
    old_ingest = [
        ("tokenbus-reason", b"not_json"),
        ("tokenbus-error-code", b"invalid_request"),
        ("tokenbus-error", b"not JSON"),
        ("tokenbus-source", b"tb.requests/1/7"),
        ("tokenbus-reply", b"none"),
    ]
    # As the scheduler and workers wrote them before (ADR 0014's list).
    old_scheduler = [
        ("tokenbus-error-code", b"invalid_request"),
        ("tokenbus-error", b"invalid heartbeat"),
        ("tokenbus-source", b"tb.heartbeats/0/2"),
        ("tokenbus-dead-lettered-by", b"scheduler:s1"),
    ]
    new = letter(
        POISON,
        key=None,
        source=Source("tb.app-requests.a", 2, 9),
        reason="not_json",
        code="invalid_request",
        error="not JSON",
        reader="ingest:h-1",
        reply=ReplyStatus.none,
    )
    for offset, headers in enumerate((old_ingest, old_scheduler, new.kafka_headers())):
        _remember(memory, topics, consumed(DLQ, b"{}", offset, headers))
    _remember(memory, topics, consumed(DLQ, b"{}", 3, [("tokenbus-source", b"no-position")]))
    assert ("tb.requests", 1, 7) in memory.dead_lettered
    assert ("tb.heartbeats", 0, 2) in memory.dead_lettered
    assert ("tb.app-requests.a", 2, 9) in memory.dead_lettered
    assert len(memory.dead_lettered) == 3


def poison_letter() -> Any:
    return letter(
        POISON,
        key=None,
        source=Source("tb.requests", 0, 1),
        reason="not_json",
        code="invalid_request",
        error="not JSON",
        reader="ingest:h-1",
        reply=ReplyStatus.none,
    )


async def test_a_letter_that_must_be_stored_is_retried_through_refusals() -> None:
    refusals = [MessageSizeTooLargeError(), KafkaConnectionError(), MessageSizeTooLargeError()]
    fake = FakeProducer(failures={DLQ: list(refusals)})
    stored = await dead_letter(
        producer(fake), DLQ, poison_letter(), within_s=None, backoff=Backoff(0.001, 0.005)
    )
    assert stored
    assert fake.attempts == [DLQ] * 4
    assert len(fake.on(DLQ)) == 1


async def test_a_bounded_letter_is_given_up_and_said_so() -> None:
    fake = FakeProducer(failures={DLQ: [KafkaConnectionError()] * 100})
    stored = await dead_letter(
        producer(fake), DLQ, poison_letter(), within_s=0.05, backoff=Backoff(0.01, 0.02)
    )
    assert not stored
    assert fake.on(DLQ) == []
    assert 1 < len(fake.attempts) < 100
