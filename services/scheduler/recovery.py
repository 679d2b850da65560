"""A dead worker's unfinished requests go back to their tier topics, each with `attempt + 1`.

Which requests: every request in a batch addressed to the worker, read from its batch
partition from the worker's committed offset (the oldest batch it had not finished) to
the end, that it had not acknowledged (batch at or past its last `batches_consumed`) or
still held (in its last heartbeat's `held`). The hand-backs and the move of the worker's
committed offset to the end happen in one Kafka transaction, so a recovery interrupted
by a crash is redone from the start, never half-counted; the fixed transactional id
fences a second scheduler recovering at the same time.
"""

from __future__ import annotations

from collections.abc import Set

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from services.scheduler.batch_log import BatchLog, LoggedBatch
from shared.kafka import encode, key_of, make_producer
from shared.messages import Heartbeat, QueuedRequest
from shared.settings import TokenbusSettings
from shared.topics import Topics

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


def next_attempt(request: QueuedRequest) -> QueuedRequest:
    return request.model_copy(update={"attempt": request.attempt + 1})


class Recovery:
    """Hands back dead workers' requests; one instance per scheduler process."""

    def __init__(
        self, settings: TokenbusSettings, admin: AIOKafkaAdminClient, batch_log: BatchLog
    ) -> None:
        self._settings = settings
        self._topics = Topics(settings.topic_prefix)
        self._admin = admin
        self._batch_log = batch_log

    async def recover(
        self, last: Heartbeat, exclude: Set[tuple[str, int]] = frozenset()
    ) -> list[tuple[str, int]]:
        """Hand back what `last.worker_id` left unfinished; return the (id, attempt) handed."""
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
            return await self._hand_back(producer, last, group, tp, exclude)
        finally:
            await producer.stop()

    async def _hand_back(
        self,
        producer: AIOKafkaProducer,
        last: Heartbeat,
        group: str,
        tp: TopicPartition,
        exclude: Set[tuple[str, int]],
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
        async with producer.transaction():
            for request in requests:
                again = next_attempt(request)
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
