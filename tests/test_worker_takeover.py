"""Exactly one party re-issues a worker's unfinished batches (ADR 0021, shared/handover.py).

On the real broker, the race the chaos check found (docs/reliability.md, finding 0's
remaining form, seed 1009154516 `chaos-a-36`): a worker killed with -9 is recovered by the
scheduler while its next process starts under the same id. Before, both re-issued the
batches the former process left, as the same next attempt, and two workers ran it. Now
both go through one transaction under the worker's id: whichever commits first owns the
range, the other finds nothing (or is fenced and writes nothing).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from services.scheduler.batch_log import BatchLog, LoggedBatch
from services.scheduler.recovery import Recovery
from services.worker.intake import BatchIntake
from services.worker.settings import WorkerSettings
from shared import handover
from shared.kafka import create_topics, encode, make_admin, make_consumer, make_producer
from shared.messages import Batch, Heartbeat, QueuedRequest, ReplyTo, Tier
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.stack import announces, new_prefix, read_topic, settings_from_env

WORKER = "w-restarted"


async def _committed_tier_records(settings: TokenbusSettings, topics: Topics) -> list[str]:
    """(request_id, attempt) of every committed record on the tier topics, as `id/attempt`."""
    consumer = make_consumer(
        settings, group_id=None, client_id="test-tiers", isolation_level="read_committed"
    )
    await consumer.start()
    try:
        parts = [TopicPartition(t, p) for t in topics.tiers for p in range(4)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        out: list[str] = []
        todo = {tp for tp in parts if ends[tp] > 0}
        while todo:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    q = QueuedRequest.model_validate_json(r.value or b"")
                    out.append(f"{q.request_id}/{q.attempt}")
            todo = {tp for tp in todo if await consumer.position(tp) < ends[tp]}
        return sorted(out)
    finally:
        await consumer.stop()


async def _history(settings: TokenbusSettings, prefix: str) -> tuple[list[QueuedRequest], int]:
    """Two batches to WORKER, its group committed before both: what a kill -9 leaves."""
    topics = Topics(prefix)
    replies = f"{prefix}.app-replies"
    await create_topics(settings, {**topics.partitions(), replies: 1})
    requests = [
        QueuedRequest(
            request_id=f"to-{uuid.uuid4().hex[:8]}-{i}",
            prompt="p",
            tier=Tier.interactive,
            prompt_tokens=1,
            reply_to=ReplyTo(topic=replies, partition=0),
        )
        for i in range(3)
    ]
    tp = TopicPartition(topics.batches, 0)
    producer = make_producer(settings, client_id="test-history")
    await producer.start()
    try:
        first = None
        for part in (requests[:2], requests[2:]):
            batch = Batch(
                batch_id=uuid.uuid4().hex,
                tier=Tier.interactive,
                requests=part,
                reason="full",
                worker_id=WORKER,
            )
            sent = await producer.send_and_wait(topics.batches, encode(batch), partition=0)
            first = sent.offset if first is None else first
        assert first is not None
        group = make_consumer(settings, group_id=topics.worker_group(WORKER), client_id=WORKER)
        await group.start()
        group.assign([tp])
        await group.commit({tp: first})
        await group.stop()
    finally:
        await producer.stop()
    return requests, first + 2


def _last_beat(end: int, requests: list[QueuedRequest]) -> Heartbeat:
    return Heartbeat(
        worker_id=WORKER,
        model="sim",
        total_slots=4,
        free_slots=1,
        running=3,
        queued_tokens=0,
        utilisation=0.75,
        batch_partition=0,
        batches_consumed=end,
        held=[(r.request_id, 0) for r in requests],
        interval_ms=300.0,
        started_at=1.0,
    )


class _RestartDuringRead(BatchLog):
    """The real batch log, but the worker's next process starts while it is being read.

    That is the window of the race: the recovery has read the committed offset and is
    reading the batches; its last "still dead?" check is still to come and will pass (the
    new process has not beaten yet).
    """

    def __init__(self, inner: BatchLog, restart: asyncio.Event, restarted: asyncio.Event):
        super().__init__(inner._consumer)
        self._restart, self._restarted = restart, restarted

    async def read(self, starts: Mapping[TopicPartition, int]) -> list[LoggedBatch]:
        self._restart.set()
        await self._restarted.wait()
        return await super().read(starts)


async def _start_worker(settings: TokenbusSettings, restart: asyncio.Event | None = None) -> int:
    """Run the worker's start-up take-over (as its next process would); its position."""
    if restart is not None:
        await restart.wait()
    ws = WorkerSettings(**settings.model_dump(), worker_id=WORKER, worker_batch_partition=0)
    intake = BatchIntake(ws)
    consumer = intake.consumer()
    producer = make_producer(ws, client_id="test-worker")
    await consumer.start()
    await producer.start()
    try:
        await intake.start(consumer, producer)
        return intake.consumed
    finally:
        await consumer.stop()
        await producer.stop()


async def test_a_restart_during_a_recovery_leaves_one_copy_of_each_next_attempt(
    bootstrap: str,
) -> None:
    settings = settings_from_env({}, KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=new_prefix())
    topics = Topics(settings.topic_prefix)
    requests, end = await _history(settings, settings.topic_prefix)
    restart, restarted = asyncio.Event(), asyncio.Event()
    admin = make_admin(settings)
    reader = make_consumer(settings, group_id=None, client_id="test-batch-log")
    producer = make_producer(settings, client_id="test-scheduler")
    await admin.start()
    await reader.start()
    await producer.start()
    try:
        log = _RestartDuringRead(BatchLog(reader), restart, restarted)
        recovery = Recovery(settings, admin, log, producer)

        async def worker() -> int:
            try:
                return await _start_worker(settings, restart)
            finally:
                restarted.set()

        recovering = asyncio.ensure_future(recovery.recover(_last_beat(end, requests)))
        position = await worker()
        # The new process took the range over: the recovery begun before it is fenced.
        try:
            handed = await recovering
        except KafkaError:
            handed = []
        assert handed == []
        assert position == end
        # Retried (as the scheduler does a second later), it finds nothing left.
        assert (
            await Recovery(settings, admin, BatchLog(reader), producer).recover(
                _last_beat(end, requests)
            )
            == []
        )
        tiers = await _committed_tier_records(settings, topics)
        assert tiers == sorted(f"{r.request_id}/1" for r in requests)
        committed = await admin.list_consumer_group_offsets(
            topics.worker_group(WORKER), partitions=[TopicPartition(topics.batches, 0)]
        )
        assert committed[TopicPartition(topics.batches, 0)].offset == end
        # Each request's reply_to announces the next attempt before it runs.
        records = [json.loads(v) for v in await read_topic(settings, requests[0].reply_to.topic, 1)]
        assert {r["request_id"] for r in records if announces(r)} == {
            r.request_id for r in requests
        }
    finally:
        await producer.stop()
        await reader.stop()
        await admin.close()


async def test_a_restart_after_a_recovery_takes_nothing_over(bootstrap: str) -> None:
    """The recovery committed first: the new process starts at the end, re-issuing nothing
    (before, its start could read the old committed offset and replay the range again)."""
    settings = settings_from_env({}, KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=new_prefix())
    topics = Topics(settings.topic_prefix)
    requests, end = await _history(settings, settings.topic_prefix)
    admin = make_admin(settings)
    reader = make_consumer(settings, group_id=None, client_id="test-batch-log")
    producer = make_producer(settings, client_id="test-scheduler")
    await admin.start()
    await reader.start()
    await producer.start()
    try:
        recovery = Recovery(settings, admin, BatchLog(reader), producer)
        handed = await recovery.recover(_last_beat(end, requests))
        assert sorted(handed) == sorted((r.request_id, 0) for r in requests)
        assert await _start_worker(settings) == end
        tiers = await _committed_tier_records(settings, topics)
        assert tiers == sorted(f"{r.request_id}/1" for r in requests)
    finally:
        await producer.stop()
        await reader.stop()
        await admin.close()


async def test_committed_offset_is_read_again_before_none_is_believed() -> None:
    """A moving group coordinator answered "no committed offset" once (finding 10)."""
    answers: list[int | None] = [None, None, 41]

    async def flaky() -> int | None:
        return answers.pop(0)

    assert await handover.committed_offset(flaky, gap_s=0.0) == 41

    async def none() -> int | None:
        return None

    assert await handover.committed_offset(none, gap_s=0.0) is None
