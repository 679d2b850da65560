"""The scheduler process: tier topics in, batches addressed to workers out, restart-safe commits.

Four tasks share one event loop: the tier reader (requests into the policy), the
heartbeat reader (workers' free slots and liveness), the stepper (runs the policy and
carries out its plan) and the liveness watch (declares workers dead and, on the one
scheduler that owns interactive partition 0, hands their unfinished requests back).

Nothing read stops the flow: a tier record or heartbeat that cannot be handled is
dead-lettered (a request answered with `invalid_request` where its `reply_to` can be
read) and skipped. Kafka errors (a broker outage) are retried with backoff: a batch is
sent until stored, an error answer for a bounded time and then dead-lettered, commits
and fetches again at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, RecordMetadata
from pydantic import ValidationError

from services.scheduler.backlog import Passenger
from services.scheduler.batch_log import BatchLog
from services.scheduler.ledger import Ledger
from services.scheduler.policy import Dispatch, Plan, Policy
from services.scheduler.recovery import Recovery
from services.scheduler.settings import SchedulerSettings
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.workers import WorkerRegistry
from shared.dead_letters import Addressed, Source, dead_letter, dead_letter_value, read_address
from shared.health import Readiness, consumer_readiness
from shared.kafka import encode, key_of, make_admin, make_consumer, make_producer
from shared.messages import (
    Batch,
    ErrorCode,
    ErrorResult,
    Heartbeat,
    QueuedRequest,
    ReplyTo,
    Tier,
    error_message,
)
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS, ReplyTargets, send_result
from shared.retry import backoffs, retrying
from shared.topics import Topics

log = structlog.get_logger()

FETCH_MS = 100  # longest a reader waits in one fetch, so rebalances and stops are prompt
LONGEST_SLEEP_S = 1.0  # the stepper re-plans at least this often
LIVENESS_TICK_S = 0.1
HEARTBEAT_LOOKBACK_S = 60.0  # on start, heartbeats this recent say who is alive
RESWEEP_AFTER_S = 10.0  # a dead worker is swept once more, for batches sent in a race
DISPATCHED_MEMORY_S = 600.0  # how long restart-scan findings are kept
SEEN_MEMORY = 200_000  # (request_id, attempt) remembered to drop a second hand-back
FORGET_DEAD_AFTER_S = 120.0  # a dead worker not recovered here is forgotten after this
METADATA_TIMEOUT_S = 2.0  # longest a reply_to look-up may take


@dataclass(frozen=True)
class Outgoing:
    """A batch on its way to its worker's partition."""

    batch: Batch
    partition: int
    headers: list[tuple[str, bytes]]


@dataclass(frozen=True)
class Poison:
    """A tier record that is not a request: dead-lettered, answered if it has an address."""

    tp: TopicPartition
    record: ConsumerRecord[bytes, bytes]
    reason: str
    address: Addressed | None


@dataclass(frozen=True)
class Waiting:
    """A request in the backlog, and the tier-topic record it came from."""

    request: QueuedRequest
    tp: TopicPartition
    offset: int


@dataclass
class PendingRecovery:
    beat: Heartbeat
    due_at: float
    sweep: bool = False


class Scheduler:
    def __init__(self, settings: SchedulerSettings) -> None:
        s = settings
        self.settings = s
        self.topics = Topics(s.topic_prefix)
        self.group = f"{s.topic_prefix}.scheduler"
        self.policy: Policy[Waiting] = Policy(s.policy_config(), s.departure_rule())
        self.ledger = Ledger()
        self.workers = WorkerRegistry(s.scheduler_worker_missed_beats)
        self.telemetry = SchedulerTelemetry(
            self.topics.batches,
            {
                Tier.interactive: s.scheduler_interactive_max_batch_size,
                Tier.background: s.scheduler_background_max_batch_size,
            },
        )
        self._wake = asyncio.Event()
        self._wake_at: float | None = None
        # One step (plan, send, commit) at a time; a rebalance waits for the step in flight.
        self._step_lock = asyncio.Lock()
        self._log_lock = asyncio.Lock()  # the batch log consumer has one reader at a time
        # Held by a take-over from its first await to its end, and by the tier reader while
        # it admits what it fetched: the consumer may hand over records of a partition while
        # its take-over is still reading the batches topic, and such a record must not be
        # admitted before the scan says whether it was dispatched already.
        self._intake_lock = asyncio.Lock()
        self._dispatched_before: dict[tuple[str, int], float] = {}  # found by restart scans
        # Per tier partition we own, the (request_id, attempt) read from it.
        self._seen: dict[TopicPartition, OrderedDict[tuple[str, int], None]] = {}
        self._last_produced: dict[int, int] = {}  # batches partition -> last offset we wrote
        self._start_ends: dict[int, int] = {}  # batches partition -> end when we started
        self._recoveries: dict[str, PendingRecovery] = {}
        self._beats_live_from: dict[TopicPartition, int] = {}  # heartbeats below: replayed
        self._last_commit = 0.0
        self._commit_interval = s.scheduler_commit_interval_ms / 1000.0
        self._handed_on = False  # something was handed on since the last commit

    # -- wiring ------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        # Renewed if an outage breaks its sequence numbers (shared/producers.py).
        producer = RenewingProducer(
            lambda: make_producer(s, client_id=f"scheduler-{s.scheduler_id}")
        )
        # A configured id is a stable identity: static membership lets a restarted process
        # take its partitions back at once instead of after the session timeout.
        static_id = s.scheduler_id if "scheduler_id" in s.model_fields_set else None
        tiers = make_consumer(
            s,
            group_id=self.group,
            client_id=f"scheduler-{s.scheduler_id}",
            # Hand-backs of a recovery that aborted must stay invisible.
            isolation_level="read_committed",
            group_instance_id=static_id,
        )
        tiers.subscribe(list(self.topics.tiers), listener=_Rebalance(self, tiers))
        beats = make_consumer(
            s,
            group_id=None,
            client_id=f"scheduler-{s.scheduler_id}-beats",
            auto_offset_reset="latest",
        )
        reader = make_consumer(s, group_id=None, client_id=f"scheduler-{s.scheduler_id}-log")
        admin = make_admin(s, client_id=f"scheduler-{s.scheduler_id}")
        self._producer = producer
        self._targets = ReplyTargets(producer, timeout_s=METADATA_TIMEOUT_S)
        self._admin = admin
        self._batch_log = BatchLog(reader)
        self._recovery = Recovery(s, admin, self._batch_log, producer)
        self._tiers = tiers
        stops: list[Callable[[], Awaitable[None]]] = []
        try:
            await producer.start()
            stops.append(producer.stop)
            await admin.start()
            stops.append(admin.close)
            for consumer in (reader, beats):
                await consumer.start()
                stops.append(consumer.stop)
            await self._start_floors()
            await self._seek_recent_heartbeats(beats)
            await tiers.start()
            stops.append(tiers.stop)
            log.info("scheduler.started", scheduler_id=s.scheduler_id, policy=s.scheduler_policy)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read_tiers(tiers))
                tg.create_task(self._read_heartbeats(beats))
                tg.create_task(self._steps())
                tg.create_task(self._watch_liveness())
        finally:
            for stop in reversed(stops):
                await stop()

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): tier partitions assigned, broker answering."""
        return await consumer_readiness([getattr(self, "_tiers", None)])

    async def _partitions(self, topic: str) -> list[TopicPartition]:
        """The topic's partitions as the cluster has them (the project's count if unknown)."""
        described = await self._admin.describe_topics([topic])
        count = len(described[0]["partitions"]) if described else 0
        count = count or self.topics.partitions()[topic]
        return [TopicPartition(topic, p) for p in range(count)]

    async def _start_floors(self) -> None:
        """Whatever we produce will land at or after today's end of each batches partition."""
        parts = await self._partitions(self.topics.batches)
        ends = await self._batch_log.end_offsets(parts)
        self._start_ends = {tp.partition: end for tp, end in ends.items()}

    async def _seek_recent_heartbeats(self, beats: AIOKafkaConsumer) -> None:
        tps = await self._partitions(self.topics.workers)
        beats.assign(tps)
        since = int((time.time() - HEARTBEAT_LOOKBACK_S) * 1000)
        found = await beats.offsets_for_times({tp: since for tp in tps})
        self._beats_live_from = await beats.end_offsets(tps)
        for tp in tps:
            at = found.get(tp)
            if at is None:
                await beats.seek_to_end(tp)
            else:
                beats.seek(tp, at.offset)

    # -- intake --------------------------------------------------------------------------

    async def _read_tiers(self, consumer: AIOKafkaConsumer) -> None:
        next_wait = backoffs()
        while True:
            try:
                fetched = await consumer.getmany(timeout_ms=FETCH_MS)
            except KafkaError as exc:
                wait = next_wait()
                log.warning("tiers.fetch_failed", error=repr(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                continue
            next_wait = backoffs()
            answers: list[tuple[Waiting, ErrorResult]] = []
            poisons: list[Poison] = []
            # A take-over in flight finishes its scan first: aiokafka fetches a newly
            # assigned partition while `on_partitions_assigned` still runs.
            async with self._intake_lock:
                fetched = self._owned(consumer, fetched)
                if not fetched:
                    continue
                self.telemetry.fetched(consumer, fetched)
                now = time.time()
                for tp, records in fetched.items():
                    for record in records:
                        if not self.ledger.read(tp, record.offset):
                            continue  # handed on before a restart or rebalance
                        answer = self._admit(tp, record, now)
                        if isinstance(answer, Poison):
                            poisons.append(answer)
                        elif answer is not None:
                            answers.append(answer)
            for poison in poisons:
                await self._reject(poison)
            await self._answer(answers)
            self._pause_far_ahead(consumer)
            self._wake.set()

    def _owned(
        self,
        consumer: AIOKafkaConsumer,
        fetched: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]],
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        """The fetched records this scheduler may admit now.

        Records of a partition revoked meanwhile belong to its new owner. Records of one
        assigned but not yet taken over (its ledger not restored) are fetched again later:
        dropped, they would be lost (the consumer's position has moved past them).
        """
        assigned = consumer.assignment()
        out: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
        for tp, records in fetched.items():
            if tp not in assigned or not records:
                continue
            if not self.ledger.owns(tp):
                log.info("tier_records.refetch", topic=tp.topic, partition=tp.partition)
                consumer.seek(tp, records[0].offset)
                continue
            out[tp] = records
        return out

    def _admit(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], now: float
    ) -> tuple[Waiting, ErrorResult] | Poison | None:
        """Queue the request, or return the error it must be answered with now."""
        try:
            request = QueuedRequest.model_validate_json(record.value or b"")
        except ValidationError as exc:
            # Ingest and recovery write tier topics, but so can anyone with access.
            reason = error_message(exc)
            log.error("tier_record.invalid", topic=tp.topic, offset=record.offset, error=reason)
            return Poison(tp, record, reason, read_address(record.value or b""))
        key = (request.request_id, request.attempt)
        seen = self._seen.setdefault(tp, OrderedDict())
        if key in seen:
            # Handed back twice (a recovery redone after a crash): one run is enough.
            log.info("request.duplicate", request_id=request.request_id, attempt=request.attempt)
            self.ledger.handed_on(tp, record.offset)
            return None
        seen[key] = None
        if len(seen) > SEEN_MEMORY:
            seen.popitem(last=False)
        if self._dispatched_before.pop(key, None) is not None:
            # Dispatched by this partition's previous owner after its last commit.
            log.info("request.already_dispatched", request_id=request.request_id)
            self.ledger.handed_on(tp, record.offset)
            return None
        waiting = Waiting(request, tp, record.offset)
        budget = self.policy.config.tiers[request.tier].max_batch_tokens
        if request.token_cost > budget:
            message = f"{request.token_cost} tokens is above the {request.tier} budget of {budget}"
            return waiting, self._error(request, ErrorCode.invalid_request, message)
        request = self.telemetry.arrived(request, _headers(record))
        waiting = Waiting(request, tp, record.offset)
        deadline = request.deadline_at
        if deadline is not None and deadline <= now:
            self.telemetry.expired(request)
            return waiting, self._deadline_error(request)
        queued = self.policy.add(
            waiting,
            tier=request.tier,
            cost=request.token_cost,
            prompt_tokens=request.prompt_tokens,
            now=now,
            deadline_at=deadline,
            tenant=request.tenant,
        )
        assert queued is not None  # the budget was checked above
        return None

    def _pause_far_ahead(self, consumer: AIOKafkaConsumer) -> None:
        limit = self.settings.scheduler_max_open_offsets
        paused = consumer.paused()
        for tp in consumer.assignment():
            span = self.ledger.span(tp)
            if span >= limit and tp not in paused:
                log.warning(
                    "tier_partition.paused", topic=tp.topic, partition=tp.partition, span=span
                )
                consumer.pause(tp)
            elif span < limit * 3 // 4 and tp in paused:
                consumer.resume(tp)

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        """Dead-letter a record this process cannot read (`invalid_request`), bounded in time."""
        await dead_letter(
            self._producer,
            self.topics.dlq,
            record,
            code=ErrorCode.invalid_request.value,
            reason=reason,
            reader=f"scheduler:{self.settings.scheduler_id}",
            within_s=self.settings.scheduler_answer_timeout_s,
        )

    async def _read_heartbeats(self, consumer: AIOKafkaConsumer) -> None:
        next_wait = backoffs()
        while True:
            try:
                fetched = await consumer.getmany(timeout_ms=FETCH_MS * 5)
            except KafkaError as exc:
                wait = next_wait()
                log.warning("heartbeats.fetch_failed", error=repr(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                continue
            next_wait = backoffs()
            now = time.time()
            for tp, records in fetched.items():
                live_from = self._beats_live_from.get(tp, 0)
                for record in records:
                    try:
                        beat = Heartbeat.model_validate_json(record.value or b"")
                        problem = self._beat_problem(beat)
                    except ValidationError as exc:
                        problem = error_message(exc)
                    if problem is not None:
                        log.error("heartbeat.invalid", offset=record.offset, error=problem)
                        await self._dead_letter(record, f"invalid heartbeat: {problem}")
                        continue
                    # Read back at start-up: proof of life only if it is this fresh.
                    stale = now - beat.sent_at > beat.interval_ms / 1000.0
                    replayed = record.offset < live_from and stale
                    if self.workers.beat(beat, now, replayed=replayed) and not replayed:
                        log.info(
                            "worker.registered",
                            worker_id=beat.worker_id,
                            partition=beat.batch_partition,
                            started_at=beat.started_at,
                            registered=len(self.workers),
                        )
            if fetched:
                self._wake.set()

    def _beat_problem(self, beat: Heartbeat) -> str | None:
        """Why a well-formed heartbeat cannot be used here (a partition we cannot send to)."""
        partition = beat.batch_partition
        if partition is not None and self._start_ends and partition not in self._start_ends:
            return (
                f"batch_partition {partition} is not a partition of {self.topics.batches}"
                f" ({len(self._start_ends)} partitions)"
            )
        return None

    # -- the step: plan, carry out, commit -------------------------------------------------

    async def _steps(self) -> None:
        while True:
            now = time.time()
            sleep = LONGEST_SLEEP_S if self._wake_at is None else self._wake_at - now
            if self._handed_on:  # a commit will be due
                sleep = min(sleep, self._last_commit + self._commit_interval - now)
            if sleep > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(sleep, LONGEST_SLEEP_S)):
                        await self._wake.wait()
            self._wake.clear()
            async with self._step_lock:
                now = time.time()
                plan = self.policy.plan(now, self.workers.slots(now))
                self._wake_at = plan.wake_at
                await self._carry_out(plan, now)
                await self._commit()

    async def _carry_out(self, plan: Plan[Waiting], now: float) -> None:
        sends: list[tuple[Dispatch[Waiting], Outgoing, asyncio.Future[RecordMetadata] | None]] = []
        for d in plan.dispatches:
            batch = Batch(
                batch_id=uuid.uuid4().hex,
                tier=d.tier,
                requests=[p.item.request for p in d.passengers],
                reason=d.reason,
                worker_id=d.worker_id,
            )
            batch, headers = self.telemetry.batch_formed(batch, departed_at=now)
            out = Outgoing(batch, self.workers.partition_of(d.worker_id), list(headers))
            future: asyncio.Future[RecordMetadata] | None
            try:
                future = await self._producer.send(
                    self.topics.batches,
                    encode(batch),
                    key=batch.batch_id.encode(),
                    partition=out.partition,
                    headers=out.headers,
                )
            except WRITE_ERRORS as exc:
                log.warning("batch.send_failed", batch_id=batch.batch_id, error=repr(exc))
                future = None
            sends.append((d, out, future))
        expired: list[tuple[Waiting, ErrorResult]] = []
        for p in plan.expired:
            self.telemetry.expired(p.item.request)
            expired.append((p.item, self._deadline_error(p.item.request)))
        for d, out, future in sends:
            batch = out.batch
            sent = await self._stored(out, future)
            self.telemetry.batch_sent(batch)
            self.workers.dispatched(d.worker_id, sent.offset, len(d.passengers))
            self._last_produced[sent.partition] = max(
                sent.offset, self._last_produced.get(sent.partition, -1)
            )
            self._hand_on(d.passengers)
            log.info(
                "batch.dispatched",
                batch_id=batch.batch_id,
                worker_id=d.worker_id,
                tier=d.tier.value,
                size=len(d.passengers),
                filled=d.filled,
                tokens=d.tokens,
                reason=d.reason,
                partition=sent.partition,
                offset=sent.offset,
            )
        await self._answer(expired)

    async def _stored(
        self, out: Outgoing, future: asyncio.Future[RecordMetadata] | None
    ) -> RecordMetadata:
        """The batch record's metadata once stored: sent again (with backoff) until it is.

        Its passengers left the backlog, so there is no way back: a broker outage holds the
        step here until the broker is back. Should a failed send have been stored after
        all, the worker skips the second copy (it remembers batch ids).
        """
        batch = out.batch
        if future is not None:
            try:
                return await future
            except KafkaError as exc:
                log.warning("batch.send_failed", batch_id=batch.batch_id, error=repr(exc))

        async def resend() -> RecordMetadata:
            sent: RecordMetadata = await self._producer.send_and_wait(
                self.topics.batches,
                encode(batch),
                key=batch.batch_id.encode(),
                partition=out.partition,
                headers=out.headers,
            )
            return sent

        return await retrying(
            resend, within_s=None, what="batch", retry_on=WRITE_ERRORS, batch_id=batch.batch_id
        )

    def _hand_on(self, passengers: Sequence[Passenger[Waiting]]) -> None:
        for p in passengers:
            self.ledger.handed_on(p.item.tp, p.item.offset)
        self._handed_on = True

    async def _reject(self, poison: Poison) -> None:
        """Dead-letter a tier record that is not a request; answer it if it can be."""
        record = poison.record
        await self._dead_letter(record, f"invalid tier record: {poison.reason}")
        address = poison.address
        if address is not None:
            error = ErrorResult(
                request_id=address.request_id,
                attempt=address.attempt,
                seq=0,
                code=ErrorCode.invalid_request,
                message=f"invalid request: {poison.reason}",
            )
            await self._write_answer(address.reply_to, error, None)
        self.ledger.handed_on(poison.tp, record.offset)
        self._handed_on = True

    async def _answer(self, answers: list[tuple[Waiting, ErrorResult]]) -> None:
        """Publish each error to its request's result stream; then it counts as handed on.

        An error that cannot be stored in time (or ever: its `reply_to` cannot be written)
        is dead-lettered with its request instead: never a silent commit, never a stall.
        """
        for w, error in answers:
            await self._write_answer(w.request.reply_to, error, w)
            self.ledger.handed_on(w.tp, w.offset)
        if answers:
            self._handed_on = True

    async def _write_answer(self, reply_to: ReplyTo, error: ErrorResult, w: Waiting | None) -> None:
        within = self.settings.scheduler_answer_timeout_s
        try:
            problem = await self._targets.problem(reply_to)
        except WRITE_ERRORS as exc:
            problem = None  # the cluster cannot say now: try the write, bounded
            log.warning("reply_to.lookup_failed", topic=reply_to.topic, error=repr(exc))
        if problem is None:

            async def write() -> RecordMetadata:
                return await (await send_result(self._producer, reply_to, error))

            try:
                await retrying(
                    write,
                    within_s=within,
                    what="answer",
                    retry_on=WRITE_ERRORS,
                    request_id=error.request_id,
                )
                log.info("request.answered", request_id=error.request_id, code=error.code.value)
                return
            except WRITE_ERRORS as exc:
                problem = f"the answer was not stored within {within} s: {exc!r}"
        log.error("answer.undeliverable", request_id=error.request_id, reason=problem)
        if w is not None:
            await dead_letter_value(
                self._producer,
                self.topics.dlq,
                encode(w.request),
                key=key_of(w.request.request_id),
                source=Source(w.tp.topic, w.tp.partition, w.offset),
                code=error.code.value,
                reason=f"{error.message}; undeliverable: {problem}",
                reader=f"scheduler:{self.settings.scheduler_id}",
                within_s=within,
            )

    async def _commit(self, *, only: set[TopicPartition] | None = None) -> None:
        """Commit what moved, at most once per commit interval (and at once on revocation).

        Commits are batched: a crash loses at most an interval of commits, which costs
        nothing but a longer read of the batches topic on restart (see ledger.py).
        """
        now = time.time()
        if only is None and now - self._last_commit < self._commit_interval:
            return
        entries = self.ledger.committable(self._floors())
        if only is not None:
            entries = {tp: e for tp, e in entries.items() if tp in only}
        if not entries:
            return
        try:
            await self._tiers.commit(entries)
        except KafkaError as exc:
            # A rebalance is under way (its revoke callback commits what we hand over), or
            # the broker is away: the next step commits again.
            log.warning("commit.failed", error=repr(exc))
            self._last_commit = now
            return
        self.ledger.mark_committed(entries)
        self._last_commit = now
        self._handed_on = False

    def _floors(self) -> dict[int, int]:
        """Per batches partition, an offset at or below any batch we can still produce."""
        consumed = self.workers.consumed()
        out: dict[int, int] = {}
        for partition, start_end in self._start_ends.items():
            out[partition] = max(
                start_end,
                consumed.get(partition, 0),
                self._last_produced.get(partition, -1) + 1,
            )
        return out

    # -- ownership of tier partitions -------------------------------------------------------

    async def take_over(self, assigned: set[TopicPartition]) -> None:
        """Restore the ledger of newly assigned partitions; learn what was already dispatched."""
        if not assigned:
            return
        async with self._intake_lock:
            await self._take_over(assigned)

    async def _take_over(self, assigned: set[TopicPartition]) -> None:
        # Retried until they answer (a broker just back): without the commit and the
        # batches read after it, these partitions cannot be scheduled without duplicates.
        committed = await retrying(
            lambda: self._admin.list_consumer_group_offsets(
                self.group, partitions=sorted(assigned)
            ),
            within_s=None,
            what="tier_offsets",
            retry_on=(KafkaError, TimeoutError),
        )
        starts: dict[int, int] = {}
        for tp in assigned:
            entry = committed.get(tp)
            offset = None if entry is None or entry.offset < 0 else entry.offset
            restored = self.ledger.restore(tp, offset, entry.metadata if entry else "")
            # Any batch of this partition's requests dispatched after that commit lies at
            # or after the commit's floors; without them, read the batches from the start.
            for partition in self._start_ends:
                floor = 0 if restored.floors is None else restored.floors.get(partition, 0)
                starts[partition] = min(starts.get(partition, floor), floor)
        topic = self.topics.batches
        async with self._log_lock:
            logged = await retrying(
                lambda: self._batch_log.read(
                    {TopicPartition(topic, p): offset for p, offset in starts.items()}
                ),
                within_s=None,
                what="batch_log",
                retry_on=(KafkaError, TimeoutError),
            )
        now = time.time()
        for old in [k for k, t in self._dispatched_before.items() if now - t > DISPATCHED_MEMORY_S]:
            del self._dispatched_before[old]
        for entry_ in logged:
            for request in entry_.batch.requests:
                self._dispatched_before[(request.request_id, request.attempt)] = now
        log.info(
            "tier_partitions.assigned",
            partitions=sorted(f"{tp.topic}/{tp.partition}" for tp in assigned),
            batches_scanned=len(logged),
        )

    async def release(self, revoked: set[TopicPartition]) -> None:
        """Stop scheduling revoked partitions' requests; commit what we handed on of them."""
        if not revoked:
            return
        async with self._step_lock:
            dropped = self.policy.backlog.remove_where(lambda w: w.tp in revoked)
            for p in dropped:
                self.telemetry.released(p.item.request)
                # Not handed on: its new owner (maybe us again) reads it anew.
                request = p.item.request
                self._seen.get(p.item.tp, OrderedDict()).pop(
                    (request.request_id, request.attempt), None
                )
            await self._commit(only=revoked)
            self.ledger.forget(revoked)
            # The rest of `_seen` is kept (bounded): a partition that comes back after a
            # rebalance (a broker outage does that) still drops a second hand-back of an
            # attempt it has handed on.
        log.info(
            "tier_partitions.revoked",
            partitions=sorted(f"{tp.topic}/{tp.partition}" for tp in revoked),
            dropped=len(dropped),
        )

    def leads_recovery(self) -> bool:
        return TopicPartition(self.topics.tier(Tier.interactive), 0) in self._tiers.assignment()

    # -- dead workers ------------------------------------------------------------------------

    async def _watch_liveness(self) -> None:
        grace = self.settings.scheduler_recovery_grace_ms / 1000.0
        while True:
            await asyncio.sleep(LIVENESS_TICK_S)
            now = time.time()
            for state in self.workers.newly_dead(now):
                log.warning(
                    "worker.dead",
                    worker_id=state.beat.worker_id,
                    silent_s=round(now - state.seen_at, 3),
                    held=len(state.beat.held),
                )
                self._recoveries[state.beat.worker_id] = PendingRecovery(state.beat, now + grace)
                self._wake.set()
            leader = self.leads_recovery()
            if self._recoveries and leader:
                await self._recover_due(now)
            for worker_id, pending in list(self._recoveries.items()):
                if now - pending.due_at > DISPATCHED_MEMORY_S:
                    del self._recoveries[worker_id]  # the leader elsewhere has done it
            # The leader forgets a worker once recovered; the others after a while.
            keep = set(self._recoveries) if leader else set()
            for worker_id in self.workers.forget_dead(now, FORGET_DEAD_AFTER_S, keep):
                log.info("worker.forgotten", worker_id=worker_id, registered=len(self.workers))

    async def _recover_due(self, now: float) -> None:
        for worker_id, pending in list(self._recoveries.items()):
            if pending.due_at > now:
                continue
            state = self.workers.get(worker_id)
            if state is not None and state.dead_at is None:
                del self._recoveries[worker_id]  # it beat again before the grace ran out
                continue
            done = set() if state is None else state.handed_back
            try:
                async with self._log_lock:
                    handed = await self._recovery.recover(
                        pending.beat, done, functools.partial(self._still_dead, pending.beat)
                    )
            except (KafkaError, TimeoutError) as exc:
                log.error("worker.recovery_failed", worker_id=worker_id, error=repr(exc))
                pending.due_at = now + 1.0
                continue
            done.update(handed)
            if pending.sweep:
                del self._recoveries[worker_id]
                # Recovered twice over: nothing of it is left here. If it comes back, it
                # registers afresh (its copies of what was handed back are dropped at intake).
                if self.workers.forget(worker_id):
                    log.info("worker.forgotten", worker_id=worker_id, registered=len(self.workers))
            else:
                pending.due_at, pending.sweep = now + RESWEEP_AFTER_S, True

    def _still_dead(self, last: Heartbeat) -> bool:
        """Whether the incarnation that sent `last` is still the dead one we know."""
        state = self.workers.get(last.worker_id)
        if state is None:
            return True  # forgotten: nothing of it came back
        return state.dead_at is not None and state.beat.started_at == last.started_at

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _error(request: QueuedRequest, code: ErrorCode, message: str) -> ErrorResult:
        return ErrorResult(
            request_id=request.request_id,
            attempt=request.attempt,
            seq=0,
            code=code,
            message=message,
        )

    def _deadline_error(self, request: QueuedRequest) -> ErrorResult:
        message = f"deadline of {request.deadline_ms} ms passed while queued"
        return self._error(request, ErrorCode.deadline_exceeded, message)


def _headers(record: ConsumerRecord[bytes, bytes]) -> Sequence[tuple[str, bytes]]:
    return list(record.headers or ())


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Hands partition ownership changes to the scheduler, inside the consumer's rebalance."""

    def __init__(self, scheduler: Scheduler, consumer: AIOKafkaConsumer) -> None:
        self._scheduler = scheduler
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._scheduler.release(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._scheduler.take_over(set(assigned))
