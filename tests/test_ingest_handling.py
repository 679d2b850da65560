"""Ingest's per-record steps with fakes for Kafka (the real broker is in test_ingest_*.py).

`FakeProducer` (with `FakeMetadata`, its metadata client) and `FakeAdmin` stand in for the
renewing producer and aiokafka's admin client: they record what would be written and fail
on a script, so each failure path is exact.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

import services.ingest.handling as handling_module
from services.ingest.admission import Admitted, Duplicate, Reason, Rejected
from services.ingest.handling import Ingest
from services.ingest.settings import IngestSettings
from services.ingest.telemetry import IngestTelemetry
from shared.dead_letters import REASON, REPLY, REPLY_ERROR, SOURCE
from tests.factories import consumer_record

# Ingest recalls nothing from the DLQ: these producers are fakes (conftest.py).
pytestmark = pytest.mark.usefixtures("no_recall")

PREFIX = "tb"


@dataclass
class FakeMetadata:
    """The producer's metadata client: nothing cached; a look-up answers from `topics`
    (name: partitions), `unauthorized` and `internal`, as they are at that moment."""

    topics: dict[str, int] = field(default_factory=lambda: {f"{PREFIX}.results": 4, "mine": 1})
    unauthorized: set[str] = field(default_factory=set)
    internal: set[str] = field(default_factory=set)
    cluster: ClusterMetadata = field(default_factory=ClusterMetadata)

    async def _metadata_update(self, cluster: ClusterMetadata, topics: list[str]) -> bool:
        known = {t: set(range(self.topics[t])) for t in topics if t in self.topics}
        cluster.partitions_for_topic = known.get  # type: ignore[method-assign]
        cluster.unauthorized_topics = self.unauthorized & set(topics)
        cluster.internal_topics = self.internal & set(topics)
        return True


@dataclass
class FakeProducer:
    """Records sends; `failures[topic]` lists exceptions to raise, one per attempt.

    `late[topic]` lists exceptions the write's future fails with (after the send was queued).
    """

    failures: dict[str, list[BaseException]] = field(default_factory=dict)
    late: dict[str, list[BaseException]] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)  # topics whose writes never complete
    published: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[str] = field(default_factory=list)
    client: FakeMetadata = field(default_factory=FakeMetadata)

    async def send(
        self, topic: str, value: bytes, *, key: bytes | None = None, **kw: Any
    ) -> asyncio.Future[None]:
        self.attempts.append(topic)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if topic in self.hang:
            return future
        pending = self.failures.get(topic)
        if pending:
            raise pending.pop(0)
        late = self.late.get(topic)
        if late:
            future.set_exception(late.pop(0))
            return future
        headers = {name: data.decode() for name, data in kw.pop("headers", None) or ()}
        self.published.append(
            {"value": value, "topic": topic, "key": key, "headers": headers, **kw}
        )
        future.set_result(None)
        return future

    async def send_and_wait(self, topic: str, value: bytes, **kw: Any) -> None:
        await (await self.send(topic, value, **kw))

    async def settled(self) -> None:
        return None

    def on(self, topic: str) -> list[dict[str, Any]]:
        return [p for p in self.published if p["topic"] == topic]


@dataclass
class FakeAdmin:
    """Answers metadata requests: `topics` maps an existing topic to its partition count."""

    topics: dict[str, int] = field(default_factory=dict)

    async def describe_topics(self, names: list[str]) -> list[dict[str, Any]]:
        return [
            {
                "topic": n,
                "error_code": 0 if n in self.topics else 3,
                "is_internal": False,
                "partitions": [{"partition": p} for p in range(self.topics.get(n, 0))],
            }
            for n in names
        ]


def make(broker: FakeProducer, **settings: Any) -> Ingest:
    base = {
        "topic_prefix": PREFIX,
        "ingest_retry_backoff_ms": 1,
        "ingest_retry_backoff_max_ms": 5,
        "ingest_reply_timeout_ms": 50,
    }
    admin = FakeAdmin({f"{PREFIX}.results": 4, "mine": 1})
    telemetry = IngestTelemetry(f"{PREFIX}.requests")
    # No tails consumer: `recall` is replaced (the no_recall fixture, conftest.py).
    return Ingest(IngestSettings(**{**base, **settings}), broker, admin, telemetry, tails=None)  # type: ignore[arg-type]


def record(value: bytes | dict[str, Any], offset: int = 0, key: bytes | None = None) -> Any:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return consumer_record(f"{PREFIX}.requests", raw, partition=1, offset=offset, key=key)


async def handle(ingest: Ingest, rec: Any) -> object:
    await ingest.recall()
    return await ingest.handle(rec)


async def test_a_tier_publish_that_fails_once_is_retried_not_dropped() -> None:
    broker = FakeProducer(failures={"tb.requests.interactive": [KafkaConnectionError()]})
    ingest = make(broker)
    request = {"request_id": "r1", "prompt": "hi"}
    decision = await handle(ingest, record(request))
    assert isinstance(decision, Admitted)
    assert broker.attempts == ["tb.requests.interactive"] * 2
    assert len(broker.on("tb.requests.interactive")) == 1
    # Remembered once the tier holds it: the same request again is a duplicate.
    assert isinstance(await ingest.handle(record(request, offset=1)), Duplicate)
    assert len(broker.on("tb.requests.interactive")) == 1


async def test_a_tier_write_that_fails_after_it_was_queued_is_retried() -> None:
    broker = FakeProducer(late={"tb.requests.interactive": [KafkaConnectionError()]})
    ingest = make(broker)
    decision = await handle(ingest, record({"request_id": "r1", "prompt": "hi"}))
    assert isinstance(decision, Admitted)
    assert broker.attempts == ["tb.requests.interactive"] * 2
    assert len(broker.on("tb.requests.interactive")) == 1
    assert "r1" in ingest.memory.forwarded


async def test_a_batch_is_written_together_and_a_request_twice_in_it_goes_on_once() -> None:
    broker = FakeProducer()
    ingest = make(broker)
    await ingest.recall()
    batch = [
        record({"request_id": "a", "prompt": "hi"}, offset=0),
        record(b"garbage", offset=1),
        record({"request_id": "b", "prompt": "hi", "priority": "background"}, offset=2),
        record({"request_id": "a", "prompt": "hi"}, offset=3),
    ]
    outcomes = await ingest.handle_batch(batch)
    assert [type(o) for o in outcomes] == [Admitted, Rejected, Admitted, Duplicate]
    assert [p["key"] for p in broker.on("tb.requests.interactive")] == [b"a"]
    assert [p["key"] for p in broker.on("tb.requests.background")] == [b"b"]
    [letter] = broker.on("tb.requests.dlq")
    assert letter["headers"][SOURCE] == "tb.requests/1/1"
    assert "a" in ingest.memory.forwarded
    assert "b" in ingest.memory.forwarded


async def test_a_failed_publish_is_not_remembered() -> None:
    broker = FakeProducer(failures={"tb.requests.interactive": [KafkaConnectionError()] * 3})
    ingest = make(broker)
    task = asyncio.create_task(handle(ingest, record({"request_id": "r1", "prompt": "hi"})))
    while len(broker.attempts) < 2:  # noqa: ASYNC110 (the fake has no event to wait on)
        await asyncio.sleep(0.001)
    assert "r1" not in ingest.memory.forwarded  # still retrying: not remembered
    assert isinstance(await task, Admitted)
    assert "r1" in ingest.memory.forwarded


async def test_a_tier_that_refuses_for_good_dead_letters_with_an_error() -> None:
    broker = FakeProducer(failures={"tb.requests.interactive": [MessageSizeTooLargeError()]})
    ingest = make(broker)
    decision = await handle(ingest, record({"request_id": "r1", "prompt": "hi"}))
    assert isinstance(decision, Rejected)
    [letter] = broker.on("tb.requests.dlq")
    assert letter["headers"][REASON] == "not_forwarded"
    [error] = broker.on("tb.results")
    assert json.loads(error["value"])["code"] == "internal"


async def test_a_record_dead_lettered_before_is_not_dead_lettered_again() -> None:
    broker = FakeProducer()
    ingest = make(broker)
    assert isinstance(await handle(ingest, record(b"garbage", offset=7)), Rejected)
    assert await ingest.handle(record(b"garbage", offset=7)) is None  # redelivered
    [letter] = broker.on("tb.requests.dlq")
    assert letter["headers"][SOURCE] == "tb.requests/1/7"
    # The same bytes at another offset are another record: dead-lettered too.
    assert isinstance(await ingest.handle(record(b"garbage", offset=8)), Rejected)
    assert len(broker.on("tb.requests.dlq")) == 2


async def test_a_reply_that_cannot_be_written_is_given_up_in_bounded_time() -> None:
    broker = FakeProducer(hang={"mine"})
    ingest = make(broker, ingest_reply_attempts=3)
    bad = {"request_id": "r1", "prompt": "hi", "top_p": 9, "reply_to": {"topic": "mine"}}
    started = time.monotonic()
    decision = await handle(ingest, record(bad))
    assert time.monotonic() - started < 2.0  # 3 tries of 50 ms, plus backoff
    assert isinstance(decision, Rejected)
    assert broker.attempts.count("mine") == 3
    [letter] = broker.on("tb.requests.dlq")
    assert letter["headers"][REPLY] == "undeliverable"
    assert "not written after 3 tries" in letter["headers"][REPLY_ERROR]


async def test_a_valid_request_whose_reply_to_is_missing_is_dead_lettered() -> None:
    broker = FakeProducer()
    ingest = make(broker)
    request = {"request_id": "r1", "prompt": "hi", "reply_to": {"topic": "gone"}}
    decision = await handle(ingest, record(request))
    assert isinstance(decision, Rejected)
    assert broker.on("tb.requests.interactive") == []
    [letter] = broker.on("tb.requests.dlq")
    assert letter["headers"][REASON] == "reply_to_missing"
    assert letter["headers"][REPLY] == "undeliverable"


async def test_a_defect_on_one_record_dead_letters_it_and_the_next_flows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = FakeProducer()
    ingest = make(broker)
    real_admit = handling_module.admit

    def admit_failing_once(raw: bytes, *args: Any, **kw: Any) -> Any:
        if raw == b'{"boom": 1}':
            raise RuntimeError("a defect")
        return real_admit(raw, *args, **kw)

    monkeypatch.setattr(handling_module, "admit", admit_failing_once)
    assert isinstance(await handle(ingest, record(b'{"boom": 1}')), Rejected)
    [letter] = broker.on("tb.requests.dlq")
    assert letter["headers"][REASON] == "internal"
    ok = await ingest.handle(record({"request_id": "r2", "prompt": "hi"}, offset=1))
    assert isinstance(ok, Admitted)


async def test_each_way_a_reply_to_cannot_be_written_has_its_reason() -> None:
    broker = FakeProducer()
    broker.client.unauthorized.add("theirs")
    broker.client.internal.add("__consumer_offsets")
    ingest = make(broker, ingest_reply_to_grace_ms=0)
    await ingest.recall()
    cases = {
        "gone": (None, Reason.reply_to_missing),
        "theirs": (None, Reason.reply_to_forbidden),
        "__consumer_offsets": (None, Reason.reply_to_forbidden),
        "mine": (1, Reason.reply_to_partition),
    }
    for offset, (topic, (partition, reason)) in enumerate(cases.items()):
        reply_to = {"topic": topic, "partition": partition}
        body = {"request_id": f"r{offset}", "prompt": "hi", "reply_to": reply_to}
        decision = await ingest.handle(record(body, offset=offset))
        assert isinstance(decision, Rejected), topic
        assert decision.reason is reason, topic
    assert broker.on("tb.requests.interactive") == []


async def test_a_reply_to_topic_created_a_moment_ago_is_waited_for() -> None:
    broker = FakeProducer()

    async def create_soon() -> None:
        await asyncio.sleep(0.05)
        broker.client.topics["fresh"] = 2

    creating = asyncio.create_task(create_soon())
    ingest = make(broker, ingest_reply_to_grace_ms=500)
    body = {"request_id": "r1", "prompt": "hi", "reply_to": {"topic": "fresh", "partition": 1}}
    assert isinstance(await handle(ingest, record(body)), Admitted)
    await creating
    # Not remembered as missing: ingest asks about a missing topic every time.
    body = {"request_id": "r2", "prompt": "hi", "reply_to": {"topic": "later"}}
    rejected = await ingest.handle(record(body, offset=1))
    assert isinstance(rejected, Rejected)
    broker.client.topics["later"] = 1
    assert isinstance(await ingest.handle(record(body, offset=2)), Admitted)
