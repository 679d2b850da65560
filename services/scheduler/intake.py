"""The scheduler's tier reader: records into admission (admission.py), admitted ones into
the policy's backlog, the rest answered, skipped or dead-lettered, and handed on.

Caller: the scheduler app (`run` as a task for the process's life, on the tier consumer).
It admits under `lock`, which a take-over (ownership.py) holds from its first await to its
end: aiokafka hands out records of a newly assigned partition while its take-over still
reads the batches topic, and such a record must not be admitted before the scan says
whether it was dispatched already.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.scheduler.admission import Admission, Answer, Poison, Queue, Skip, Waiting
from services.scheduler.answers import Answerer
from services.scheduler.cascades import on_route
from services.scheduler.ledger import Ledger
from services.scheduler.pinned import placement
from services.scheduler.policy import Policy
from services.scheduler.settings import SchedulerSettings
from services.scheduler.shadows import shadowed
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.variants import Rollouts
from shared.fetches import Fetched, fetches
from shared.prefixes import prefix_key

log = structlog.get_logger()

FETCH_MS = 100  # longest a reader waits in one fetch, so rebalances and stops are prompt


class TierIntake:
    """Reads the tier partitions this scheduler owns; decides, then carries each out."""

    def __init__(
        self,
        settings: SchedulerSettings,
        ledger: Ledger,
        admission: Admission,
        policy: Policy[Waiting],
        answerer: Answerer,
        telemetry: SchedulerTelemetry,
        hand_on: Callable[[TopicPartition, int], None],
        wake: asyncio.Event,
        rollouts: Rollouts,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.admission = admission
        self.policy = policy
        self.answerer = answerer
        self.telemetry = telemetry
        self._hand_on = hand_on
        self._wake = wake
        self.rollouts = rollouts
        self.lock = asyncio.Lock()

    async def run(self, consumer: AIOKafkaConsumer) -> None:
        lag = self.telemetry.metrics.lag
        async for fetched in fetches(consumer, what="tiers", timeout_ms=FETCH_MS, lag=lag):
            answers: list[Answer] = []
            poisons: list[Poison] = []
            # A take-over in flight finishes its scan first: aiokafka fetches a newly
            # assigned partition while `on_partitions_assigned` still runs.
            async with self.lock:
                fetched = self._owned(consumer, fetched)
                if not fetched:
                    # A paused partition fetches nothing: it resumes here once what held it
                    # back was handed on (answered, dispatched, or moved to the tail).
                    self._pause_far_ahead(consumer)
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
        self.telemetry.arrived(w.request)
        s = self.settings
        # A route's request runs on the model of its cascade step (cascades.py, ADR 0059).
        w, model = on_route(w, w.request.model or s.scheduler_default_model, s.routes)
        request = w.request
        # The conversation's key (its prefix key) picks its variant: the same on every turn
        # and every scheduler while the model's shares stay as they are (ADR 0054); a
        # request that names its variant runs on that one only (pinned.py).
        key = prefix_key(request, request.tenant)
        fallback = request.fallback_model or s.fallback_model(request.tier)
        placed = placement(self.rollouts, model, key, request.variant, fallback)
        variant = placed.variant
        # A sample is also run on the model's gold variant, and scored (shadows.py).
        w = shadowed(w, self.rollouts, model, variant)
        if model is not None:
            self.telemetry.variant_chosen(model, variant)
        self.policy.add(
            w,
            tier=request.tier,
            cost=request.token_cost,
            prompt_tokens=request.prompt_tokens,
            # A request moved to its partition's tail keeps its age (requeue.py).
            now=now if not request.requeued else min(now, request.accepted_at),
            deadline_at=request.deadline_at,
            tenant=request.tenant,
            model=model,
            fallback=placed.fallback,
            prefix=key if self.policy.router.mode == "prefix" else None,
            variant=variant,
            pinned=placed.pinned,
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
