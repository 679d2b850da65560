"""Which requests already have their final record on their `reply_to`: never run them again.

A worker killed with -9 just after it wrote a request's `done` (before its next heartbeat or
offset commit said so) leaves that request looking unfinished to whoever takes its work
over: the scheduler's recovery and the worker's own next process. Both ask here first,
and leave out every request with a `done` or `error` (any attempt) written since its batch
was dispatched. Rare (a death), so one group-less consumer per question is cheap enough.

The same read gives the text each unanswered request's attempt has sent (`ReadBack.sent`):
its next attempt continues it rather than start over (ADR 0071).

The read is bounded; when it fails, the caller is told nothing is answered and nothing sent
(runs everything again from the start: at least once, never lost) and the failure is logged.

`since_ms` is the batch record's timestamp (the scheduler's clock), a final's is the worker's:
the read starts `shared/clocks.py`'s margin earlier, so that a worker whose clock runs behind
is not taken for one that never answered (a request answered would run again). A worker
further behind than the margin gets its requests run again: at least once, never lost.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
from aiokafka import TopicPartition
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaError

from shared.clocks import since_with_margin_ms
from shared.kafka import make_consumer
from shared.messages import QueuedRequest
from shared.settings import TokenbusSettings

log = structlog.get_logger()

FINAL_KINDS = frozenset({"done", "error"})
FETCH_MS = 200
# Each call's own bound: a hung node (SIGSTOP, a black hole) then costs this much before
# the next node is asked, not aiokafka's 40 s, which would spend the caller's whole budget.
REQUEST_TIMEOUT_MS = 1500


@dataclass
class ReadBack:
    """What `requests`' reply streams hold: which are answered, what the others sent."""

    answered: set[str] = field(default_factory=set)
    # request_id -> the text its attempt's deltas carry, from seq 0 without a hole (only
    # requests that sent some): what its next attempt continues.
    sent: dict[str, str] = field(default_factory=dict)


@dataclass
class _Attempt:
    attempt: int
    texts: dict[int, str] = field(default_factory=dict)  # seq -> delta text

    def text(self) -> str:
        out: list[str] = []
        while (text := self.texts.get(len(out))) is not None:
            out.append(text)
        return "".join(out)


async def read_back(
    settings: TokenbusSettings,
    requests: Sequence[QueuedRequest],
    since_ms: int,
    timeout_s: float,
    *,
    client_id: str,
) -> ReadBack:
    """Which of `requests` have a final record on their `reply_to` written since `since_ms`
    (by another clock than the caller's: with `shared/clocks.py`'s margin), and the text
    each other one's attempt sent.

    Empty (nothing answered, nothing sent: run everything again from the start) if the read
    fails or takes longer than `timeout_s`; the failure is logged as `finals.check_failed`.
    """
    if not requests:
        return ReadBack()
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(settings, requests, since_ms, client_id)
    except (KafkaError, TimeoutError, OSError) as exc:
        log.warning("finals.check_failed", error=repr(exc), requests=len(requests))
        return ReadBack()


async def _read(
    settings: TokenbusSettings, requests: Sequence[QueuedRequest], since_ms: int, client_id: str
) -> ReadBack:
    attempts = {r.request_id: _Attempt(r.attempt) for r in requests}
    consumer = make_consumer(
        settings,
        group_id=None,
        client_id=client_id,
        fetch_max_wait_ms=FETCH_MS,
        request_timeout_ms=REQUEST_TIMEOUT_MS,
    )
    await consumer.start()
    try:
        # One metadata request for just these topics (as shared/results.py does).
        cluster = ClusterMetadata()
        topics = sorted({r.reply_to.topic for r in requests})
        if not await consumer._client._metadata_update(cluster, topics):
            raise KafkaError("no broker answered the metadata request")
        tps = _partitions(requests, cluster)
        if not tps:
            return ReadBack()
        consumer.assign(sorted(tps))
        earliest = since_with_margin_ms(since_ms)
        found = await consumer.offsets_for_times({tp: earliest for tp in tps})
        ends = await consumer.end_offsets(sorted(tps))
        todo: dict[TopicPartition, int] = {}
        for tp in tps:
            at = found.get(tp)
            if at is not None and at.offset < ends[tp]:
                consumer.seek(tp, at.offset)
                todo[tp] = ends[tp]
        out = ReadBack()
        while todo:
            fetched = await consumer.getmany(*todo, timeout_ms=FETCH_MS)
            for records in fetched.values():
                for record in records:
                    _observe(record.value, attempts, out.answered)
            for tp in list(todo):
                if await consumer.position(tp) >= todo[tp]:
                    del todo[tp]
        for request_id, attempt in attempts.items():
            if request_id not in out.answered and (text := attempt.text()):
                out.sent[request_id] = text
        return out
    finally:
        await consumer.stop()


def _partitions(requests: Sequence[QueuedRequest], cluster: ClusterMetadata) -> set[TopicPartition]:
    """Every partition a final can be on: the named one, else all (keyed, any of them)."""
    out: set[TopicPartition] = set()
    for request in requests:
        topic = request.reply_to.topic
        if request.reply_to.partition is not None:
            out.add(TopicPartition(topic, request.reply_to.partition))
            continue
        for partition in cluster.partitions_for_topic(topic) or ():
            out.add(TopicPartition(topic, partition))
    return out


def _observe(value: bytes | None, attempts: dict[str, _Attempt], answered: set[str]) -> None:
    """One result record: a final of a wanted request marks it answered; a delta of its
    running attempt adds to what it sent."""
    try:
        body = json.loads(value or b"")
    except ValueError:
        return
    if not isinstance(body, dict):
        return
    request_id, kind = body.get("request_id"), body.get("kind")
    if not isinstance(request_id, str) or (attempt := attempts.get(request_id)) is None:
        return
    if kind in FINAL_KINDS:
        answered.add(request_id)
        return
    text, seq = body.get("text"), body.get("seq")
    ours = kind == "delta" and body.get("attempt", 0) == attempt.attempt
    if ours and isinstance(text, str) and isinstance(seq, int) and seq >= 0:
        attempt.texts.setdefault(seq, text)
