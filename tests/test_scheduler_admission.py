"""services.scheduler.admission: what becomes of each tier record, decided from plain values."""

from __future__ import annotations

import json

from aiokafka import ConsumerRecord, TopicPartition

from services.scheduler.admission import Admission, Answer, Poison, Queue, Skip
from services.scheduler.settings import SchedulerSettings
from shared.kafka import encode
from shared.messages import ErrorCode
from tests.factories import consumer_record, queued_request

TP = TopicPartition("t.requests.interactive", 0)
PARENTS = [
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
]


def record(
    value: bytes, offset: int = 0, headers: tuple[tuple[str, bytes], ...] = ()
) -> ConsumerRecord[bytes, bytes]:
    return consumer_record(TP.topic, value, partition=TP.partition, offset=offset, headers=headers)


def admission() -> Admission:
    return Admission(SchedulerSettings().policy_config())


def test_a_request_is_queued_once_and_a_second_copy_of_its_attempt_is_skipped() -> None:
    a = admission()
    first = a.decide(TP, record(encode(queued_request())), now=101.0)
    assert isinstance(first, Queue)
    assert first.waiting.request.request_id == "r1"
    again = a.decide(TP, record(encode(queued_request()), offset=1), now=101.0)
    assert again == Skip(TP, 1, "r1", "duplicate")
    # The next attempt of the same request is another request.
    assert isinstance(a.decide(TP, record(encode(queued_request(attempt=1)), 2), now=101.0), Queue)


def test_a_request_released_with_its_partition_is_queued_when_read_again() -> None:
    a = admission()
    first = a.decide(TP, record(encode(queued_request())), now=101.0)
    assert isinstance(first, Queue)
    a.released([first.waiting])
    assert isinstance(a.decide(TP, record(encode(queued_request())), now=101.0), Queue)


def test_what_the_last_owner_dispatched_is_skipped_once() -> None:
    a = admission()
    a.dispatched_before([("r1", 0)], now=101.0)
    skipped = a.decide(TP, record(encode(queued_request())), now=101.0)
    assert isinstance(skipped, Skip)
    assert skipped.why == "already_dispatched"


def test_a_request_past_its_deadline_or_above_its_budget_is_answered() -> None:
    a = admission()
    late = a.decide(TP, record(encode(queued_request(deadline_ms=500))), now=101.0)
    assert isinstance(late, Answer)
    assert late.expired
    assert late.error.code is ErrorCode.deadline_exceeded
    big = a.decide(TP, record(encode(queued_request("r2", prompt_tokens=10**7))), now=101.0)
    assert isinstance(big, Answer)
    assert not big.expired
    assert big.error.code is ErrorCode.invalid_request


def test_a_record_that_is_not_a_request_is_poison_answered_where_it_can_be() -> None:
    a = admission()
    bad = {"request_id": "r1", "reply_to": {"topic": "t.results"}, "tier": "nope"}
    poison = a.decide(TP, record(json.dumps(bad).encode()), now=101.0)
    assert isinstance(poison, Poison)
    assert poison.address is not None
    assert poison.address.request_id == "r1"
    garbage = a.decide(TP, record(b"\xff"), now=101.0)
    assert isinstance(garbage, Poison)
    assert garbage.address is None


def test_the_records_trace_headers_win_and_a_handed_back_request_keeps_its_own() -> None:
    a = admission()
    carried = queued_request(trace={"traceparent": PARENTS[0]})
    kept = a.decide(TP, record(encode(carried)), now=101.0)
    assert isinstance(kept, Queue)
    assert kept.waiting.request.trace == {"traceparent": PARENTS[0]}
    headers = (("traceparent", PARENTS[1].encode()),)
    won = a.decide(
        TP, record(encode(queued_request("r2", trace=carried.trace)), 1, headers), now=101.0
    )
    assert isinstance(won, Queue)
    assert won.waiting.request.trace == {"traceparent": PARENTS[1]}


def moved(offset: int, requeued: int) -> ConsumerRecord[bytes, bytes]:
    """The record at `offset` of request r1, moved to the tail `requeued` times."""
    return record(encode(queued_request().model_copy(update={"requeued": requeued})), offset)


def test_a_request_moved_to_the_tail_is_let_in_under_its_next_count_once() -> None:
    """Issue 37, N3 (requeue.py): the copy a scheduler wrote is the request moved on."""
    a = admission()
    first = a.decide(TP, moved(0, 0), now=101.0)
    assert isinstance(first, Queue)
    a.moved(first.waiting)
    copy = a.decide(TP, moved(9000, 1), now=102.0)
    assert isinstance(copy, Queue)
    assert copy.waiting.request.requeued == 1
    assert a.decide(TP, moved(9001, 1), now=102.0) == Skip(TP, 9001, "r1", "duplicate")


def test_a_copy_left_by_a_crash_beside_the_record_it_copied_runs_once() -> None:
    """The scheduler stored the copy and crashed before its commit handed the record on:
    its successor reads both, and only the first runs (it is moved again later)."""
    a = admission()
    assert isinstance(a.decide(TP, moved(0, 0), now=101.0), Queue)
    assert a.decide(TP, moved(9000, 1), now=101.0) == Skip(TP, 9000, "r1", "duplicate")


def test_a_copy_whose_record_was_handed_on_before_a_take_over_is_let_in() -> None:
    """The commit handed the record on: the successor skips it by the ledger, finds it in
    the partition's history (tier_history.py), and still runs the copy; a second copy of
    the same count (a hand-back redone) is dropped as before."""
    a = admission()
    a.remember({TP: [("r1", 0, 0)]})
    assert isinstance(a.decide(TP, moved(9000, 1), now=101.0), Queue)
    b = admission()
    b.remember({TP: [("r1", 0, 1)]})
    assert b.decide(TP, moved(9000, 1), now=101.0) == Skip(TP, 9000, "r1", "duplicate")
