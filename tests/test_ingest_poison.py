"""On the real stack: every kind of poison record, on every partition of the requests topic.

Each poison record is followed on the same partition by a good request with its own
reply_to. What must hold: every good request is answered (`done`) within 5 s of being
written, the DLQ holds each poison record exactly once with its reason in headers, an
`error` reaches each poison record's reply_to when one can be delivered, and no service
restarted.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from shared.dead_letters import ERROR, REASON, REPLY, REQUEST_ID_HEADER, SOURCE, TRUNCATED
from shared.kafka import create_topics, make_producer
from tests.ingest_kafka import Results, read_all
from tests.stack import Stack
from tests.worker_logs import events


@pytest.fixture(scope="module")
def stack(own_stack: Stack) -> Stack:
    """A stack of the module's own, not the session's: it reads the whole DLQ and checks
    that no process restarted; and its poison (not JSON, headers not UTF-8) on the requests
    topic would break the modules on the shared stack that read that topic whole."""
    return own_stack


REPLIES_PARTITIONS = 4
# Every poison record's prompt: it may appear in no DLQ header, no error, no log line.
PROMPT = "private-prompt-q7x"


@dataclass(frozen=True)
class Poison:
    name: str
    reason: str
    # The record's value, from (request id, reply_to of this partition, stack prefix).
    value: Callable[[str, dict[str, Any], str], bytes]
    answered: bool = False  # whether an error result reaches its reply_to
    headers: tuple[tuple[str, bytes | None], ...] = ()


def record(request_id: str, reply_to: dict[str, Any], **fields: Any) -> bytes:
    body = {"request_id": request_id, "prompt": PROMPT, "max_tokens": 2, "reply_to": reply_to}
    body.update(fields)
    return json.dumps(body).encode()


def raw(text: bytes) -> Callable[[str, dict[str, Any], str], bytes]:
    return lambda rid, reply_to, prefix: text


POISONS = [
    Poison("not json", "not_json", raw(b"{not json")),
    Poison("binary", "not_json", raw(b"\x00\xff\xfe garbage")),
    Poison("json array", "not_object", raw(b"[1, 2, 3]")),
    Poison("json string", "not_object", raw(b'"a string"')),
    Poison(
        "nested 100k deep",
        "not_json",
        lambda rid, rt, p: b'{"request_id": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000,
    ),
    Poison(
        "escaped lone surrogate",
        "not_json",
        lambda rid, rt, p: record(rid, rt).replace(f'"{PROMPT}"'.encode(), b'"\\ud800"'),
        answered=True,  # its reply_to is read by a lenient second parse (ADR 0044)
    ),
    Poison(
        "raw surrogate bytes",
        "not_json",
        lambda rid, rt, p: record(rid, rt).replace(f'"{PROMPT}"'.encode(), b'"\xed\xa0\x80"'),
        answered=True,  # the same: the stdlib's parser takes surrogate bytes
    ),
    Poison(
        "invalid utf-8",
        "not_json",
        lambda rid, rt, p: record(rid, rt).replace(f'"{PROMPT}"'.encode(), b'"\xc3\x28"'),
    ),
    Poison(
        "wrong type",
        "invalid_field",
        lambda rid, rt, p: record(rid, rt, max_tokens="lots"),
        answered=True,
    ),
    Poison(
        "prompt too long",
        "invalid_field",
        lambda rid, rt, p: record(rid, rt, prompt="w" * 70_000),
        answered=True,
    ),
    Poison(
        "unknown field",
        "invalid_field",
        lambda rid, rt, p: record(rid, rt, colour="red"),
        answered=True,
    ),
    Poison(
        "request id outside the protocol",
        "invalid_field",
        lambda rid, rt, p: record("has spaces " + rid, rt),
        answered=True,  # under the record's key, which is a usable id
    ),
    Poison(
        "infinite created_at",
        "invalid_field",
        lambda rid, rt, p: record(rid, rt, created_at=float("inf")),
        answered=True,
    ),
    Poison(
        "deadline beyond any float",
        "invalid_field",
        lambda rid, rt, p: record(rid, rt, deadline_ms=10**400),
        answered=True,
    ),
    Poison(
        "near the broker's size limit",
        "invalid_field",
        lambda rid, rt, p: record(rid, rt, padding="p" * 1_040_000),
        answered=True,
    ),
    Poison(
        "content-type json, body not",
        "not_json",
        raw(b"[[[oops"),
        headers=(("content-type", b"application/json"),),
    ),
    Poison(
        "content-type text, body not UTF-8",
        "not_json",
        raw(b"\xff\xfe"),
        headers=(("content-type", b"text/plain"),),
    ),
    Poison(
        "header values not UTF-8 or null",
        "invalid_field",
        lambda rid, rt, p: record(rid, rt, top_p=9),
        answered=True,
        headers=(("traceparent", b"\xff\xfe"), ("x-null", None), ("tracestate", b"\xc3")),
    ),
    Poison(
        "reply_to topic missing",
        "reply_to_missing",
        lambda rid, rt, p: record(rid, {"topic": f"{p}.no-such-topic"}),
    ),
    Poison(
        "reply_to partition out of range",
        "reply_to_partition",
        lambda rid, rt, p: record(rid, {**rt, "partition": 999}),
    ),
    Poison(
        "reply_to topic name Kafka refuses",
        "reply_to_forbidden",
        lambda rid, rt, p: record(rid, {"topic": "."}),
    ),
    Poison(
        "reply_to a pipeline topic",
        "reply_to_reserved",
        lambda rid, rt, p: record(rid, {"topic": f"{p}.requests.interactive"}),
    ),
    Poison(
        "past deadline and undeliverable reply_to",
        "reply_to_partition",
        lambda rid, rt, p: record(
            rid, {**rt, "partition": 999}, created_at=time.time() - 600, deadline_ms=1
        ),
    ),
    Poison(
        "invalid field and missing reply_to topic",
        "invalid_field",
        lambda rid, rt, p: record(rid, {"topic": f"{p}.gone"}, max_tokens=-1),
    ),
]


async def test_no_poison_record_stops_ingest_on_any_partition(stack: Stack) -> None:
    topics = stack.topics
    replies = f"{stack.prefix}.poison-replies"
    await create_topics(stack.settings, {replies: REPLIES_PARTITIONS})
    partitions = stack.topics.partitions()[topics.requests]
    pids = {key: proc.pid for key, proc in stack.processes.items()}
    producer = make_producer(stack.settings, client_id="test-poison")
    await producer.start()
    sources: dict[str, tuple[Poison, str]] = {}
    good_sent: dict[str, float] = {}
    try:
        async with Results(stack.bootstrap, replies, REPLIES_PARTITIONS) as results:
            for n, poison in enumerate(POISONS):
                for p in range(partitions):
                    reply_to = {"topic": replies, "partition": p % REPLIES_PARTITIONS}
                    bad_id = f"bad-{n}-{p}-{uuid.uuid4().hex[:6]}"
                    meta = await producer.send_and_wait(
                        topics.requests,
                        poison.value(bad_id, reply_to, stack.prefix),
                        key=bad_id.encode(),
                        partition=p,
                        headers=list(poison.headers),
                    )
                    sources[f"{topics.requests}/{p}/{meta.offset}"] = (poison, bad_id)
                    good_id = f"good-{n}-{p}-{uuid.uuid4().hex[:6]}"
                    good = record(good_id, reply_to, prompt=f"after {poison.name}")
                    await producer.send_and_wait(
                        topics.requests, good, key=good_id.encode(), partition=p
                    )
                    good_sent[good_id] = time.monotonic()
                await results.wait_for(
                    lambda: all(results.final(g) for g in good_sent),
                    30,
                    f"the good requests after {poison.name!r}",
                )
            # Every good request: one final result, `done`, within 5 s of being written.
            for good_id, sent in good_sent.items():
                finals = results.finals(good_id)
                assert [f.body["kind"] for f in finals] == ["done"], (good_id, finals)
                assert finals[0].at - sent < 5.0, (good_id, finals[0].at - sent)
            # Each answerable poison record's author hears of it, once, on its reply_to.
            await results.wait_for(
                lambda: all(results.final(bid) for kind, bid in sources.values() if kind.answered),
                10,
                "the error results of the poison records",
            )
            for kind, bad_id in sources.values():
                finals = results.finals(bad_id)
                if kind.answered:
                    assert [f.body["kind"] for f in finals] == ["error"], (kind.name, finals)
                    assert finals[0].body["code"] == "invalid_request"
                    assert PROMPT not in finals[0].body["message"]
                else:
                    assert finals == [], (kind.name, finals)
    finally:
        await producer.stop()

    dlq = await read_all(stack.bootstrap, topics.dlq, 1)
    by_source: dict[str, list[dict[str, str]]] = {}
    for letter in dlq:
        by_source.setdefault(letter.headers[SOURCE], []).append(letter.headers)
        assert len(letter.value) < 1_000_000
    assert set(by_source) == set(sources), "the DLQ holds exactly the poison records"
    for source, (kind, bad_id) in sources.items():
        [headers] = by_source[source]  # exactly once
        assert headers[REASON] == kind.reason, (kind.name, headers)
        assert headers[ERROR], kind.name
        expected_reply = "delivered" if kind.answered else headers[REPLY]
        assert headers[REPLY] == expected_reply
        if kind.reason.startswith("reply_to_") and kind.reason != "reply_to_reserved":
            assert headers[REPLY] == "undeliverable", (kind.name, headers)
        if kind.answered:
            assert headers[REQUEST_ID_HEADER] == bad_id
        if kind.name == "near the broker's size limit":
            assert int(headers[TRUNCATED]) > 1_040_000
        assert PROMPT not in headers[ERROR]  # no value of the record in the headers

    # Nothing restarted, and ingest met no defect on the way.
    assert {key: proc.pid for key, proc in stack.processes.items()} == pids
    assert all(proc.poll() is None for proc in stack.processes.values())
    assert events(stack.log("ingest"), "record.failed") == []
    assert PROMPT not in stack.log("ingest").read_text()  # no prompt in ingest's log
