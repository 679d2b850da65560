"""Ownership of tier partitions: what a scheduler does when the group gives or takes one.

Called by the tier consumer's rebalance listener (shared/rebalance.py), inside the
rebalance. A take-over restores the ledger from the committed metadata and learns from the
batches topic what was already dispatched (ADR 0011), before any record of the partition
is admitted (it holds the intake's lock). A release drops the partitions' waiting requests
and commits what was handed on of them (it holds the step's lock).
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from services.scheduler import tier_history
from services.scheduler.batch_log import BatchLog
from services.scheduler.intake import TierIntake
from services.scheduler.settings import SchedulerSettings
from services.scheduler.steps import Steps
from shared.retry import retrying
from shared.topics import Topics

log = structlog.get_logger()

KAFKA_ERRORS = (KafkaError, TimeoutError)
# Each try of a take-over step is cut after this long and started over: a read that waits
# for an end offset it cannot reach (a node back from a hang) otherwise holds the tier
# partitions unscheduled for good (chaos seed 325070550: no assignment for 2 minutes).
TAKE_OVER_ATTEMPT_S = 30.0


class Ownership:
    """Takes tier partitions over and gives them up; the ledger's and admission's memory."""

    def __init__(
        self,
        settings: SchedulerSettings,
        admin: AIOKafkaAdminClient,
        intake: TierIntake,
        steps: Steps,
        batch_log: BatchLog,
        log_lock: asyncio.Lock,
    ) -> None:
        """`log_lock`: the batch log reader's (one reader at a time)."""
        self.settings = settings
        self._admin = admin
        self._group = f"{settings.topic_prefix}.scheduler"
        self._batches_topic = Topics(settings.topic_prefix).batches
        self.ledger = intake.ledger
        self.admission = intake.admission
        self.policy = intake.policy
        self.telemetry = intake.telemetry
        self.batch_log = batch_log
        self._start_ends = steps.start_ends
        self._intake_lock, self._step_lock, self._log_lock = intake.lock, steps.lock, log_lock
        self._commit = steps.commit

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
                self._group, partitions=sorted(assigned)
            ),
            within_s=None,
            what="tier_offsets",
            retry_on=KAFKA_ERRORS,
            attempt_s=TAKE_OVER_ATTEMPT_S,
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
        topic = self._batches_topic
        async with self._log_lock:
            logged = await retrying(
                lambda: self.batch_log.read(
                    {TopicPartition(topic, p): offset for p, offset in starts.items()}
                ),
                within_s=None,
                what="batch_log",
                retry_on=KAFKA_ERRORS,
                attempt_s=TAKE_OVER_ATTEMPT_S,
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
            retry_on=KAFKA_ERRORS,
            attempt_s=TAKE_OVER_ATTEMPT_S,
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
