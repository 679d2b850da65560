"""The scheduler process: tier topics in, batches addressed to workers out, restart-safe commits.

Tasks on one event loop: the tier reader (intake.py: records into admission, admitted
ones into the policy), the heartbeat reader (heartbeats.py), the steps (steps.py: run the
policy, carry out its plan through dispatch.py, commit), the liveness watch (liveness.py:
declares workers dead; the owner of interactive partition 0 hands their requests back),
the variants reader (variants.py: each model's rollout, read before the first request),
the canary judge (rollback.py). Rebalances: ownership.py; Kafka clients: clients.py.

Nothing read stops the flow: a tier record or heartbeat that cannot be handled is
dead-lettered (a request answered with `invalid_request` where its `reply_to` can be
read) and skipped (answers.py). Kafka errors (a broker outage) are retried with backoff: a
batch is sent until stored, an error answer for a bounded time and then dead-lettered,
commits and fetches again at the next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from services.scheduler.admission import Admission, Waiting
from services.scheduler.answers import Answerer
from services.scheduler.batch_log import BatchLog
from services.scheduler.clients import Clients
from services.scheduler.dispatch import Dispatcher
from services.scheduler.heartbeats import HeartbeatReader
from services.scheduler.intake import TierIntake
from services.scheduler.ledger import Ledger
from services.scheduler.liveness import Liveness
from services.scheduler.models import ModelCheck
from services.scheduler.ownership import Ownership
from services.scheduler.policy import Policy
from services.scheduler.recovery import Recovery
from services.scheduler.requeue import Requeue
from services.scheduler.rollback import CanaryJudge
from services.scheduler.settings import SchedulerSettings
from services.scheduler.steps import Steps
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.variants import RolloutReader, Rollouts
from services.scheduler.workers import WorkerRegistry
from shared.health import Readiness, Ready, consumer_readiness
from shared.kafka import topic_partitions
from shared.messages import Tier
from shared.process import for_life
from shared.rebalance import Rebalance
from shared.retry import retrying
from shared.topics import Topics

log = structlog.get_logger()


async def serve(
    settings: SchedulerSettings, built: Callable[[Ready], None] = lambda _: None
) -> None:
    """Build the clients, run the scheduler until cancelled (SIGTERM/SIGINT); `built` is
    shown the scheduler before it runs (its readiness is what `/readyz` answers)."""
    async with Clients.make(settings).started() as clients:
        scheduler = Scheduler(settings, clients)
        built(scheduler)
        await scheduler.run()


class Scheduler:
    """The wiring: its parts share the ledger, the backlog and one clock."""

    def __init__(self, settings: SchedulerSettings, clients: Clients) -> None:
        s = self.settings = settings
        self.clients = clients
        self.topics = topics = Topics(s.topic_prefix)
        policy: Policy[Waiting] = Policy(s.policy_config(), s.departure_rule(), s.router())
        admission = Admission(policy.config, s.default_max_tokens)
        ledger = Ledger()
        self.workers = workers = WorkerRegistry(s.scheduler_worker_missed_beats)
        sizes = {
            Tier.interactive: s.scheduler_interactive_max_batch_size,
            Tier.background: s.scheduler_background_max_batch_size,
        }
        telemetry = SchedulerTelemetry(topics.batches, sizes)
        answerer = Answerer(s, topics, clients.producer)
        dispatcher = Dispatcher(topics.batches, clients.producer, telemetry, workers)
        self.batch_log = batch_log = BatchLog(clients.log_reader)
        wake = asyncio.Event()
        log_lock = asyncio.Lock()  # the batch log consumer has one reader at a time
        requeue = Requeue(
            policy,
            ledger,
            admission,
            clients.producer,
            s.scheduler_max_open_offsets,
            s.scheduler_requeue_after_s,
        )
        steps = Steps(
            s,
            policy,
            workers,
            ledger,
            dispatcher,
            answerer,
            telemetry,
            clients.tiers,
            wake,
            requeue,
        )
        self.steps, self._start_ends = steps, steps.start_ends
        rollouts = Rollouts()
        self.rollouts = RolloutReader(
            clients.variants, rollouts, clients.admin, topics.variants, telemetry.shares
        )
        self._dead_letter = answerer.dead_letter
        self.canaries = CanaryJudge(s, rollouts, clients.producer, clients.scores)  # rollback.py
        self.intake = TierIntake(
            s, ledger, admission, policy, answerer, telemetry, steps.hand_on, wake, rollouts
        )
        self.ownership = Ownership(s, clients.admin, self.intake, self.steps, batch_log, log_lock)
        beats = (clients.beats, workers, answerer, lambda: set(self._start_ends), topics.batches)
        self.heartbeats = HeartbeatReader(*beats, wake, self.canaries.beat)
        recovery = Recovery(s, clients.admin, batch_log, clients.producer, log_lock)
        grace_s = s.scheduler_recovery_grace_ms / 1000.0
        self.liveness = Liveness(grace_s, workers, recovery, self.leads_recovery, wake)

    async def run(self) -> None:
        s, tiers = self.settings, self.clients.tiers
        # Retried until the broker answers (one just started may be slow to).
        await retrying(
            self._start, within_s=None, what="start", retry_on=(KafkaError, TimeoutError)
        )
        own = self.ownership
        tiers.subscribe(
            list(self.topics.tiers), listener=Rebalance(revoked=own.release, assigned=own.take_over)
        )
        await tiers.start()
        log.info("scheduler.started", scheduler_id=s.scheduler_id, policy=s.scheduler_policy)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(for_life("tier reader", self.intake.run(tiers)))
            tg.create_task(for_life("heartbeat reader", self.heartbeats.run()))
            tg.create_task(for_life("steps", self.steps.run()))
            tg.create_task(for_life("liveness", self.liveness.run()))
            tg.create_task(for_life("variants reader", self.rollouts.run(self._dead_letter)))
            tg.create_task(for_life("canary judge", self.canaries.run()))

    async def _start(self) -> None:
        parts = await self._partitions(self.topics.batches)
        ends = await self.batch_log.end_offsets(parts)
        # Whatever we produce will land at or after today's end of each batches partition.
        self._start_ends.clear()
        self._start_ends.update({tp.partition: end for tp, end in ends.items()})
        await self.heartbeats.seek_recent(await self._partitions(self.topics.workers))
        self.steps.model_check = ModelCheck(time.time(), self.steps.model_check.grace_s)
        # Every rollout before the first request: a restart routes as it did before.
        await self.rollouts.load()

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): tier partitions assigned, broker answering."""
        return await consumer_readiness([self.clients.tiers])

    async def _partitions(self, topic: str) -> list[TopicPartition]:
        """The topic's partitions as the cluster has them (the project's count if unknown)."""
        return await topic_partitions(self.clients.admin, topic, self.topics.partitions()[topic])

    def leads_recovery(self) -> bool:
        tp = TopicPartition(self.topics.tier(Tier.interactive), 0)
        return tp in self.clients.tiers.assignment()
