"""The affinity hold (services/scheduler/routing.py, ADR 0034): a request whose last worker is
full waits for it a bounded time, never near its deadline, and leaves as soon as that worker
frees a slot; the plan wakes the scheduler when a hold ends. Unit and property tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.backlog import Passenger
from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.policy import Policy, WorkerSlots
from services.scheduler.routing import Router
from services.scheduler.settings import SchedulerSettings
from shared.messages import Tier

HOLD = {Tier.interactive: 0.2, Tier.background: 1.0}
LIMITS = TierLimits(max_batch_size=8, max_batch_tokens=10_000, max_wait_ms=0)
CONFIG = PolicyConfig({Tier.interactive: LIMITS, Tier.background: LIMITS})


def _policy() -> Policy[str]:
    return Policy(CONFIG, router=Router("prefix", load_factor=2.0, hold_s=HOLD))


def _add(policy: Policy[str], key: str, now: float, **kw: object) -> None:
    tier = kw.pop("tier", Tier.interactive)
    assert isinstance(tier, Tier)
    deadline = kw.pop("deadline_at", None)
    assert deadline is None or isinstance(deadline, float)
    policy.add(key, tier=tier, cost=10, prompt_tokens=5, now=now, prefix=key, deadline_at=deadline)


def test_router_holds_only_for_a_full_last_server_and_only_until_the_hold_ends() -> None:
    router = Router("prefix", load_factor=2.0, hold_s=HOLD)
    router.served("k", "a")
    totals = {"a": 4, "b": 4}
    assert router.route(["k"], {"b": 4}, totals, now=1.0, hold_until=[1.2]) == [None]
    assert router.holds == 1
    assert router.route(["k"], {"b": 4}, totals, now=1.2, hold_until=[1.2]) == ["b"]
    assert router.last_server("k") == "b"
    # A key never served has nothing cached anywhere: it is not held.
    assert router.route(["new"], {"b": 4}, totals, now=0.0, hold_until=[9.0]) == ["b"]
    # A last server that left is not waited for.
    router.served("gone", "c")
    assert router.route(["gone"], {"b": 4}, totals, now=0.0, hold_until=[9.0]) == ["b"]
    # least_loaded never holds.
    plain = Router("least_loaded", hold_s=HOLD)
    assert plain.route(["k"], {"b": 4}, totals, now=0.0, hold_until=[9.0]) == ["b"]


def test_during_its_hold_a_request_takes_a_free_slot_on_its_last_server_past_the_bound() -> None:
    router = Router("prefix", load_factor=1.0, hold_s=HOLD)
    router.served("k", "a")
    totals = {"a": 8, "b": 8}
    # a: 6 of 8 busy, b idle: a is past its bound (4 busy) but has room and the cache.
    assert router.route(["k"], {"a": 2, "b": 8}, totals, now=0.0, hold_until=[0.2]) == ["a"]
    # Once the hold is over (or without one) the bound applies, as before.
    assert router.route(["k"], {"a": 2, "b": 8}, totals, now=0.2, hold_until=[0.2]) == ["b"]
    router.served("k", "a")
    assert router.route(["k"], {"a": 2, "b": 8}, totals) == ["b"]


def test_hold_until_is_bounded_by_tier_and_deadline() -> None:
    router = Router("prefix", hold_s=HOLD)
    assert router.hold_until(Tier.interactive, 10.0, None) == 10.2
    assert router.hold_until(Tier.background, 10.0, None) == 11.0
    assert router.hold_until(Tier.background, 10.0, 10.5) == 9.5  # never near the deadline
    assert router.hold_until(Tier.interactive, 10.0, 10.3) == pytest.approx(10.1)
    assert Router("least_loaded", hold_s=HOLD).hold_until(Tier.background, 10.0, None) == 10.0


def test_a_held_request_leaves_at_once_when_its_worker_frees_a_slot() -> None:
    policy = _policy()
    policy.router.served("k", "a")
    _add(policy, "k", 0.0)
    plan = policy.plan(0.01, [WorkerSlots("a", 0, 4), WorkerSlots("b", 4, 4)])
    assert plan.dispatches == []
    assert policy.waiting() == 1
    assert plan.wake_at is not None
    assert 0.01 < plan.wake_at <= 0.2  # the hold's end: no spinning, no oversleeping
    plan = policy.plan(0.05, [WorkerSlots("a", 1, 4), WorkerSlots("b", 4, 4)])
    assert [(d.worker_id, [p.item for p in d.passengers]) for d in plan.dispatches] == [
        ("a", ["k"])
    ]


def test_a_held_request_goes_to_the_least_loaded_worker_when_the_hold_ends() -> None:
    policy = _policy()
    policy.router.served("k", "a")
    _add(policy, "k", 0.0)
    full = [WorkerSlots("a", 0, 4), WorkerSlots("b", 4, 4)]
    assert policy.plan(0.0, full).dispatches == []
    plan = policy.plan(0.2, full)
    assert [(d.worker_id, [p.item for p in d.passengers]) for d in plan.dispatches] == [
        ("b", ["k"])
    ]


def test_others_in_the_lane_ride_past_a_held_request() -> None:
    policy = _policy()
    policy.router.served("k", "a")
    _add(policy, "k", 0.0)
    for i in range(3):
        _add(policy, f"other{i}", 0.0)
    plan = policy.plan(0.0, [WorkerSlots("a", 0, 4), WorkerSlots("b", 4, 4)])
    riders = sorted(p.item for d in plan.dispatches for p in d.passengers)
    assert riders == ["other0", "other1", "other2"]
    assert policy.waiting() == 1


def test_settings_give_the_router_its_holds() -> None:
    router = SchedulerSettings(
        scheduler_id="t", scheduler_affinity_hold_ms=50, scheduler_affinity_hold_background_ms=0
    ).router()
    assert router.hold_s == {Tier.interactive: 0.05, Tier.background: 0.0}


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[float, list[int], list[tuple[int, int, float | None]]]]:
    """Per step: time advance, each worker's free slots, arrivals (key, tier, deadline in)."""
    out = []
    for _ in range(draw(st.integers(1, 25))):
        dt = draw(st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.19, 0.2, 0.3, 0.7, 1.1]))
        free = draw(st.lists(st.integers(0, 3), min_size=3, max_size=3))
        arrivals = draw(
            st.lists(
                st.tuples(
                    st.integers(0, 9),
                    st.integers(0, 1),
                    st.none() | st.floats(0.05, 3.0),
                ),
                max_size=4,
            )
        )
        out.append((dt, free, arrivals))
    return out


@settings(max_examples=300, deadline=None)
@given(steps())
def test_a_request_is_held_only_within_its_bound_and_the_plan_wakes_for_it(
    script: list[tuple[float, list[int], list[tuple[int, int, float | None]]]],
) -> None:
    """Whenever a due request is left waiting while a worker still has room, it is held:
    before its arrival + its tier's hold and before its deadline - that hold; and the plan
    wakes the scheduler by the end of the earliest such hold (and not before now)."""
    policy = _policy()
    workers = ["a", "b", "c"]
    for k in range(10):  # every key has a last server, whose cache holds its prefix
        policy.router.served(f"k{k}", workers[k % 3])
    waiting: dict[int, tuple[str, float, Tier, float | None]] = {}
    now = 0.0
    number = 0
    for dt, free, arrivals in script:
        now += dt
        for key, tier_index, deadline_in in arrivals:
            tier = (Tier.interactive, Tier.background)[tier_index]
            deadline = None if deadline_in is None else now + deadline_in
            _add(policy, f"k{key}", now, tier=tier, deadline_at=deadline)
            waiting[number] = (f"k{key}", now, tier, deadline)
            number += 1
        slots = [WorkerSlots(w, n, 4) for w, n in zip(workers, free, strict=True)]
        plan = policy.plan(now, slots)
        left = dict(zip(workers, free, strict=True))
        for d in plan.dispatches:
            left[d.worker_id] -= len(d.passengers)
            assert left[d.worker_id] >= 0
        remaining = _passengers(policy)
        waiting = {p.number: waiting[p.number] for p in remaining}
        if sum(left.values()) == 0:
            continue
        for p in remaining:
            _, arrived, tier, deadline = waiting[p.number]
            until = min(arrived + HOLD[tier], (deadline or float("inf")) - HOLD[tier])
            assert now < until, "a request waited past its hold while a worker had room"
            assert deadline is None or now < deadline
            assert plan.wake_at is not None
            assert now <= plan.wake_at <= until


def _passengers(policy: Policy[str]) -> list[Passenger[str]]:
    return [p for lane in policy.backlog.lanes.values() for p in lane]
