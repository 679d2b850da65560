"""A dead worker's unfinished requests go back to their tier topics, each with `attempt + 1`.

Which requests: every request in a batch addressed to the worker, read from its batch
partition from the worker's committed offset (the oldest batch it had not finished) to
the end, that it had not acknowledged (batch at or past its last `batches_consumed`) or
still held (in its last heartbeat's `held`). The hand-backs and the move of the worker's
committed offset to the end happen in one Kafka transaction, so a recovery interrupted
by a crash is redone from the start, never half-counted; the fixed transactional id
fences a second scheduler recovering at the same time.

Before that, each request's `reply_to` gets a `reset` record of the new attempt: a worker
declared dead may only have been paused, and whatever it writes when it wakes belongs to
an attempt the edge now drops. A `reply_to` that cannot be written gets none (its request
is dead-lettered by the worker that takes it next).

A request whose `reply_to` already holds a final record (`done` or `error`, any attempt)
written since its batch was dispatched is not handed back: the worker finished it and was
killed before it said so (its next heartbeat or offset commit). That read is bounded
(FINAL_CHECK_TIMEOUT_S, shared/finals.py); when it fails, every request is handed back
(at least once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Set

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import RecordMetadata

from services.scheduler.batch_log import BatchLog, LoggedBatch
from shared import finals
from shared.kafka import encode, key_of, make_producer
from shared.messages import Heartbeat, QueuedRequest, ResetResult
from shared.results import WRITE_ERRORS, cluster_metadata, send_result, target_problem
from shared.settings import TokenbusSettings
from shared.topics import Topics

RESET_TIMEOUT_S = 5.0  # longest the reset records of one recovery may take to be stored
FINAL_CHECK_TIMEOUT_S = 5.0  # longest the read of the reply topics for finals may take

log = structlog.get_logger()


def unfinished(
    batches: list[LoggedBatch], last: Heartbeat, exclude: Set[tuple[str, int]] = frozenset()
) -> list[QueuedRequest]:
    """The requests of `last.worker_id` a dead worker may not have answered, in batch order.

    `exclude`: (request_id, attempt) handed back already by an earlier recovery.
    """
    held = {(rid, attempt) for rid, attempt in last.held}
    out: list[QueuedRequest] = []
    seen: set[tuple[str, int]] = set(exclude)
    for logged in batches:
        if logged.batch.worker_id != last.worker_id:
            continue
        unacknowledged = logged.offset >= last.batches_consumed
        for request in logged.batch.requests:
            key = (request.request_id, request.attempt)
            if key in seen:
                continue
            if unacknowledged or key in held:
                seen.add(key)
                out.append(request)
    return out


class Recovery:
    """Hands back dead workers' requests; one instance per scheduler process."""

    def __init__(
        self,
        settings: TokenbusSettings,
        admin: AIOKafkaAdminClient,
        batch_log: BatchLog,
        producer: AIOKafkaProducer,
    ) -> None:
        self._settings = settings
        self._topics = Topics(settings.topic_prefix)
        self._admin = admin
        self._batch_log = batch_log
        self._producer = producer  # the scheduler's own, for the reset records

    async def recover(
        self,
        last: Heartbeat,
        exclude: Set[tuple[str, int]] = frozenset(),
        still_dead: Callable[[], bool] = lambda: True,
    ) -> list[tuple[str, int]]:
        """Hand back what `last.worker_id` left unfinished; return the (id, attempt) handed.

        `still_dead()` is asked once more just before anything is written: a worker heard
        of again meanwhile (a new incarnation takes its own back, and batches sent to it
        since must not be taken for the dead one's) is left alone, and [] returned.
        """
        if last.batch_partition is None:
            return []
        group = self._topics.worker_group(last.worker_id)
        tp = TopicPartition(self._topics.batches, last.batch_partition)
        # A fresh transactional producer per recovery: starting it fences (aborts) any
        # recovery still in flight elsewhere under the same transactional id, so the
        # committed offset read next includes whatever such a recovery completed.
        producer = make_producer(
            self._settings,
            client_id="scheduler-recovery",
            transactional_id=f"{self._settings.topic_prefix}.scheduler.recovery",
        )
        await producer.start()
        try:
            return await self._hand_back(producer, last, group, tp, exclude, still_dead)
        finally:
            await producer.stop()

    async def _hand_back(
        self,
        producer: AIOKafkaProducer,
        last: Heartbeat,
        group: str,
        tp: TopicPartition,
        exclude: Set[tuple[str, int]],
        still_dead: Callable[[], bool],
    ) -> list[tuple[str, int]]:
        committed = await self._admin.list_consumer_group_offsets(group, partitions=[tp])
        start = committed[tp].offset if tp in committed else -1
        if start < 0:
            return []  # the worker commits its start position before its first heartbeat
        end = (await self._batch_log.end_offsets([tp]))[tp]
        if end <= start:
            return []
        batches = await self._batch_log.read({tp: start})
        requests = unfinished(batches, last, exclude)
        if requests:
            since_ms = min(b.timestamp_ms for b in batches)
            answered = await finals.answered(
                self._settings,
                requests,
                since_ms,
                FINAL_CHECK_TIMEOUT_S,
                client_id="scheduler-recovery-finals",
            )
            if answered:
                log.info(
                    "worker.recovery_skipped_answered",
                    worker_id=last.worker_id,
                    answered=len(answered),
                )
                requests = [r for r in requests if r.request_id not in answered]
        # Once a reset is written the hand-back must follow (the edge now waits for N + 1),
        # so whether the worker is still dead is asked last thing before the first write.
        if not await self._supersede(requests, still_dead):
            log.info("worker.recovery_cancelled", worker_id=last.worker_id)
            return []
        async with producer.transaction():
            for request in requests:
                again = request.next_attempt()
                await producer.send(
                    self._topics.tier(request.tier), encode(again), key=key_of(again.request_id)
                )
            await producer.send_offsets_to_transaction({tp: end}, group)
        log.info(
            "worker.recovered",
            worker_id=last.worker_id,
            handed_back=len(requests),
            batches=len(batches),
            start=start,
            end=end,
        )
        return [(r.request_id, r.attempt) for r in requests]

    async def _supersede(
        self, requests: list[QueuedRequest], still_dead: Callable[[], bool]
    ) -> bool:
        """Announce each request's next attempt on its `reply_to`, best effort, bounded.

        False, with nothing written, if the worker is no longer dead when it would start.

        Written before the hand-back, and waited for (up to RESET_TIMEOUT_S), so that the
        reset is in each stream before anything of the next attempt. A reset that cannot be
        written is logged and skipped: the hand-back must not wait on one bad `reply_to`,
        and the worker's own fencing still stops a woken zombie.
        """
        known = self._producer.client.cluster
        cluster = None
        unknown = {r.reply_to.topic for r in requests} - set(known.topics())
        if unknown:
            # One look-up for all unknown topics (per-request result topics), not one each.
            cluster = await cluster_metadata(self._producer, RESET_TIMEOUT_S, unknown)
        futures: list[asyncio.Future[RecordMetadata]] = []
        if not still_dead():
            return False  # nothing written: the caller leaves the worker alone
        for request in requests:
            topic = request.reply_to.topic
            partitions = known.partitions_for_topic(topic)
            if partitions is None and cluster is not None:
                partitions = cluster.partitions_for_topic(topic)
            problem = target_problem(request.reply_to, partitions)
            if problem is not None:
                log.warning("reset.skipped", request_id=request.request_id, reason=problem)
                continue
            reset = ResetResult.before_retry(request, "the worker running it was declared dead")
            try:
                async with asyncio.timeout(RESET_TIMEOUT_S):
                    futures.append(await send_result(self._producer, request.reply_to, reset))
            except WRITE_ERRORS as exc:
                log.warning("reset.failed", request_id=request.request_id, error=repr(exc))
        if futures:
            done, pending = await asyncio.wait(futures, timeout=RESET_TIMEOUT_S)
            failed = len(pending) + sum(1 for f in done if f.exception() is not None)
            if failed:
                log.warning("reset.failed", count=failed, of=len(futures))
        return True
