"""services.scheduler.requeue: a request held far behind its partition's reading moves to
the tail, and the partition's commit position moves past it (issue 37, N3).

Plain values and a fake producer (it stores what it is sent, at the next offset); the
real stack's attack is `tests/security/test_held_record.py`.
"""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import RecordMetadata

from services.scheduler.admission import Admission, Queue, Waiting
from services.scheduler.ledger import Ledger
from services.scheduler.policy import Policy
from services.scheduler.requeue import Requeue
from services.scheduler.settings import SchedulerSettings
from shared.kafka import encode
from shared.messages import QueuedRequest
from tests.factories import consumer_record, queued_request

TP = TopicPartition("t.requests.interactive", 0)
LIMIT, AFTER_S = 64, 30.0
NOW = 1000.0


class FakeProducer:
    """Stores each record sent at the partition's next offset; fails the first `fail`."""

    def __init__(self, next_offset: int, fail: int = 0) -> None:
        self.sent: list[tuple[str, int, bytes]] = []
        self.next_offset, self.fail = next_offset, fail

    async def send_and_wait(
        self, topic: str, value: bytes, key: bytes | None = None, partition: int = 0
    ) -> RecordMetadata:
        if self.fail:
            self.fail -= 1
            raise KafkaTimeoutError("fake: not stored")
        self.sent.append((topic, partition, value))
        offset, self.next_offset = self.next_offset, self.next_offset + 1
        return RecordMetadata(topic, partition, TP, offset, -1, 0, -1)


class Scheduler:
    """The parts a requeue touches, wired as the scheduler app wires them."""

    def __init__(self, producer: FakeProducer) -> None:
        s = SchedulerSettings()
        self.policy: Policy[Waiting] = Policy(s.policy_config())
        self.ledger = Ledger()
        self.ledger.restore(TP, None, "")
        self.admission = Admission(self.policy.config)
        self.producer = producer
        self.requeue = Requeue(
            self.policy,
            self.ledger,
            self.admission,
            producer,  # type: ignore[arg-type]
            LIMIT,
            AFTER_S,
        )

    def read(self, request: QueuedRequest, offset: int, now: float) -> bool:
        """Read one tier record as the intake does: True if it was queued."""
        assert self.ledger.read(TP, offset)
        decision = self.admission.decide(
            TP, consumer_record(TP.topic, encode(request), offset=offset), now
        )
        if not isinstance(decision, Queue):
            self.ledger.handed_on(TP, offset)
            return False
        w = decision.waiting
        self.policy.add(
            w,
            tier=w.request.tier,
            cost=w.request.token_cost,
            prompt_tokens=w.request.prompt_tokens,
            now=now,
            model="ghost-model",  # no worker: it waits
        )
        return True

    def others(self, first: int, count: int) -> None:
        """`count` records of other requests, each handed on at once (dispatched)."""
        for offset in range(first, first + count):
            self.ledger.read(TP, offset)
            self.ledger.handed_on(TP, offset)


def test_a_request_held_far_behind_moves_to_the_tail_and_the_commit_moves_past_it() -> None:
    held = queued_request("held")
    sched = Scheduler(FakeProducer(next_offset=LIMIT))
    assert sched.read(held, 0, NOW)
    sched.others(1, LIMIT - 1)
    assert sched.ledger.span(TP) == LIMIT  # before: the partition pauses here, for everyone

    # Not yet: it has not waited long enough.
    assert asyncio.run(sched.requeue.step(NOW + AFTER_S - 1)) == []
    moved = asyncio.run(sched.requeue.step(NOW + AFTER_S))
    assert [w.offset for w in moved] == [0]
    for w in moved:
        sched.ledger.handed_on(w.tp, w.offset)
    assert sched.ledger.committable({})[TP][0] == LIMIT  # past it, and past the others
    assert len(sched.policy.backlog) == 0
    [(topic, partition, value)] = sched.producer.sent
    copy = QueuedRequest.model_validate_json(value)
    assert (topic, partition) == (TP.topic, TP.partition)
    assert copy == held.model_copy(update={"requeued": 1})  # the same request, moved

    # Read back at the tail: queued again (its creation time kept), once.
    assert sched.read(copy, LIMIT, NOW + AFTER_S + 1)
    assert not sched.read(copy, LIMIT + 1, NOW + AFTER_S + 1)


def test_a_request_near_the_reading_or_on_a_quiet_partition_stays() -> None:
    sched = Scheduler(FakeProducer(next_offset=LIMIT))
    assert sched.read(queued_request("held"), 0, NOW)
    sched.others(1, LIMIT // 2 - 1)  # half the limit behind: not far enough
    assert asyncio.run(sched.requeue.step(NOW + 10 * AFTER_S)) == []
    assert sched.producer.sent == []


def test_a_copy_not_stored_at_first_is_sent_again_until_it_is() -> None:
    sched = Scheduler(FakeProducer(next_offset=LIMIT, fail=1))
    assert sched.read(queued_request("held"), 0, NOW)
    sched.others(1, LIMIT)
    moved = asyncio.run(sched.requeue.step(NOW + AFTER_S))
    assert [w.offset for w in moved] == [0]
    assert len(sched.producer.sent) == 1
