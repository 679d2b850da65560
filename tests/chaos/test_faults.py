"""Fault plans are replayable from their seed, spaced, and take instances in turn."""

from __future__ import annotations

import itertools

from tests.chaos.faults import (
    BROKER_KINDS,
    NET_KINDS,
    NODE_KINDS,
    NODE_SETTLE_S,
    SERVICE_KINDS,
    last_end_s,
    plan,
)


def test_the_same_seed_plays_the_same_plan() -> None:
    kinds = SERVICE_KINDS * 2 + BROKER_KINDS
    assert plan(7, kinds, 5, 50) == plan(7, kinds, 5, 50)
    assert plan(7, kinds, 5, 50) != plan(8, kinds, 5, 50)


def test_faults_are_spaced_inside_the_window_and_each_restarts_before_the_next() -> None:
    faults = plan(3, SERVICE_KINDS * 2, 5, 50)
    assert len(faults) == 8
    slot = 45 / 8
    for a, b in itertools.pairwise(faults):
        assert b.at_s - a.at_s >= slot / 2 - 0.01
        assert a.at_s + a.down_s <= b.at_s
    assert all(5 <= f.at_s < 50 for f in faults)
    assert sorted(f.kind for f in faults) == sorted(SERVICE_KINDS * 2)


def test_a_repeated_kind_takes_the_other_instance() -> None:
    for seed in range(20):
        faults = plan(seed, SERVICE_KINDS * 2, 5, 50)
        assert {f.target for f in faults if f.kind == "edge"} == {"edge-a", "edge-b"}
        assert {f.target for f in faults if f.kind == "worker"} == {"worker-a", "worker-b"}


def test_broker_faults_name_a_partition() -> None:
    faults = plan(1, BROKER_KINDS, 0, 10)
    targets = {f.kind: f.target for f in faults}
    assert targets["broker-requests-leader"].startswith("requests/")
    assert targets["broker-results-leader"] in ("results/0", "results/1")
    assert "the leader of requests/" in next(
        f.describe() for f in faults if f.kind == "broker-requests-leader"
    )


def test_node_faults_never_overlap_and_leave_the_last_node_time_to_come_back() -> None:
    kinds = (*SERVICE_KINDS, "worker", "edge", *NODE_KINDS)
    for seed in range(50):
        faults = plan(seed, kinds, 5, 100)
        nodes = [f for f in faults if f.node_fault]
        assert sorted(f.kind for f in nodes) == sorted(NODE_KINDS)
        for a, b in itertools.pairwise(nodes):
            assert b.at_s >= a.ends_s + NODE_SETTLE_S - 0.01, (a, b)
        assert last_end_s(faults) == max(f.ends_s for f in faults)
    black_hole = next(f for f in plan(1, NET_KINDS, 0, 10) if f.kind == "net-black-hole")
    assert black_hole.down_s == 20.0
    assert "black hole" in black_hole.describe()
    assert "the leader of" in black_hole.describe()
