"""The steps loop never holds the event loop (finding 16).

After a rebalance whose revoke commit failed (the group had already moved on), the ledger
forgot the revoked partitions with a hand-on still flagged. Each step then found a commit
due at once and nothing to commit, planned nothing, and awaited nothing: the loop spun
without yielding, so no rebalance, heartbeat or read ran again, and the only scheduler
dispatched nothing until it was killed. Here the steps run on their own event loop in a
thread, so a loop that spins fails the test instead of hanging it.

Fakes: the tier consumer (`FakeTiers`, whose commits fail as under a rebalance) and the
producer (`FakeProducer`, never reached: nothing is dispatched). The rest is the
scheduler's own.
"""

from __future__ import annotations

import asyncio
import threading
import time

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError
from prometheus_client import CollectorRegistry

from services.scheduler.admission import Admission, Waiting
from services.scheduler.answers import Answerer
from services.scheduler.dispatch import Dispatcher
from services.scheduler.ledger import Ledger
from services.scheduler.policy import Policy
from services.scheduler.requeue import Requeue
from services.scheduler.settings import SchedulerSettings
from services.scheduler.steps import Steps
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.workers import WorkerRegistry
from shared.messages import Tier
from shared.metrics import SchedulerMetrics
from shared.topics import Topics

PREFIX = "tb"
TIER = TopicPartition(f"{PREFIX}.requests.interactive", 0)


class FakeTiers:
    """The tier consumer's commit, failing as it does once the group rebalanced."""

    def __init__(self) -> None:
        self.commits = 0

    async def commit(self, offsets: object) -> None:
        self.commits += 1
        raise CommitFailedError("the group has already rebalanced")


class FakeProducer:
    """Never used: these steps dispatch nothing."""


def steps(tiers: FakeTiers) -> Steps:
    s = SchedulerSettings(topic_prefix=PREFIX, scheduler_id="s1")
    policy: Policy[Waiting] = Policy(s.policy_config(), s.departure_rule(), s.router())
    workers = WorkerRegistry(s.scheduler_worker_missed_beats)
    telemetry = SchedulerTelemetry(
        Topics(PREFIX).batches,
        {Tier.interactive: 4, Tier.background: 4},
        metrics=SchedulerMetrics.build(CollectorRegistry()),
    )
    producer = FakeProducer()
    dispatcher = Dispatcher(Topics(PREFIX).batches, producer, telemetry, workers)  # type: ignore[arg-type]
    answerer = Answerer(s, Topics(PREFIX), producer)  # type: ignore[arg-type]
    ledger = Ledger()
    admission = Admission(policy.config)
    limit, after_s = s.scheduler_max_open_offsets, s.scheduler_requeue_after_s
    requeue = Requeue(policy, ledger, admission, producer, limit, after_s)  # type: ignore[arg-type]
    return Steps(
        s,
        policy,
        workers,
        ledger,
        dispatcher,
        answerer,
        telemetry,
        tiers,
        asyncio.Event(),
        requeue,
    )


def test_a_failed_revoke_commit_does_not_leave_the_steps_spinning() -> None:
    tiers = FakeTiers()
    ran: list[float] = []

    async def scenario() -> None:
        st = steps(tiers)
        # A record read and handed on, then the partition revoked: the revoke's commit
        # fails (the group moved on) and the ledger forgets the partition.
        st.ledger.restore(TIER, 0, "")
        st.ledger.read(TIER, 0)
        st.hand_on(TIER, 0)
        await st.commit(only={TIER})
        st.ledger.forget({TIER})
        task = asyncio.create_task(st.run())
        try:
            # Another task of the process (a heartbeat, a rebalance) gets its turns.
            for _ in range(5):
                await asyncio.sleep(0.05)
                ran.append(time.monotonic())
        finally:
            task.cancel()

    thread = threading.Thread(target=asyncio.run, args=(scenario(),), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the steps loop held the event loop"
    assert len(ran) == 5
    assert tiers.commits == 1  # the failed revoke commit; nothing was left to commit after
