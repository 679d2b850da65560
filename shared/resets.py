"""`reset` records: each re-issued request's next attempt announced on its `reply_to` first.

Whoever re-issues a worker's unfinished requests (the scheduler's recovery, the worker's
own next process: shared/handover.py) announces the next attempt on each `reply_to` before
the hand-back, and waits (bounded) for the announcements to be stored: the worker that
left them may only have been paused, and whatever it writes when it wakes belongs to an
attempt every reader now drops (ADR 0014, "attempt-superseding records").

Before it asks which requests are answered already (shared/finals.py), it settles their
`reply_to` partitions (`settle`): a `reset` of the attempt that is running, which no
reader acts on, written with acks=all. A record is readable only once every in-sync
replica holds it, so while a replica is away (a hung or partitioned broker, until the
controller fences it) a final the worker already wrote can be in the leader's log yet
invisible; once the settle record is stored, everything before it is readable, and a
`done` there is found before the next attempt is announced after it (ADR 0050).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence, Set

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from shared.messages import QueuedRequest, ResetResult
from shared.results import WRITE_ERRORS, cluster_metadata, send_result, target_problem

log = structlog.get_logger()

RESET_TIMEOUT_S = 5.0  # longest the reset records of one hand-back may take to be stored
# Longest the settle records may take: past broker.session.timeout.ms (6 s), after which
# the controller fences an away node and the partitions' writes flow again.
SETTLE_TIMEOUT_S = 15.0
LOOK_UP_TRY_S = 2.0  # one metadata request's bound (a hung node is not waited out)
LOOK_UP_GAP_S = 0.5
SETTLE_REASON = "settling the stream before a hand-back: nothing changes for a reader"


async def announce_next_attempts(
    producer: AIOKafkaProducer, requests: Sequence[QueuedRequest], reason: str
) -> None:
    """Write a `reset` of attempt `N + 1` to each request's `reply_to`; best effort, bounded.

    A reset that cannot be written (its `reply_to` gone, a write failing) is logged and
    skipped: the hand-back must not wait on one bad `reply_to`, and the worker's own
    fencing still stops a woken zombie.
    """
    resets = [ResetResult.before_retry(r, reason) for r in requests]
    failed = await _write(producer, requests, resets, RESET_TIMEOUT_S)
    if failed:
        log.warning("reset.failed", count=failed, of=len(requests))


async def settle(producer: AIOKafkaProducer, requests: Sequence[QueuedRequest]) -> bool:
    """Make every record already in each request's `reply_to` partition readable.

    Writes a `reset` of the request's own attempt (readers drop a reset of an attempt they
    have: README, "Writing requests straight to Kafka") and waits until it is stored, up to
    `SETTLE_TIMEOUT_S`: longer than the controller takes to fence an away replica, so a
    partition whose writes stall on one comes through. Returns False if some were not
    stored (the caller's answer then rests on what was readable: at least once).
    """
    barriers = [
        ResetResult(request_id=r.request_id, attempt=r.attempt, reason=SETTLE_REASON)
        for r in requests
    ]
    failed = await _write(producer, requests, barriers, SETTLE_TIMEOUT_S)
    if failed:
        log.warning("reset.settle_failed", count=failed, of=len(requests))
    return failed == 0


async def _write(
    producer: AIOKafkaProducer,
    requests: Sequence[QueuedRequest],
    records: Sequence[ResetResult],
    timeout_s: float,
) -> int:
    """Write `records[i]` to `requests[i].reply_to`, wait up to `timeout_s`; count failures.

    A `reply_to` that cannot be written (gone, no such partition) is skipped and logged.
    """
    if not requests:
        return 0
    known = producer.client.cluster
    unknown = {r.reply_to.topic for r in requests} - set(known.topics())
    looked_up = await _look_up(producer, unknown, timeout_s) if unknown else {}
    futures: list[asyncio.Future[RecordMetadata]] = []
    failed = 0
    for request, record in zip(requests, records, strict=True):
        topic = request.reply_to.topic
        partitions = known.partitions_for_topic(topic) or looked_up.get(topic)
        problem = target_problem(request.reply_to, partitions)
        if problem is not None:
            log.warning("reset.skipped", request_id=request.request_id, reason=problem)
            continue
        try:
            async with asyncio.timeout(timeout_s):
                futures.append(await send_result(producer, request.reply_to, record))
        except WRITE_ERRORS as exc:
            log.warning("reset.failed", request_id=request.request_id, error=repr(exc))
            failed += 1
    if futures:
        done, pending = await asyncio.wait(futures, timeout=timeout_s)
        failed += len(pending) + sum(1 for f in done if f.exception() is not None)
    return failed


async def _look_up(
    producer: AIOKafkaProducer, topics: Set[str], timeout_s: float
) -> dict[str, Set[int]]:
    """The partitions of each of `topics` a metadata answer names, asked again until all are
    named or `timeout_s` is spent: while a node is away, an answer can leave out a topic
    that exists (a chaos run saw every reset of a recovery skipped as "does not exist":
    ADR 0050), and one look-up can fail outright. A reply_to was checked when its request was
    admitted, so a topic still missing at the end is most likely gone indeed."""
    found: dict[str, Set[int]] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            # One look-up for all the topics (per-request result topics), not one each.
            cluster = await cluster_metadata(producer, max(0.1, min(left, LOOK_UP_TRY_S)), topics)
        except (KafkaError, TimeoutError) as exc:
            log.info("reset.look_up_failed", error=repr(exc))
        else:
            for topic in topics - set(found):
                partitions = cluster.partitions_for_topic(topic)
                if partitions is not None:
                    found[topic] = partitions
        if set(found) >= topics or time.monotonic() + LOOK_UP_GAP_S >= deadline:
            return found
        await asyncio.sleep(LOOK_UP_GAP_S)
