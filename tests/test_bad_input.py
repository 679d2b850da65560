"""Bad input of every kind gets a typed error naming the field, and breaks nothing else."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import websockets
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from shared.messages import ErrorResult
from tests.chat_client import recv_json, run_requests
from tests.stack import Stack


@pytest.fixture(scope="module")
def stack(own_stack: Stack) -> Stack:
    """A stack of the module's own, not the session's: it reads the whole DLQ, and writes
    records that are no requests to the requests topic, which other modules on the shared
    stack read whole (`Stack.requested_prompts`)."""
    return own_stack


BAD_FRAMES: list[tuple[str, str | bytes, str]] = [
    ("not json", "this is not json", "frame"),
    ("json but not an object", "[1, 2, 3]", "type"),
    ("unknown type", json.dumps({"type": "chat.wat"}), "type"),
    ("missing type", json.dumps({"prompt": "hi"}), "type"),
    ("missing prompt", json.dumps({"type": "chat.request"}), "prompt"),
    (
        "both prompt and messages",
        json.dumps(
            {"type": "chat.request", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}
        ),
        "prompt",
    ),
    (
        "max_tokens wrong type",
        json.dumps({"type": "chat.request", "prompt": "hi", "max_tokens": "many"}),
        "max_tokens",
    ),
    (
        "max_tokens zero",
        json.dumps({"type": "chat.request", "prompt": "hi", "max_tokens": 0}),
        "max_tokens",
    ),
    (
        "max_tokens above cap",
        json.dumps({"type": "chat.request", "prompt": "hi", "max_tokens": 10**6}),
        "max_tokens",
    ),
    (
        "temperature wrong type",
        json.dumps({"type": "chat.request", "prompt": "hi", "temperature": "hot"}),
        "temperature",
    ),
    (
        "bad message role",
        json.dumps({"type": "chat.request", "messages": [{"role": "wizard", "content": "x"}]}),
        "messages.0.role",
    ),
    (
        "unknown field",
        json.dumps({"type": "chat.request", "prompt": "hi", "colour": "red"}),
        "colour",
    ),
    (
        "prompt above the size limit",
        json.dumps({"type": "chat.request", "prompt": "word " * 20000}),
        "prompt",
    ),
    ("2 MiB frame", json.dumps({"type": "chat.request", "prompt": "x" * (2 << 20)}), "frame"),
    ("binary garbage", b"\xff\xfe\x00garbage", "frame"),
    ("cancel without id", json.dumps({"type": "chat.cancel"}), "request_id"),
]


async def test_every_bad_frame_gets_invalid_request_and_the_socket_lives_on(stack: Stack) -> None:
    async with websockets.connect(stack.ws_url, max_size=None) as ws:
        for name, frame, field in BAD_FRAMES:
            await ws.send(frame)
            error = await recv_json(ws)
            assert error["type"] == "error", (name, error)
            assert error["code"] == "invalid_request", (name, error)
            assert field in error["message"], (name, error["message"])
            # The same socket still serves a valid request after each bad one.
        transcripts = await run_requests(ws, [{"client_id": "ok", "prompt": "hi", "max_tokens": 3}])
    final = transcripts["ok"].final
    assert final is not None
    assert final["type"] == "chat.done"


async def test_client_id_is_echoed_on_a_rejected_request(stack: Stack) -> None:
    async with websockets.connect(stack.ws_url) as ws:
        await ws.send(json.dumps({"type": "chat.request", "client_id": "x1", "max_tokens": -1}))
        error = await recv_json(ws)
    assert error["client_id"] == "x1"
    assert "max_tokens" in error["message"]


async def _read_all(
    bootstrap: str, topic: str, until: int, timeout: float = 30
) -> list[tuple[bytes | None, bytes, dict[str, bytes]]]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    out: list[tuple[bytes | None, bytes, dict[str, bytes]]] = []
    try:
        deadline = time.monotonic() + timeout
        while len(out) < until and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                out.extend((r.key, r.value or b"", dict(r.headers)) for r in records)
    finally:
        await consumer.stop()
    return out


async def test_malformed_records_land_on_the_dlq_and_nothing_else_stops(stack: Stack) -> None:
    topics = stack.topics
    reply_topic = stack.topics.results
    bad_id = "bad-" + uuid.uuid4().hex[:8]
    good_id = "good-" + uuid.uuid4().hex[:8]
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topics.requests, b"{not json", key=b"garbage-1")
        await producer.send_and_wait(topics.requests, b'"a string"', key=b"garbage-2")
        invalid = {
            "request_id": bad_id,
            "prompt": "hi",
            "max_tokens": "lots",
            "reply_to": {"topic": reply_topic, "partition": 5},
        }
        await producer.send_and_wait(
            topics.requests, json.dumps(invalid).encode(), key=bad_id.encode()
        )
        good = {
            "request_id": good_id,
            "prompt": "after the bad ones",
            "max_tokens": 4,
            "reply_to": {"topic": reply_topic, "partition": 5},
        }
        await producer.send_and_wait(
            topics.requests, json.dumps(good).encode(), key=good_id.encode()
        )
    finally:
        await producer.stop()

    dlq = await _read_all(stack.bootstrap, topics.dlq, until=3)
    by_key = {k: h for k, _, h in dlq}
    assert set(by_key) == {b"garbage-1", b"garbage-2", bad_id.encode()}
    assert all(h["tokenbus-error-code"] == b"invalid_request" for h in by_key.values())
    assert b"max_tokens" in by_key[bad_id.encode()]["tokenbus-error"]
    reasons = {k: h["tokenbus-reason"] for k, h in by_key.items()}
    assert reasons == {
        b"garbage-1": b"not_json",
        b"garbage-2": b"not_object",
        bad_id.encode(): b"invalid_field",
    }

    # The invalid request's author hears about it on its reply_to; the good one completes.
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap, enable_auto_commit=False)
    await consumer.start()
    tp = TopicPartition(reply_topic, 5)
    consumer.assign([tp])
    await consumer.seek_to_beginning(tp)
    seen: dict[str, list[dict[str, object]]] = {}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            seen.get(bad_id) and any(r["kind"] == "done" for r in seen.get(good_id, []))
        ):
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for r in records:
                    body = json.loads(r.value or b"{}")
                    seen.setdefault(body["request_id"], []).append(body)
    finally:
        await consumer.stop()
    error = ErrorResult.model_validate(seen[bad_id][0])
    assert error.code == "invalid_request"
    assert "max_tokens" in error.message
    assert [r["kind"] for r in seen[good_id]][-1] == "done"
