"""Poison on every partition of every topic the scheduler and worker read never stops them.

Written straight to the tier topics, `batches`, `control` and `workers`: records that are
not JSON, JSON that is not an object, deep nesting, lone surrogates, wrong types, unknown
kinds, a batch whose requests are partly invalid, and requests whose `reply_to` cannot be
written (a missing topic, a partition out of range). Then a good request on the normal
path is answered within 5 s by the same scheduler and worker processes; every poison
record is in the DLQ with its source, and those with a readable address got an `error`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from aiokafka import AIOKafkaProducer

from services.worker.engines.sim_text import complete
from shared.dead_letters import ERROR, ERROR_CODE, SOURCE_TOPIC
from shared.kafka import make_admin, new_topic
from shared.messages import Heartbeat, QueuedRequest, ReplyTo, Tier
from shared.settings import TokenbusSettings
from tests.chat_client import run_requests
from tests.stack import Stack, new_prefix, read_records, wait_until

WORKER = "worker-p"


@pytest.fixture(scope="module")
def poison_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={"TOKENBUS_WORKER_ID": WORKER},
    )
    try:
        s.start()
        wait_until(lambda: WORKER in _workers_heard(s), 60, "the worker's heartbeat")
        yield s
    finally:
        s.stop()


def _workers_heard(stack: Stack) -> set[str]:
    out = set()
    for value in stack.read(stack.topics.workers):
        try:
            out.add(Heartbeat.model_validate_json(value).worker_id)
        except ValueError:
            continue
    return out


def request(rid: str, reply_to: dict[str, Any], **extra: Any) -> dict[str, Any]:
    body = QueuedRequest(
        request_id=rid,
        prompt="hello there",
        max_tokens=5,
        tier=Tier.interactive,
        prompt_tokens=2,
        reply_to=ReplyTo.model_validate(reply_to),
    ).model_dump(mode="json")
    body.update(extra)
    return body


def common_poison() -> list[bytes]:
    return [
        b"not json \xff\xfe",
        b"[1, 2, 3]",
        b"[" * 60_000 + b"]" * 60_000,
        b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
        b'{"kind": "explode", "request_id": "x"}',
        b"",
        b"null",
    ]


async def write(bootstrap: str, topic: str, partition: int, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=4 << 20)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, partition=partition, key=b"poison")
    finally:
        await producer.stop()


async def create_topic(bootstrap: str, name: str) -> None:
    admin = make_admin(TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap))
    await admin.start()
    try:
        await admin.create_topics([new_topic(name, 1, replication=1)])
    finally:
        await admin.close()


async def test_poison_everywhere_is_dead_lettered_and_good_requests_still_flow(
    poison_stack: Stack,
) -> None:
    stack = poison_stack
    topics = stack.topics
    bootstrap = stack.bootstrap
    pids = {key: stack.processes[key].pid for key in ("scheduler", "worker")}
    replies = f"{stack.prefix}.test.replies"
    await create_topic(bootstrap, replies)
    here = {"topic": replies, "partition": 0}
    missing = {"topic": f"{stack.prefix}.no.such.topic"}
    out_of_range = {"topic": replies, "partition": 7}
    parts = topics.partitions()
    expected_answers: dict[str, str] = {}  # request_id -> code on the replies topic

    for tier in Tier:
        topic = topics.tier(tier)
        for p in range(parts[topic]):
            tag = f"{tier.value[0]}{p}"
            wrong = request(f"wrong-{tag}", here, prompt_tokens="many")
            lone = json.dumps(request(f"lone-{tag}", here)).replace("hello", "\\ud800")
            expired = request(f"late-{tag}", out_of_range, deadline_ms=1, created_at=1.0)
            nowhere = request(f"nowhere-{tag}", missing)
            values = [
                *common_poison(),
                json.dumps(wrong).encode(),
                lone.encode(),
                json.dumps(expired).encode(),  # answer undeliverable: dead-lettered
                json.dumps(nowhere).encode(),  # run nowhere: the worker dead-letters it
                json.dumps({**request(f"nreply-{tag}", missing), "tier": 3}).encode(),
            ]
            expected_answers[f"wrong-{tag}"] = "invalid_request"
            expected_answers[f"lone-{tag}"] = "invalid_request"
            await write(bootstrap, topic, p, values)

    partly = {
        "batch_id": "partly",
        "tier": "interactive",
        "reason": "full",
        "worker_id": WORKER,
        "requests": [
            request("in-batch-good", here),
            request("in-batch-bad", here, max_tokens="lots"),
            "not a request",
        ],
    }
    expected_answers["in-batch-bad"] = "invalid_request"
    for p in range(parts[topics.batches]):
        await write(bootstrap, topics.batches, p, common_poison())
    await write(bootstrap, topics.batches, 0, [json.dumps(partly).encode()])
    ghost = Heartbeat(
        worker_id="ghost",
        model="sim",
        total_slots=64,
        free_slots=64,
        running=0,
        queued_tokens=0,
        utilisation=0.0,
        batch_partition=99,  # no such partition: sending there would fail forever
    )
    for p in range(parts[topics.workers]):  # every beat is on every partition (ADR 0056)
        await write(bootstrap, topics.workers, p, common_poison())
    await write(
        bootstrap,
        topics.workers,
        0,
        [b'{"worker_id": 5, "model": []}', ghost.model_dump_json().encode()],
    )
    await write(
        bootstrap,
        topics.control,
        0,
        [*common_poison(), b'{"kind": "cancel", "request_id": "bad id!"}'],
    )

    # A good request on the normal path, behind all of it.
    good = {"client_id": "good", "prompt": "after the poison", "max_tokens": 8}
    async with websockets.connect(stack.ws_url) as ws:
        started = time.monotonic()
        transcripts = await run_requests(ws, [good], timeout=30)
        took = time.monotonic() - started
    t = transcripts["good"]
    assert t.final is not None, t.frames
    assert t.final["type"] == "chat.done", t.frames
    assert t.text == complete(good["prompt"], good["max_tokens"]).text
    assert took < 5.0, f"the good request took {took:.1f} s"
    for key, pid in pids.items():
        assert stack.processes[key].poll() is None, f"{key} exited"
        assert stack.processes[key].pid == pid

    # Answers: an error for every poison request whose address could be read; the valid
    # request of the partly invalid batch ran.
    def answers() -> dict[str, dict[str, Any]]:
        records = asyncio.run(read_records(stack.settings, replies, 1))
        return {json.loads(r.value)["request_id"]: json.loads(r.value) for r in records}

    await asyncio.to_thread(
        wait_until,
        lambda: set(expected_answers) | {"in-batch-good"} <= set(answers()),
        30,
        "answers to the poison requests",
    )
    got = await asyncio.to_thread(answers)
    for rid, code in expected_answers.items():
        assert got[rid]["kind"] == "error", got[rid]
        assert got[rid]["code"] == code, got[rid]
    finals = [
        v for v in (await read_records(stack.settings, replies, 1)) if b'"in-batch-good"' in v.value
    ]
    assert json.loads(finals[-1].value)["kind"] == "done"

    # The DLQ: every poisoned topic and partition is named as a source, with a reason. Read
    # until all are there: a dead letter is written once its write is given up (the
    # missing topic's after a metadata wait), which may come after the answers above.
    poisoned = {(topics.tier(tier), p) for tier in Tier for p in range(4)}
    poisoned |= {(topics.workers, p) for p in range(parts[topics.workers])}
    poisoned |= {(topics.batches, 0), (topics.control, 0)}

    def dead_letters() -> tuple[set[tuple[str, int]], list[str]]:
        dlq = asyncio.run(read_records(stack.settings, topics.dlq, parts[topics.dlq]))
        sources: set[tuple[str, int]] = set()
        reasons: list[str] = []
        for record in dlq:
            headers = dict(record.headers)
            source = headers[SOURCE_TOPIC].decode()
            offset_source = headers["tokenbus-source"].decode().rsplit("/", 2)
            sources.add((source, int(offset_source[1])))
            assert headers[ERROR_CODE]
            reasons.append(headers[ERROR].decode())
        return sources, reasons

    def all_there() -> bool:
        sources, reasons = dead_letters()
        return poisoned <= sources and any("does not exist" in r for r in reasons)

    await asyncio.to_thread(wait_until, all_there, 60, "every poisoned source in the DLQ")
    sources, reasons = await asyncio.to_thread(dead_letters)
    assert poisoned <= sources, poisoned - sources
    assert any("undeliverable" in r and "out of range" in r for r in reasons)  # late-*
    assert any("undeliverable" in r and "does not exist" in r for r in reasons)  # nowhere-*
    assert any("batch_partition 99" in r for r in reasons)  # the ghost worker
