"""On the real broker: ingest killed with SIGKILL under load, and a tier topic that goes away.

What the user sees: every request produced straight to Kafka gets exactly one final result,
and the worker runs each request id exactly once, though ingest was killed four times and
a batch of requests was written a second time after the last restart (so only a memory
rebuilt from Kafka, not one kept in the dead process, can drop them).
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import OutOfOrderSequenceNumber

from services.ingest.admission import Admitted
from services.ingest.handling import Ingest
from services.ingest.settings import IngestSettings
from services.ingest.telemetry import IngestTelemetry
from shared.kafka import (
    create_topics,
    delete_topics,
    make_admin,
    make_consumer,
    make_producer,
)
from shared.messages import Tier
from shared.producers import RenewingProducer
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.ingest_kafka import Results, read_all
from tests.stack import Stack, _create, new_prefix, wait_until
from tests.worker_logs import events


@pytest.fixture(scope="module")
def stack(own_stack: Stack) -> Stack:
    """A stack of the module's own, not the session's: it kills and restarts ingest."""
    return own_stack


REPLIES_PARTITIONS = 4


def request(request_id: str, replies: str, n: int) -> bytes:
    body: dict[str, Any] = {
        "request_id": request_id,
        "prompt": f"kill ingest, request {n}",
        "max_tokens": 3,
        "priority": "background" if n % 4 == 0 else "interactive",
        "reply_to": {"topic": replies, "partition": n % REPLIES_PARTITIONS},
    }
    return json.dumps(body).encode()


def worker_runs(stack: Stack, ids: list[str]) -> dict[str, int]:
    count = dict.fromkeys(ids, 0)
    for e in events(stack.log("worker"), "request.finished"):
        if e["request_id"] in count:
            count[e["request_id"]] += 1
    return count


async def test_ingest_killed_four_times_under_load_runs_each_request_once(
    stack: Stack,
) -> None:
    replies = f"{stack.prefix}.replies"
    await create_topics(stack.settings, {replies: REPLIES_PARTITIONS})
    ids = [f"k{n}-{uuid.uuid4().hex[:6]}" for n in range(160)]
    log = stack.log("ingest")

    def admitted(burst: list[str]) -> int:
        return len({e["request_id"] for e in events(log, "request.admitted")} & set(burst))

    producer = make_producer(stack.settings, client_id="test-producer")
    await producer.start()
    try:
        async with Results(stack.bootstrap, replies, REPLIES_PARTITIONS) as results:
            for kill in range(4):
                burst = ids[kill * 40 : (kill + 1) * 40]
                for n, rid in enumerate(burst, start=kill * 40):
                    await producer.send(
                        stack.topics.requests, request(rid, replies, n), key=rid.encode()
                    )
                await producer.flush()
                # Mid-burst: the running ingest is forwarding the records just written.
                await asyncio.to_thread(
                    wait_until, lambda b=burst: admitted(b) >= 5, 60, "ingest to be forwarding"
                )
                up = len(events(log, "memory.recalled"))
                await asyncio.to_thread(stack.stop_service, "ingest", signal.SIGKILL)
                stack.start_service("ingest")
                await asyncio.to_thread(
                    wait_until,
                    lambda n=up: len(events(log, "memory.recalled")) > n,
                    90,
                    "the restarted ingest to be up",
                )
            # Written again (as a producer retrying after a timeout would): the running
            # process must know them from Kafka, not from a memory it never had.
            for n, rid in enumerate(ids[:60]):
                await producer.send(
                    stack.topics.requests, request(rid, replies, n), key=rid.encode()
                )
            await producer.flush()
            await results.wait_for(
                lambda: all(results.final(r) for r in ids), 120, "every request's final result"
            )
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    {e["request_id"] for e in events(log, "request.duplicate")} >= set(ids[:60])
                ),
                60,
                "ingest to drop the 60 requests written again",
            )
            for rid in ids:
                finals = results.finals(rid)
                assert [f.body["kind"] for f in finals] == ["done"], (rid, finals)
    finally:
        await producer.stop()

    await asyncio.to_thread(
        wait_until, lambda: min(worker_runs(stack, ids).values()) >= 1, 30, "every run logged"
    )
    runs = worker_runs(stack, ids)
    assert {rid: n for rid, n in runs.items() if n != 1} == {}
    assert len(events(log, "memory.recalled")) >= 5  # one per incarnation
    # Each request id reached a tier topic exactly once.
    forwarded: dict[str, int] = {}
    for tier in stack.topics.tiers:
        for letter in await read_all(stack.bootstrap, tier, 4):
            key = (letter.key or b"").decode()
            forwarded[key] = forwarded.get(key, 0) + 1
    assert {rid: forwarded.get(rid, 0) for rid in ids if forwarded.get(rid, 0) != 1} == {}


@pytest.fixture
def ingest_only(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={"TOKENBUS_INGEST_PUBLISH_TIMEOUT_MS": "2000"},
    )
    try:
        asyncio.run(_create(s.settings, s.topics))
        s.start_service("ingest")
        wait_until(lambda: events(s.log("ingest"), "memory.recalled"), 60, "ingest to be up")
        yield s
    finally:
        s.stop()


async def _topics(bootstrap: str) -> set[str]:
    admin = make_admin(TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap))
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def test_a_tier_publish_that_fails_is_retried_until_the_topic_is_back(
    ingest_only: Stack,
) -> None:
    """A broker-side fault, no fake: the background tier topic is deleted, so ingest's
    publish fails (unknown topic) until the topic is created again."""
    stack = ingest_only
    tier = stack.topics.tier(Tier.background)
    await delete_topics(stack.settings, [tier])
    deadline = asyncio.get_running_loop().time() + 60
    while tier in await _topics(stack.bootstrap):
        assert asyncio.get_running_loop().time() < deadline, "the tier topic was not deleted"
        await asyncio.sleep(0.2)
    producer = make_producer(stack.settings, client_id="test-producer")
    await producer.start()
    try:
        body = {"request_id": "while-gone", "prompt": "wait for me", "priority": "background"}
        await producer.send_and_wait(
            stack.topics.requests, json.dumps(body).encode(), key=b"while-gone"
        )
        await asyncio.to_thread(
            wait_until,
            lambda: any(
                tier in str(e.get("what")) for e in events(stack.log("ingest"), "kafka.retrying")
            ),
            60,
            "ingest's publish to fail and be retried",
        )
        await create_topics(stack.settings, {tier: 4})
        after = {"request_id": "after-back", "prompt": "and me", "priority": "background"}
        await producer.send_and_wait(
            stack.topics.requests, json.dumps(after).encode(), key=b"after-back"
        )
    finally:
        await producer.stop()

    def forwarded() -> list[bytes | None]:
        return [r.key for r in asyncio.run(read_all(stack.bootstrap, tier, 4))]

    await asyncio.to_thread(
        wait_until, lambda: len(forwarded()) >= 2, 90, "both requests on the tier", 0.5
    )
    on_tier = await read_all(stack.bootstrap, tier, 4)
    assert sorted(r.key or b"" for r in on_tier) == [b"after-back", b"while-gone"]
    assert stack.processes["ingest"].poll() is None


async def test_a_producer_left_broken_is_renewed_and_the_request_forwarded(
    bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiokafka's idempotent producer does not recover from OutOfOrderSequenceNumber (seen
    after an outage expired a batch). The first producer's sends fail so (a test seam);
    the renewal and the retried write go to the real broker."""
    prefix = new_prefix()
    settings = IngestSettings(
        KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=prefix, ingest_retry_backoff_ms=1
    )
    topics = Topics(prefix)
    await create_topics(settings, topics.partitions())
    admin = make_admin(settings)
    await admin.start()
    made: list[AIOKafkaProducer] = []
    calls: list[str] = []

    def make() -> AIOKafkaProducer:
        fresh = make_producer(settings, client_id="ingest-test")
        if not made:

            async def broken(topic: str, *args: Any, **kw: Any) -> Any:
                calls.append(topic)
                raise OutOfOrderSequenceNumber()

            monkeypatch.setattr(fresh, "send", broken)
        made.append(fresh)
        return fresh

    producer = RenewingProducer(make)
    await producer.start()
    tails = make_consumer(settings, group_id=None, client_id="ingest-recall-test")
    await tails.start()
    try:
        ingest = Ingest(settings, producer, admin, IngestTelemetry(topics.requests), tails=tails)
        await ingest.recall()
        body = json.dumps({"request_id": "renewed", "prompt": "hi"}).encode()
        decision = await ingest.handle(
            ConsumerRecord(
                topic=topics.requests,
                partition=0,
                offset=0,
                timestamp=0,
                timestamp_type=0,
                key=b"renewed",
                value=body,
                checksum=None,
                serialized_key_size=7,
                serialized_value_size=len(body),
                headers=(),
            )
        )
        assert isinstance(decision, Admitted)
        assert calls == [topics.tier(Tier.interactive)]
        assert len(made) == 2
        assert producer.renewals == 1
        on_tier = await read_all(bootstrap, topics.tier(Tier.interactive), 4)
        assert [r.key for r in on_tier] == [b"renewed"]
    finally:
        await tails.stop()
        await producer.stop()
        await admin.close()
        await delete_topics(settings, topics.partitions())
