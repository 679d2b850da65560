"""A dead worker's unfinished requests go back to their tier topics, each with `attempt + 1`.

Which requests: every request in a batch addressed to the worker, read from its batch
partition from the worker's committed offset (the oldest batch it had not finished) to
the end, that it had not acknowledged (batch at or past its last `batches_consumed`) or
still held (in its last heartbeat's `held`). The hand-backs and the move of the worker's
committed offset to the end happen in one Kafka transaction, under the worker's own
transactional id (shared/handover.py), so a recovery interrupted by a crash is redone from
the start, never half-counted, and a second scheduler recovering the same worker, or the
worker's next process taking the same range over at its start, is fenced: exactly one of
them re-issues each batch.

Before that, each request's `reply_to` gets a `reset` record of the new attempt: a worker
declared dead may only have been paused, and whatever it writes when it wakes belongs to
an attempt the edge now drops. A `reply_to` that cannot be written gets none (its request
is dead-lettered by the worker that takes it next).

Each other request's next attempt continues the text its attempt sent, read back from its
`reply_to` in the same read (ADR 0071).

A request whose `reply_to` already holds a final record (`done` or `error`, any attempt)
written since its batch was dispatched is not handed back: the worker finished it and was
killed, or went unheard, before it said so (its next heartbeat or offset commit). Each
`reply_to` is settled first (shared/resets.py, ADR 0050), so a final stored but not yet
readable while a replica is away is found too. That read is bounded (FINAL_CHECK_TIMEOUT_S,
shared/finals.py); when it fails, every request is handed back (at least once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Set

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError

from services.scheduler.batch_log import BatchLog, LoggedBatch
from shared import finals, handover
from shared.kafka import make_producer
from shared.messages import Heartbeat, QueuedRequest
from shared.resets import announce_next_attempts, settle
from shared.settings import TokenbusSettings
from shared.topics import Topics

FINAL_CHECK_TIMEOUT_S = 10.0  # longest the read of the reply topics for finals may take

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
        log_lock: asyncio.Lock | None = None,
    ) -> None:
        self._settings = settings
        self._topics = Topics(settings.topic_prefix)
        self._admin = admin
        self._batch_log = batch_log
        self._producer = producer  # the scheduler's own, for the reset records
        # The batch log's consumer has one reader at a time (a take-over reads it too). Held
        # only while reading it: the rest of a recovery can wait on an away node for
        # seconds, and a take-over waiting behind it holds up a rebalance (no dispatch).
        self._log_lock = log_lock or asyncio.Lock()

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
        # A fresh transactional producer per recovery, under the worker's own id (shared/
        # handover.py): starting it fences (aborts) a recovery still in flight elsewhere, or
        # the worker's next process taking the same range over, and waits out one that is
        # committing, so the committed offset read next includes whatever either completed.
        producer = make_producer(
            self._settings,
            client_id="scheduler-recovery",
            transactional_id=handover.transactional_id(self._topics, last.worker_id),
        )
        try:
            await start_fencing(producer)
            return await self._hand_back(producer, last, group, tp, exclude, still_dead)
        finally:
            await producer.stop()  # a producer whose start failed too: its client is open

    async def _hand_back(
        self,
        producer: AIOKafkaProducer,
        last: Heartbeat,
        group: str,
        tp: TopicPartition,
        exclude: Set[tuple[str, int]],
        still_dead: Callable[[], bool],
    ) -> list[tuple[str, int]]:
        async def read_committed() -> int | None:
            committed = await self._admin.list_consumer_group_offsets(group, partitions=[tp])
            return committed[tp].offset if tp in committed else None

        start = await handover.committed_offset(read_committed)
        if start is None:
            return []  # the worker commits its start position before its first heartbeat
        async with self._log_lock:
            end = (await self._batch_log.end_offsets([tp]))[tp]
            if end <= start:
                return []
            batches = await self._batch_log.read({tp: start})
        requests = unfinished(batches, last, exclude)
        sent: dict[str, str] = {}
        if requests:
            since_ms = min(b.timestamp_ms for b in batches)
            # A final the worker wrote may be stored but not yet readable (an away replica):
            # settled first, it is found here, not after the next attempt's reset.
            await settle(self._producer, requests)
            found = await finals.read_back(
                self._settings,
                requests,
                since_ms,
                FINAL_CHECK_TIMEOUT_S,
                client_id="scheduler-recovery-finals",
            )
            answered, sent = found.answered, found.sent
            if answered:
                log.info(
                    "worker.recovery_skipped_answered",
                    worker_id=last.worker_id,
                    answered=len(answered),
                )
                requests = [r for r in requests if r.request_id not in answered]
        # Once a reset is written the hand-back must follow (the edge now waits for N + 1),
        # so whether the worker is still dead is asked last thing before the first write.
        if not still_dead():
            log.info("worker.recovery_cancelled", worker_id=last.worker_id)
            return []
        await announce_next_attempts(
            self._producer, requests, "the worker running it was declared dead"
        )
        await handover.commit_hand_backs(producer, self._topics, requests, {tp: end}, group, sent)
        log.info(
            "worker.recovered",
            worker_id=last.worker_id,
            handed_back=len(requests),
            continued=len(sent),
            batches=len(batches),
            start=start,
            end=end,
        )
        return [(r.request_id, r.attempt) for r in requests]


async def start_fencing(producer: AIOKafkaProducer) -> None:
    """Start a recovery's transactional producer; a start that finds no broker is a
    `KafkaConnectionError`, which the caller retries.

    aiokafka asserts there (`coordinator_lookup`: "Did we not perform bootstrap?") when its
    metadata names no broker at that moment. Stop 18's clean clone met it just after the only
    broker's 30 s hang: the AssertionError went past the recovery's retry and ended the
    scheduler, and the request the dead worker handed back was never run again.
    """
    try:
        await producer.start()
    except AssertionError as exc:
        raise KafkaConnectionError(
            f"no broker known to start the recovery's producer: {exc}"
        ) from exc
