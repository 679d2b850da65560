"""How a worker receives the batches addressed to it, and what its heartbeat says about them.

The worker reads one partition of the batches topic (`worker_batch_partition`), assigned,
not through a group rebalance, and commits its progress under a group of its own
(`Topics.worker_group`), so a scheduler can hand back a dead worker's unfinished batches
from that committed offset. Batches addressed to another worker id are skipped. The
heartbeat reports the partition, how far the worker has read (`batches_consumed`, the
scheduler's acknowledgement) and the (request_id, attempt) of every request it holds.

At start, what a former process of the same id left between the committed offset and the
end goes back to the schedulers as the next attempt, in one transaction under the id the
scheduler's recovery uses too (shared/handover.py): it is never run here beside a copy the
recovery handed back.

A batch record that is not a valid batch is never retried: `parse_batch` keeps the
requests of it that are valid (they run), and says which are not and where their answer
goes; the caller dead-letters the record and answers those.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError

from services.worker.settings import WorkerSettings
from shared import finals, handover
from shared.dead_letters import Addressed, address_of
from shared.kafka import make_consumer, make_producer
from shared.messages import Batch, QueuedRequest, error_message
from shared.offsets import OffsetTracker
from shared.records import read, read_value
from shared.resets import announce_next_attempts, settle
from shared.retry import retrying
from shared.topics import Topics

log = structlog.get_logger()

FETCH_MS = 1000
REPLAY_CHECK_TIMEOUT_S = 10.0  # longest the check of a former process's finals may take


@dataclass(frozen=True)
class Rejected:
    """A request of a batch record that cannot run: where its answer goes (if known), why."""

    address: Addressed | None
    reason: str


@dataclass(frozen=True)
class ParsedBatch:
    """What can be run of one batch record.

    `batch`: the valid requests (None: nothing can run). `problem`: why the record is not a
    valid batch (None: it is); such a record is dead-lettered. `rejected`: its requests that
    cannot run.
    """

    batch: Batch | None
    problem: str | None = None
    rejected: list[Rejected] = field(default_factory=list)


def parse_batch(raw: bytes) -> ParsedBatch:
    """Validate a batch record; of an invalid one, salvage the valid requests.

    Pure. Every request is checked as strictly as a whole batch would be (re-encoded and
    parsed by the same strict JSON parser), so what the lenient read lets through (a lone
    surrogate) is rejected here rather than failing when its results are encoded.
    """
    try:
        return ParsedBatch(read(Batch, raw))
    except ValidationError as exc:
        problem = error_message(exc)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return ParsedBatch(None, problem)
    items = value.get("requests") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not isinstance(items, list):
        return ParsedBatch(None, problem)
    valid: list[QueuedRequest] = []
    rejected: list[Rejected] = []
    for item in items:
        try:
            valid.append(read(QueuedRequest, json.dumps(item)))
        except (ValidationError, ValueError, RecursionError) as exc:
            reason = error_message(exc) if isinstance(exc, ValidationError) else repr(exc)
            rejected.append(Rejected(address_of(item), reason))
    if not valid:
        return ParsedBatch(None, problem, rejected)
    try:
        batch = read_value(Batch, {**value, "requests": valid})
    except ValidationError as exc:
        # The batch's own fields are broken: its valid requests cannot be placed either.
        why = f"batch fields: {error_message(exc)}"
        lost = [Rejected(address_of(r.model_dump(mode="json")), why) for r in valid]
        return ParsedBatch(None, problem, rejected + lost)
    return ParsedBatch(batch, problem, rejected)


class BatchIntake:
    """The worker's batch partition: reading, holding, committing."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        topics = Topics(settings.topic_prefix)
        self.tp = TopicPartition(topics.batches, settings.worker_batch_partition)
        self.group = topics.worker_group(settings.worker_id)
        self.started_at = time.time()
        self.consumed = 0  # next offset to read: every batch below is in our hands
        self.freed = asyncio.Event()  # a held request finished: worth a heartbeat soon
        self._held: dict[tuple[str, int], None] = {}
        self._offsets = OffsetTracker()
        self._commit_lock = asyncio.Lock()
        self._topics = topics

    def consumer(self) -> AIOKafkaConsumer:
        # A new worker id starts at the live end: nothing was addressed to it before its
        # first heartbeat, which comes after `start` has committed that position.
        return make_consumer(
            self.settings,
            group_id=self.group,
            client_id=self.worker_id,
            auto_offset_reset="latest",
            # A fetch returns as soon as a batch arrives: the long poll saves the idle
            # fetches (ADR 0038); a seek (only in `start`'s take-over) may wait one out.
            long_poll=True,
        )

    async def start(self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer) -> None:
        """Assign our partition; take over what a former process of this id left unfinished.

        Batches between the committed offset and today's end were addressed to a former
        process with this id: it may have streamed part of them, or been recovered by a
        scheduler meanwhile. They go back to the schedulers as the next attempt, less what
        it answered, in one transaction with the move of the committed offset to the end,
        under the id the scheduler's recovery uses too (shared/handover.py): exactly one of
        the two re-issues them. `producer` writes the `reset` records. Retried until done
        (a broker node away): nothing is read or run before.
        """
        consumer.assign([self.tp])
        end = await retrying(
            lambda: self._take_over(consumer, producer),
            within_s=None,
            what="takeover",
            retry_on=(KafkaError, TimeoutError),
            worker_id=self.worker_id,
        )
        consumer.seek(self.tp, end)
        self.consumed = end

    async def _take_over(self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer) -> int:
        """One try of `start`'s take-over; returns the offset reading starts from."""
        txn = make_producer(
            self.settings,
            client_id=f"{self.worker_id}-takeover",
            transactional_id=handover.transactional_id(self._topics, self.worker_id),
        )
        # Starting it aborts a recovery of this id still open, and waits out one committing.
        await txn.start()
        try:

            async def read_committed() -> int | None:
                offset: int | None = await consumer.committed(self.tp)
                return offset

            committed = await handover.committed_offset(read_committed)
            end: int = (await consumer.end_offsets([self.tp]))[self.tp]
            # A new id starts at the live end: nothing was addressed to it before its first
            # heartbeat, which comes after this commit.
            start = end if committed is None else min(committed, end)
            requests, sent = await self._left_unfinished(consumer, producer, start, end)
            await announce_next_attempts(producer, requests, "the worker running it was restarted")
            await handover.commit_hand_backs(
                txn, self._topics, requests, {self.tp: end}, self.group, sent
            )
        finally:
            await txn.stop()
        log.info(
            "intake.started",
            worker_id=self.worker_id,
            partition=self.tp.partition,
            committed=committed,
            position=end,
            handed_back=len(requests),
        )
        return end

    async def _left_unfinished(
        self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer, start: int, end: int
    ) -> tuple[list[QueuedRequest], dict[str, str]]:
        """The requests of our batches in [start, end), less those already answered, and
        the text each of them sent (its next attempt continues it: ADR 0071)."""
        if end <= start:
            return [], {}
        consumer.seek(self.tp, start)
        batches: list[tuple[int, Batch]] = []  # (record timestamp, batch)
        while await consumer.position(self.tp) < end:
            fetched = await consumer.getmany(self.tp, timeout_ms=FETCH_MS)
            for record in fetched.get(self.tp, []):
                if record.offset >= end:
                    continue
                batch = parse_batch(record.value or b"").batch
                if batch is not None and batch.worker_id in (None, self.worker_id):
                    batches.append((record.timestamp, batch))
        requests = handover.distinct(r for _, b in batches for r in b.requests)
        if not requests:
            return [], {}
        # The former process's last finals may be stored but not yet readable: settle first.
        await settle(producer, requests)
        found = await finals.read_back(
            self.settings,
            requests,
            min(ts for ts, _ in batches),
            REPLAY_CHECK_TIMEOUT_S,
            client_id=f"{self.worker_id}-takeover-finals",
        )
        done = found.answered
        if done:
            log.info("takeover.skipped_answered", worker_id=self.worker_id, answered=len(done))
        return [r for r in requests if r.request_id not in done], found.sent

    async def take(
        self, consumer: AIOKafkaConsumer
    ) -> list[tuple[ConsumerRecord[bytes, bytes], ParsedBatch]]:
        """The next batch records for us, each valid request now held; others' are skipped.

        A record that is not a valid batch is returned too (its `problem` set), for the
        caller to dead-letter, answer and complete with `done`.
        """
        fetched = await consumer.getmany(self.tp, timeout_ms=FETCH_MS)
        out: list[tuple[ConsumerRecord[bytes, bytes], ParsedBatch]] = []
        for record in fetched.get(self.tp, []):
            self._offsets.taken(self.tp, record.offset)
            self.consumed = max(self.consumed, record.offset + 1)
            parsed = parse_batch(record.value or b"")
            batch = parsed.batch
            if batch is not None and batch.worker_id not in (None, self.worker_id):
                await self.done(consumer, record.offset)
                continue
            if batch is not None:
                for request in batch.requests:
                    self._held[(request.request_id, request.attempt)] = None
            out.append((record, parsed))
        return out

    def renew(self) -> None:
        """This process is a new incarnation from now on (after fencing itself)."""
        self.started_at = time.time()

    def finished(self, request: QueuedRequest) -> None:
        """The request is answered or handed back: we no longer hold it."""
        if self._held.pop((request.request_id, request.attempt), 0) is None:
            self.freed.set()

    def held(self) -> list[tuple[str, int]]:
        return list(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._held)

    async def done(self, consumer: AIOKafkaConsumer, offset: int) -> None:
        """Every request of the batch at `offset` is answered or handed back: commit past it."""
        self._offsets.done(self.tp, offset)
        async with self._commit_lock:
            positions = self._offsets.committable()
            if not positions:
                return
            try:
                await consumer.commit(positions)
                self._offsets.mark_committed(positions)
            except KafkaError as exc:
                # Kept for the next batch's commit (a broker outage, a coordinator move); a
                # recovery meanwhile reads from the older offset, which only costs a re-read.
                log.warning("commit.failed", error=repr(exc))
