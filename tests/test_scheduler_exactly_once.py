"""On the real broker: a request is never answered twice after a kill -9 (finding 1).

Two windows closed here (docs/reliability.md, "What the chaos check found"):

- a worker killed right after it wrote a request's `done`, before its next heartbeat said
  so: the scheduler's recovery must not hand that request back as the next attempt;
- a scheduler killed and restarted: the restart must not dispatch again what it
  dispatched before, even when its consumer hands it tier records while it is still
  reading the batches topic.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from aiokafka import TopicPartition

from services.scheduler.batch_log import BatchLog
from services.scheduler.recovery import Recovery
from services.worker.engines.sim_text import complete
from shared.kafka import create_topics, encode, key_of, make_admin, make_consumer, make_producer
from shared.messages import (
    Batch,
    DoneResult,
    Heartbeat,
    QueuedRequest,
    ReplyTo,
    Tier,
    Timings,
    Usage,
)
from shared.results import send_result
from shared.topics import Topics
from tests.chat_client import ChatSession
from tests.stack import (
    Stack,
    announces,
    new_prefix,
    read_topic,
    settings_from_env,
    settles,
    wait_until,
)
from tests.worker_logs import events

WORKER = "w-killed"
FILLER_BATCHES = 20_000


async def test_recovery_does_not_hand_back_a_request_its_dead_worker_answered(
    bootstrap: str,
) -> None:
    """The history a kill -9 just after `done` leaves, written as it happens, then recovered.

    A batch of three requests to a worker; its last heartbeat still holds all three; then
    it writes `done` for one (and an `error` for another) and dies before beating again.
    Recovery must hand back only the third, announce a reset only for the third, and
    still move the worker's committed offset past the batch.
    """
    settings = settings_from_env({}, KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=new_prefix())
    prefix = settings.topic_prefix
    replies = f"{prefix}.app-replies"
    topics = {**_topics(prefix), replies: 3}
    await create_topics(settings, topics)
    ids = [f"eo-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    requests = [
        QueuedRequest(
            request_id=rid,
            prompt="p",
            tier=Tier.interactive,
            prompt_tokens=1,
            reply_to=ReplyTo(topic=replies),  # no partition: keyed, any of the three
        )
        for rid in ids
    ]
    batches = f"{prefix}.batches"
    tp = TopicPartition(batches, 0)
    producer = make_producer(settings, client_id="test-history")
    admin = make_admin(settings)
    reader = make_consumer(settings, group_id=None, client_id="test-batch-log")
    await producer.start()
    await admin.start()
    await reader.start()
    try:
        batch = Batch(
            batch_id=uuid.uuid4().hex,
            tier=Tier.interactive,
            requests=requests,
            reason="full",
            worker_id=WORKER,
        )
        sent = await producer.send_and_wait(batches, encode(batch), partition=0)
        # The worker's group commits the batch's offset (it had not finished it).
        group = make_consumer(settings, group_id=f"{prefix}.worker.{WORKER}", client_id=WORKER)
        await group.start()
        group.assign([tp])
        await group.commit({tp: sent.offset})
        await group.stop()
        # It answered the first (done) and the second (error), then was killed.
        done = DoneResult(
            request_id=ids[0],
            seq=3,
            finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=3),
            timings=Timings(queue_ms=1.0, batch_size=3, ttft_ms=1.0, total_ms=2.0),
        )
        await (await send_result(producer, requests[0].reply_to, done))
        error = {"request_id": ids[1], "attempt": 0, "seq": 0, "kind": "error"}
        error |= {"code": "internal", "message": "engine failed"}
        await producer.send_and_wait(replies, json.dumps(error).encode(), key=key_of(ids[1]))
        last = Heartbeat(
            worker_id=WORKER,
            model="sim",
            total_slots=4,
            free_slots=1,
            running=3,
            queued_tokens=0,
            utilisation=0.75,
            batch_partition=0,
            batches_consumed=sent.offset + 1,
            held=[(rid, 0) for rid in ids],
            interval_ms=300.0,
            started_at=1.0,
        )
        recovery = Recovery(settings, admin, BatchLog(reader), producer)
        handed = await recovery.recover(last)

        assert handed == [(ids[2], 0)]
        interactive = Topics(prefix).tier(Tier.interactive)
        tier = [
            QueuedRequest.model_validate_json(v)
            for v in await read_topic(settings, interactive, topics[interactive])
        ]
        assert [(r.request_id, r.attempt) for r in tier] == [(ids[2], 1)]
        records = [json.loads(v) for v in await read_topic(settings, replies, 3)]
        resets = [(r["request_id"], r["attempt"]) for r in records if announces(r)]
        assert resets == [(ids[2], 1)]
        committed = await admin.list_consumer_group_offsets(
            f"{prefix}.worker.{WORKER}", partitions=[tp]
        )
        assert committed[tp].offset == sent.offset + 1  # the batch is recovered all the same
    finally:
        await reader.stop()
        await admin.close()
        await producer.stop()


def _topics(prefix: str) -> dict[str, int]:
    return Topics(prefix).partitions()


@pytest.fixture(scope="module")
def slow_commits(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_SCHEDULER_ID": "sched-eo",
            # One commit at start and none after: the restart re-reads every tier record
            # and must find every one of them in the batches topic, however its consumer
            # interleaves the fetches with that read.
            "TOKENBUS_SCHEDULER_COMMIT_INTERVAL_MS": "600000",
            "TOKENBUS_SCHEDULER_INTERACTIVE_MAX_BATCH_SIZE": "2",
        },
    )
    try:
        yield s.start()
    finally:
        s.stop()


async def test_a_restarted_scheduler_dispatches_nothing_twice(slow_commits: Stack) -> None:
    stack = slow_commits
    requests: list[dict[str, Any]] = [
        {
            "client_id": f"r{i}",
            "prompt": f"restart the scheduler, request {i}",
            "max_tokens": 8,
            "priority": "background" if i % 2 else "interactive",
        }
        for i in range(60)
    ]
    async with websockets.connect(stack.ws_url) as ws:
        session = ChatSession(ws)
        for request in requests:
            await session.send(request)
        await session.until(session.all_ended, within=90)
    ids = {t.request_id for t in session.by_client.values()}
    assert all(t.final and t.final["type"] == "chat.done" for t in session.by_client.values())

    # Batches addressed to nobody, so the restart's read of the batches topic takes a
    # while: the tier consumer hands out records during it, which must wait for it.
    await _fill_batches(stack, FILLER_BATCHES)
    await asyncio.to_thread(stack.stop_service, "scheduler", signal.SIGKILL)
    stack.start_service("scheduler")
    # Every tier record is read again (nothing was committed as handed on); each must be
    # found in the batches topic, none dispatched again.
    await asyncio.to_thread(
        wait_until,
        lambda: ids <= _already_dispatched(stack),
        60,
        "every re-read request found in the batches topic",
    )
    ran = Counter(e["request_id"] for e in events(stack.log("worker"), "request.finished"))
    assert {ran[rid] for rid in ids} == {1}, {rid: ran[rid] for rid in ids if ran[rid] != 1}
    assert len(events(stack.log("scheduler"), "scheduler.started")) == 2


async def _fill_batches(stack: Stack, count: int) -> None:
    filler = QueuedRequest(
        request_id="filler",
        prompt="p",
        tier=Tier.background,
        prompt_tokens=1,
        reply_to=ReplyTo(topic=f"{stack.prefix}.nowhere"),
    )
    producer = make_producer(stack.settings, client_id="test-filler")
    await producer.start()
    try:
        futures = []
        for i in range(count):
            batch = Batch(
                batch_id=f"filler-{i}",
                tier=Tier.background,
                requests=[filler],
                reason="full",
                worker_id="nobody",
            )
            futures.append(await producer.send(stack.topics.batches, encode(batch), partition=0))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def _already_dispatched(stack: Stack) -> set[str]:
    found = events(stack.log("scheduler"), "request.already_dispatched")
    return {str(e["request_id"]) for e in found}


async def test_a_restarted_worker_does_not_rerun_what_its_former_process_answered(
    bootstrap: str, log_dir: Path
) -> None:
    """Its former process wrote one request's `done` and was killed before committing.

    The new process hands the batch it left back to the schedulers (as the next attempt,
    shared/handover.py): the answered request must not run again, the other must, to its
    whole text.
    """
    stack = Stack(bootstrap=bootstrap, prefix=new_prefix(), log_dir=log_dir)
    settings = stack.settings
    replies = f"{stack.prefix}.app-replies"
    await create_topics(settings, {**stack.topics.partitions(), replies: 1})
    worker_id = "worker-replay"
    answered, unanswered = (
        QueuedRequest(
            request_id=f"replay-{name}-{uuid.uuid4().hex[:8]}",
            prompt=f"replay {name}",
            tier=Tier.interactive,
            prompt_tokens=2,
            max_tokens=12,
            reply_to=ReplyTo(topic=replies),
        )
        for name in ("answered", "unanswered")
    )
    tp = TopicPartition(stack.topics.batches, 0)
    producer = make_producer(settings, client_id="test-history")
    await producer.start()
    try:
        batch = Batch(
            batch_id=uuid.uuid4().hex,
            tier=Tier.interactive,
            requests=[answered, unanswered],
            reason="full",
            worker_id=worker_id,
        )
        sent = await producer.send_and_wait(stack.topics.batches, encode(batch), partition=0)
        group_id = stack.topics.worker_group(worker_id)
        group = make_consumer(settings, group_id=group_id, client_id="test-group")
        await group.start()
        group.assign([tp])
        await group.commit({tp: sent.offset})
        await group.stop()
        done = DoneResult(
            request_id=answered.request_id,
            seq=0,
            finish_reason="length",
            usage=Usage(prompt_tokens=2, completion_tokens=12),
            timings=Timings(queue_ms=1.0, batch_size=2, ttft_ms=1.0, total_ms=2.0),
        )
        await (await send_result(producer, answered.reply_to, done))
    finally:
        await producer.stop()
    try:
        stack.start_service(
            "worker",
            TOKENBUS_WORKER_ID=worker_id,
            TOKENBUS_WORKER_BATCH_PARTITION="0",
        )
        stack.start_service("scheduler")

        async def finals() -> list[dict[str, Any]]:
            records = [json.loads(v) for v in await read_topic(settings, replies, 1)]
            return [r for r in records if r["kind"] in ("done", "error")]

        deadline = asyncio.get_running_loop().time() + 60
        while not any(f["request_id"] == unanswered.request_id for f in await finals()):
            assert asyncio.get_running_loop().time() < deadline, "the handed-back request never ran"
            await asyncio.sleep(0.2)  # poll interval for the reply topic
        by_id = Counter(f["request_id"] for f in await finals())
        assert by_id == {answered.request_id: 1, unanswered.request_id: 1}
        await asyncio.to_thread(
            wait_until,
            lambda: events(stack.log("worker"), "takeover.skipped_answered"),
            10,
            "the take-over's check logged",
        )
        records = [json.loads(v) for v in await read_topic(settings, replies, 1)]
        records = [r for r in records if not settles(r)]
        rerun = [r for r in records if r["request_id"] == unanswered.request_id]
        assert {r["attempt"] for r in rerun} == {1}
        text = "".join(r["text"] for r in rerun if r["kind"] == "delta")
        assert text == complete("replay unanswered", 12).text
        assert not [r for r in records if r["request_id"] == answered.request_id][1:]
    finally:
        await asyncio.to_thread(stack.stop)


@pytest.fixture(scope="module")
def quick_commits(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_SCHEDULER_ID": "sched-seen",
            "TOKENBUS_SCHEDULER_COMMIT_INTERVAL_MS": "100",
        },
    )
    try:
        yield s.start()
    finally:
        s.stop()


async def test_a_second_hand_back_after_a_scheduler_restart_is_not_run_again(
    quick_commits: Stack,
) -> None:
    """ADR 0014's open hazard: the recovery of a worker declared dead and that worker, woken
    and fenced, both hand one request back as the same next attempt. The first copy runs and
    is committed, the scheduler is killed and restarted, then the second copy arrives: it
    must be dropped as the first process would have (tier_history.py), not run again."""
    stack = quick_commits
    settings = stack.settings
    replies = f"{stack.prefix}.app-replies"
    await create_topics(settings, {replies: 1})
    request = QueuedRequest(
        request_id=f"twice-{uuid.uuid4().hex[:8]}",
        prompt="handed back twice",
        tier=Tier.interactive,
        prompt_tokens=3,
        max_tokens=8,
        reply_to=ReplyTo(topic=replies, partition=0),
        attempt=1,
    )
    tier = stack.topics.tier(Tier.interactive)
    producer = make_producer(settings, client_id="test-hand-backs")
    admin = make_admin(settings)
    await producer.start()
    await admin.start()
    try:
        first = await producer.send_and_wait(tier, encode(request), key=key_of(request.request_id))
        tp = TopicPartition(tier, first.partition)

        async def finals() -> list[dict[str, Any]]:
            records = [json.loads(v) for v in await read_topic(settings, replies, 1)]
            return [r for r in records if r["kind"] in ("done", "error")]

        async def committed_past_first() -> bool:
            group = f"{stack.prefix}.scheduler"
            offsets = await admin.list_consumer_group_offsets(group, partitions=[tp])
            return tp in offsets and offsets[tp].offset > first.offset

        deadline = asyncio.get_running_loop().time() + 60
        while not (await finals() and await committed_past_first()):
            assert asyncio.get_running_loop().time() < deadline, "the first copy never ran"
            await asyncio.sleep(0.2)  # poll interval for the reply topic and the commit
        assigned = len(events(stack.log("scheduler"), "tier_partitions.assigned"))
        await asyncio.to_thread(stack.stop_service, "scheduler", signal.SIGKILL)
        stack.start_service("scheduler")
        await asyncio.to_thread(
            wait_until,
            lambda: len(events(stack.log("scheduler"), "tier_partitions.assigned")) > assigned,
            60,
            "the restarted scheduler's take-over",
        )
        await producer.send_and_wait(tier, encode(request), key=key_of(request.request_id))
        await asyncio.to_thread(
            wait_until,
            lambda: any(
                e["request_id"] == request.request_id
                for e in events(stack.log("scheduler"), "request.duplicate")
            ),
            60,
            "the second copy dropped as a duplicate",
        )
        assert [f["request_id"] for f in await finals()] == [request.request_id]
    finally:
        await admin.close()
        await producer.stop()
