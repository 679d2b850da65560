"""`reset` records: each re-issued request's next attempt announced on its `reply_to` first.

Whoever re-issues a worker's unfinished requests (the scheduler's recovery, the worker's
own next process: shared/handover.py) announces the next attempt on each `reply_to` before
the hand-back, and waits (bounded) for the announcements to be stored: the worker that
left them may only have been paused, and whatever it writes when it wakes belongs to an
attempt every reader now drops (ADR 0014, "attempt-superseding records").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from shared.messages import QueuedRequest, ResetResult
from shared.results import WRITE_ERRORS, cluster_metadata, send_result, target_problem

log = structlog.get_logger()

RESET_TIMEOUT_S = 5.0  # longest the reset records of one hand-back may take to be stored


async def announce_next_attempts(
    producer: AIOKafkaProducer, requests: Sequence[QueuedRequest], reason: str
) -> None:
    """Write a `reset` of attempt `N + 1` to each request's `reply_to`; best effort, bounded.

    A reset that cannot be written (its `reply_to` gone, a write failing) is logged and
    skipped: the hand-back must not wait on one bad `reply_to`, and the worker's own
    fencing still stops a woken zombie.
    """
    if not requests:
        return
    known = producer.client.cluster
    cluster = None
    unknown = {r.reply_to.topic for r in requests} - set(known.topics())
    if unknown:
        # One look-up for all unknown topics (per-request result topics), not one each.
        cluster = await cluster_metadata(producer, RESET_TIMEOUT_S, unknown)
    futures: list[asyncio.Future[RecordMetadata]] = []
    for request in requests:
        topic = request.reply_to.topic
        partitions = known.partitions_for_topic(topic)
        if partitions is None and cluster is not None:
            partitions = cluster.partitions_for_topic(topic)
        problem = target_problem(request.reply_to, partitions)
        if problem is not None:
            log.warning("reset.skipped", request_id=request.request_id, reason=problem)
            continue
        reset = ResetResult.before_retry(request, reason)
        try:
            async with asyncio.timeout(RESET_TIMEOUT_S):
                futures.append(await send_result(producer, request.reply_to, reset))
        except WRITE_ERRORS as exc:
            log.warning("reset.failed", request_id=request.request_id, error=repr(exc))
    if futures:
        done, pending = await asyncio.wait(futures, timeout=RESET_TIMEOUT_S)
        failed = len(pending) + sum(1 for f in done if f.exception() is not None)
        if failed:
            log.warning("reset.failed", count=failed, of=len(futures))
