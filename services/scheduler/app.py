"""The scheduler process: tier topics in, batches addressed to workers out, restart-safe commits.

Four tasks share one event loop: the tier reader (records into admission, admitted ones
into the policy), the heartbeat reader (heartbeats.py), the stepper (runs the policy and
carries out its plan through dispatch.py) and the liveness watch (liveness.py: declares
workers dead and, on the one scheduler that owns interactive partition 0, hands their
unfinished requests back).

Nothing read stops the flow: a tier record or heartbeat that cannot be handled is
dead-lettered (a request answered with `invalid_request` where its `reply_to` can be
read) and skipped (answers.py). Kafka errors (a broker outage) are retried with backoff: a
batch is sent until stored, an error answer for a bounded time and then dead-lettered,
commits and fetches again at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord

from services.scheduler import tier_history
from services.scheduler.admission import (
    Admission,
    Answer,
    Poison,
    Queue,
    Skip,
    Waiting,
    deadline_error,
)
from services.scheduler.answers import Answerer
from services.scheduler.batch_log import BatchLog
from services.scheduler.dispatch import Dispatcher
from services.scheduler.heartbeats import HeartbeatReader
from services.scheduler.ledger import Ledger
from services.scheduler.liveness import Liveness
from services.scheduler.models import ModelCheck
from services.scheduler.policy import Plan, Policy
from services.scheduler.recovery import Recovery
from services.scheduler.settings import SchedulerSettings
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.workers import WorkerRegistry
from shared.fetches import fetches
from shared.health import Readiness, consumer_readiness
from shared.kafka import LONG_POLL_MS, make_admin, make_consumer, make_producer
from shared.messages import ErrorCode, ErrorResult, Tier, unknown_model_message
from shared.prefixes import prefix_key
from shared.process import for_life
from shared.producers import RenewingProducer
from shared.rebalance import Rebalance
from shared.retry import retrying
from shared.topics import Topics

log = structlog.get_logger()

FETCH_MS = 100  # longest a reader waits in one fetch, so rebalances and stops are prompt
LONGEST_SLEEP_S = 1.0  # the stepper re-plans at least this often

Fetched = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]


@dataclass(frozen=True)
class Clients:
    """The scheduler's Kafka clients, built from its settings; `started()` runs them."""

    producer: RenewingProducer
    tiers: AIOKafkaConsumer  # the group's tier topics: requests
    beats: AIOKafkaConsumer  # heartbeats, assigned
    log_reader: AIOKafkaConsumer  # the batches topic, read at take-over and recovery
    admin: AIOKafkaAdminClient

    @classmethod
    def make(cls, s: SchedulerSettings) -> Clients:
        client_id = f"scheduler-{s.scheduler_id}"
        # A configured id is a stable identity: static membership lets a restarted process
        # take its partitions back at once instead of after the session timeout.
        static_id = s.scheduler_id if "scheduler_id" in s.model_fields_set else None
        return cls(
            # Renewed if an outage breaks its sequence numbers (shared/producers.py).
            producer=RenewingProducer(lambda: make_producer(s, client_id=client_id)),
            tiers=make_consumer(
                s,
                group_id=f"{s.topic_prefix}.scheduler",
                client_id=client_id,
                # Hand-backs of a recovery that aborted must stay invisible.
                isolation_level="read_committed",
                group_instance_id=static_id,
                fetch_max_wait_ms=LONG_POLL_MS,
            ),
            beats=make_consumer(
                s,
                group_id=None,
                client_id=f"{client_id}-beats",
                auto_offset_reset="latest",
                fetch_max_wait_ms=LONG_POLL_MS,
            ),
            log_reader=make_consumer(s, group_id=None, client_id=f"{client_id}-log"),
            admin=make_admin(s, client_id=client_id),
        )

    @contextlib.asynccontextmanager
    async def started(self) -> AsyncIterator[Clients]:
        """All but the tier consumer, started (it starts once the scheduler has subscribed)."""
        async with contextlib.AsyncExitStack() as stack:
            await self.producer.start()
            stack.push_async_callback(self.producer.stop)
            await self.admin.start()
            stack.push_async_callback(self.admin.close)
            for consumer in (self.log_reader, self.beats):
                await consumer.start()
                stack.push_async_callback(consumer.stop)
            stack.push_async_callback(self.tiers.stop)
            yield self


async def serve(
    settings: SchedulerSettings, built: Callable[[Scheduler], None] = lambda scheduler: None
) -> None:
    """Build the clients, run the scheduler until cancelled (SIGTERM/SIGINT); `built` is
    shown the scheduler before it runs (its readiness is what `/readyz` answers)."""
    async with Clients.make(settings).started() as clients:
        scheduler = Scheduler(settings, clients)
        built(scheduler)
        await scheduler.run()


class Scheduler:
    """Owner of the tier consumer, the ledger and the backlog; the parts share its clock."""

    def __init__(self, settings: SchedulerSettings, clients: Clients) -> None:
        s = settings
        self.settings = s
        self.clients = clients
        self.topics = Topics(s.topic_prefix)
        self.group = f"{s.topic_prefix}.scheduler"
        self.policy: Policy[Waiting] = Policy(s.policy_config(), s.departure_rule(), s.router())
        self.admission = Admission(self.policy.config, s.default_max_tokens)
        self.ledger = Ledger()
        self.workers = WorkerRegistry(s.scheduler_worker_missed_beats)
        # Refuses nothing as unknown until heartbeats have been read a while (set at start).
        self.model_check = ModelCheck(time.time(), s.scheduler_unknown_model_after_ms / 1000.0)
        self.telemetry = SchedulerTelemetry(
            self.topics.batches,
            {
                Tier.interactive: s.scheduler_interactive_max_batch_size,
                Tier.background: s.scheduler_background_max_batch_size,
            },
        )
        self.answerer = Answerer(s, self.topics, clients.producer)
        self.dispatcher = Dispatcher(
            self.topics.batches, clients.producer, self.telemetry, self.workers
        )
        self.batch_log = BatchLog(clients.log_reader)
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
        self._start_ends: dict[int, int] = {}  # batches partition -> end when we started
        self.heartbeats = HeartbeatReader(
            clients.beats,
            self.workers,
            self.answerer,
            lambda: set(self._start_ends),
            self.topics.batches,
            self._wake,
        )
        self.liveness = Liveness(
            s.scheduler_recovery_grace_ms / 1000.0,
            self.workers,
            Recovery(s, clients.admin, self.batch_log, clients.producer, self._log_lock),
            self.leads_recovery,
            self._wake,
        )
        self._last_commit = 0.0
        self._commit_interval = s.scheduler_commit_interval_ms / 1000.0
        self._handed_on = False  # something was handed on since the last commit

    async def run(self) -> None:
        s, tiers = self.settings, self.clients.tiers
        # Retried until the broker answers (one just started may be slow to).
        await retrying(
            self._start, within_s=None, what="start", retry_on=(KafkaError, TimeoutError)
        )
        tiers.subscribe(
            list(self.topics.tiers),
            listener=Rebalance(revoked=self.release, assigned=self.take_over),
        )
        await tiers.start()
        log.info("scheduler.started", scheduler_id=s.scheduler_id, policy=s.scheduler_policy)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(for_life("tier reader", self._read_tiers(tiers)))
            tg.create_task(for_life("heartbeat reader", self.heartbeats.run()))
            tg.create_task(for_life("steps", self._steps()))
            tg.create_task(for_life("liveness", self.liveness.run()))

    async def _start(self) -> None:
        parts = await self._partitions(self.topics.batches)
        ends = await self.batch_log.end_offsets(parts)
        # Whatever we produce will land at or after today's end of each batches partition.
        self._start_ends = {tp.partition: end for tp, end in ends.items()}
        await self.heartbeats.seek_recent(await self._partitions(self.topics.workers))
        self.model_check = ModelCheck(time.time(), self.model_check.grace_s)

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): tier partitions assigned, broker answering."""
        return await consumer_readiness([self.clients.tiers])

    async def _partitions(self, topic: str) -> list[TopicPartition]:
        """The topic's partitions as the cluster has them (the project's count if unknown)."""
        described = await self.clients.admin.describe_topics([topic])
        count = len(described[0]["partitions"]) if described else 0
        count = count or self.topics.partitions()[topic]
        return [TopicPartition(topic, p) for p in range(count)]

    # -- intake ------------------------------------------------------------------------------

    async def _read_tiers(self, consumer: AIOKafkaConsumer) -> None:
        lag = self.telemetry.metrics.lag
        async for fetched in fetches(consumer, what="tiers", timeout_ms=FETCH_MS, lag=lag):
            answers: list[Answer] = []
            poisons: list[Poison] = []
            # A take-over in flight finishes its scan first: aiokafka fetches a newly
            # assigned partition while `on_partitions_assigned` still runs.
            async with self._intake_lock:
                fetched = self._owned(consumer, fetched)
                if not fetched:
                    continue
                now = time.time()
                for tp, records in fetched.items():
                    for record in records:
                        if not self.ledger.read(tp, record.offset):
                            continue  # handed on before a restart or rebalance
                        # 1) Decide.
                        decision = self.admission.decide(tp, record, now)
                        # 2) Carry it out.
                        if isinstance(decision, Queue):
                            self._queue(decision.waiting, now)
                        elif isinstance(decision, Answer):
                            answers.append(decision)
                        elif isinstance(decision, Skip):
                            # request.duplicate | request.already_dispatched
                            log.info(f"request.{decision.why}", request_id=decision.request_id)
                            self._hand_on(tp, record.offset)
                        else:
                            log.error(
                                "tier_record.invalid",
                                topic=tp.topic,
                                offset=record.offset,
                                error=decision.reason,
                            )
                            poisons.append(decision)
            for poison in poisons:
                await self.answerer.reject(poison)
                self._hand_on(poison.tp, poison.record.offset)
            for answer in answers:
                if answer.expired:
                    self.telemetry.expired(answer.waiting.request)
                await self.answerer.answer(answer.waiting, answer.error)
                self._hand_on(answer.waiting.tp, answer.waiting.offset)
            self._pause_far_ahead(consumer)
            self._wake.set()

    def _queue(self, w: Waiting, now: float) -> None:
        request = w.request
        self.telemetry.arrived(request)
        s = self.settings
        self.policy.add(
            w,
            tier=request.tier,
            cost=request.token_cost,
            prompt_tokens=request.prompt_tokens,
            now=now,
            deadline_at=request.deadline_at,
            tenant=request.tenant,
            model=request.model or s.scheduler_default_model,
            fallback=request.fallback_model or s.fallback_model(request.tier),
            prefix=(
                prefix_key(request, request.tenant) if self.policy.router.mode == "prefix" else None
            ),
        )

    def _owned(self, consumer: AIOKafkaConsumer, fetched: Fetched) -> Fetched:
        """The fetched records this scheduler may admit now.

        Records of a partition revoked meanwhile belong to its new owner. Records of one
        assigned but not yet taken over (its ledger not restored) are fetched again later:
        dropped, they would be lost (the consumer's position has moved past them).
        """
        assigned = consumer.assignment()
        out: Fetched = {}
        for tp, records in fetched.items():
            if tp not in assigned or not records:
                continue
            if not self.ledger.owns(tp):
                log.info("tier_records.refetch", topic=tp.topic, partition=tp.partition)
                consumer.seek(tp, records[0].offset)
                continue
            out[tp] = records
        return out

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

    def _hand_on(self, tp: TopicPartition, offset: int) -> None:
        self.ledger.handed_on(tp, offset)
        self._handed_on = True

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
                # 1) Plan (after refusing what waits for a model nobody serves).
                refused = self._unknown_models(now)
                plan = self.policy.plan(now, self.workers.slots(now))
                self._wake_at = plan.wake_at
                # 2) Carry it out; 3) commit what it handed on.
                await self._carry_out(plan, now)
                for w, error in refused:
                    await self.answerer.answer(w, error)
                    self._hand_on(w.tp, w.offset)
                await self._commit()

    def _unknown_models(self, now: float) -> list[tuple[Waiting, ErrorResult]]:
        """Take out every waiting request whose model no known worker serves, with its error."""
        known = self.workers.models()
        backlog = self.policy.backlog
        out: list[tuple[Waiting, ErrorResult]] = []
        for key, lane in list(backlog.lanes.items()):
            model = key.model
            if model is None or not len(lane) or not self.model_check.unknown(model, known, now):
                continue
            message = unknown_model_message(model, known)
            for p in list(lane):
                backlog.remove(p)
                self.telemetry.refused(p.item.request)
                log.info("request.unknown_model", request_id=p.item.request.request_id, model=model)
                error = ErrorResult.for_request(p.item.request, ErrorCode.invalid_request, message)
                out.append((p.item, error))
        return out

    async def _carry_out(self, plan: Plan[Waiting], now: float) -> None:
        for p in plan.fell_back:
            request = p.item.request
            self.telemetry.fell_back(request, p.model or "")
            log.info(
                "request.fell_back", request_id=request.request_id, model=request.model, to=p.model
            )
        for out in await self.dispatcher.dispatch(plan.dispatches, now):
            for p in out.dispatch.passengers:
                self._hand_on(p.item.tp, p.item.offset)
        for p in plan.expired:
            w = p.item
            self.telemetry.expired(w.request)
            await self.answerer.answer(w, deadline_error(w.request))
            self._hand_on(w.tp, w.offset)

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
            await self.clients.tiers.commit(entries)
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
        produced = self.dispatcher.last_produced
        return {
            partition: max(start_end, consumed.get(partition, 0), produced.get(partition, -1) + 1)
            for partition, start_end in self._start_ends.items()
        }

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
            lambda: self.clients.admin.list_consumer_group_offsets(
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
                lambda: self.batch_log.read(
                    {TopicPartition(topic, p): offset for p, offset in starts.items()}
                ),
                within_s=None,
                what="batch_log",
                retry_on=(KafkaError, TimeoutError),
            )
        self.admission.dispatched_before(
            ((r.request_id, r.attempt) for entry_ in logged for r in entry_.batch.requests),
            time.time(),
        )
        # What these partitions held just before the commit: a copy of a hand-back read
        # after it is dropped as the process that handed the first on would have.
        offsets = {tp: e.offset for tp, e in committed.items() if tp in assigned and e.offset > 0}
        recent = await retrying(
            lambda: tier_history.recent_keys(
                self.settings, offsets, client_id=f"scheduler-{self.settings.scheduler_id}-seen"
            ),
            within_s=None,
            what="tier_history",
            retry_on=(KafkaError, TimeoutError),
        )
        self.admission.remember(recent)
        log.info(
            "tier_partitions.assigned",
            partitions=sorted(f"{tp.topic}/{tp.partition}" for tp in assigned),
            batches_scanned=len(logged),
            seen_restored=sum(len(keys) for keys in recent.values()),
        )

    async def release(self, revoked: set[TopicPartition]) -> None:
        """Stop scheduling revoked partitions' requests; commit what we handed on of them."""
        if not revoked:
            return
        async with self._step_lock:
            dropped = self.policy.backlog.remove_where(lambda w: w.tp in revoked)
            for p in dropped:
                self.telemetry.released(p.item.request)
            # Not handed on: their new owner (maybe us again) reads them anew.
            self.admission.released(p.item for p in dropped)
            await self._commit(only=revoked)
            self.ledger.forget(revoked)
        log.info(
            "tier_partitions.revoked",
            partitions=sorted(f"{tp.topic}/{tp.partition}" for tp in revoked),
            dropped=len(dropped),
        )

    def leads_recovery(self) -> bool:
        tp = TopicPartition(self.topics.tier(Tier.interactive), 0)
        return tp in self.clients.tiers.assignment()
