"""Where the edge writes a new request while a broker node is away (services/edge/leaders.py)."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner

from services.edge.leaders import Leaders, keyed_partition

LEADERS = {0: 1, 1: 2, 2: 3, 3: 1}  # partition -> leader node


def test_the_keyed_partition_is_the_kafka_clients_own() -> None:
    partitioner = DefaultPartitioner()
    for i in range(200):
        key = f"request-{i}".encode()
        assert keyed_partition(key, 4) == partitioner(key, [0, 1, 2, 3], [0, 1, 2, 3])


def test_with_every_leader_answering_a_request_keeps_its_keyed_partition() -> None:
    leaders = Leaders(avoid_s=10)
    for i in range(100):
        key = f"r{i}".encode()
        assert leaders.choose(key, LEADERS, now=0) == keyed_partition(key, 4)


def test_a_node_whose_write_waited_is_avoided_until_it_answers_or_the_time_is_out() -> None:
    leaders = Leaders(avoid_s=10)
    assert leaders.waited(1, now=100)  # avoided from now: said once
    assert not leaders.waited(1, now=100.5)
    assert not leaders.waited(None, now=100.5)
    chosen = {leaders.choose(f"r{i}".encode(), LEADERS, now=101) for i in range(200)}
    assert chosen == {1, 2}  # partitions 0 and 3 are led by node 1
    # Spread over the good ones by the same hash: every request id keeps its place.
    assert leaders.choose(b"r7", LEADERS, now=101) == leaders.choose(b"r7", LEADERS, now=105)
    assert 0 in {leaders.choose(f"r{i}".encode(), LEADERS, now=111) for i in range(200)}
    leaders.waited(1, now=120)
    leaders.landed(1, now=121)  # it answered: back in use at once
    assert 0 in {leaders.choose(f"r{i}".encode(), LEADERS, now=122) for i in range(200)}


def test_a_partition_without_a_leader_is_not_chosen_and_none_left_is_the_producers_call() -> None:
    leaders = Leaders(avoid_s=10)
    electing = {0: -1, 1: None, 2: 3, 3: 3}
    assert {leaders.choose(f"r{i}".encode(), electing, now=0) for i in range(100)} == {2, 3}
    assert leaders.choose(b"r1", {0: -1, 1: -1}, now=0) is None
    assert leaders.choose(b"r1", {}, now=0) is None


def test_a_failure_while_other_calls_landed_is_a_leader_away_not_the_broker() -> None:
    leaders = Leaders(avoid_s=10)
    assert not leaders.answered_since(0)
    leaders.landed(None, now=5)
    assert leaders.answered_since(4.9)
    assert not leaders.answered_since(5)
