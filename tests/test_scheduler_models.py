"""Models and fallback in the scheduler, on plain values: lanes by model, the fallback
estimate and decision, unknown models, service times from heartbeats."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.models import ModelCheck, ModelLoad, estimated_finish, falls_back
from services.scheduler.policy import Policy, WorkerSlots
from services.scheduler.workers import WorkerRegistry
from shared.messages import Heartbeat, Tier

INT, BG = Tier.interactive, Tier.background
NOW = 1000.0


def config() -> PolicyConfig:
    return PolicyConfig(
        tiers={
            INT: TierLimits(max_batch_size=4, max_batch_tokens=1000, max_wait_ms=0),
            BG: TierLimits(max_batch_size=8, max_batch_tokens=4000, max_wait_ms=0),
        },
        background_aging_ms=1000.0,
        fill_from_other_tier=False,
    )


def worker(
    name: str, model: str, free: int, total: int = 4, service_s: float | None = None
) -> WorkerSlots:
    return WorkerSlots(name, free, total, model=model, service_s=service_s)


def add(
    policy: Policy[str],
    name: str,
    model: str | None,
    *,
    fallback: str | None = None,
    deadline_in_s: float | None = None,
    tier: Tier = INT,
) -> None:
    deadline = None if deadline_in_s is None else NOW + deadline_in_s
    added = policy.add(
        name,
        tier=tier,
        cost=100,
        prompt_tokens=10,
        now=NOW,
        deadline_at=deadline,
        model=model,
        fallback=fallback,
    )
    assert added is not None


def placed(policy: Policy[str], workers: list[WorkerSlots]) -> tuple[dict[str, str], list[str]]:
    """request -> the worker its batch went to; and the requests that fell back."""
    plan = policy.plan(NOW, workers)
    where = {p.item: d.worker_id for d in plan.dispatches for p in d.passengers}
    return where, [p.item for p in plan.fell_back]


# -- the pure estimate and decision -------------------------------------------------------------


def test_free_slots_start_at_once_the_rest_in_waves_of_all_slots() -> None:
    load = ModelLoad(free=2, total=4, service_s=1.0)
    assert estimated_finish(NOW, 0, load) == NOW + 1.0
    assert estimated_finish(NOW, 1, load) == NOW + 1.0
    assert estimated_finish(NOW, 2, load) == NOW + 2.0  # waits for the first slot to free
    assert estimated_finish(NOW, 5, load) == NOW + 2.0
    assert estimated_finish(NOW, 6, load) == NOW + 3.0


def test_no_worker_is_never_and_no_measurement_is_unknown() -> None:
    assert estimated_finish(NOW, 0, ModelLoad(free=0, total=0, service_s=1.0)) == math.inf
    assert estimated_finish(NOW, 3, ModelLoad(free=0, total=4, service_s=None)) is None


def test_falls_back_only_when_the_primary_misses_and_the_fallback_is_no_worse() -> None:
    assert not falls_back(None, NOW + 50, NOW + 1)  # no deadline: it waits
    assert not falls_back(NOW + 10, None, NOW + 1)  # primary unknown: it waits
    assert not falls_back(NOW + 10, NOW + 10, NOW + 1)  # met, just
    assert falls_back(NOW + 10, NOW + 11, NOW + 1)
    assert falls_back(NOW + 10, NOW + 11, None)  # the fallback has not finished anything yet
    assert not falls_back(NOW + 10, NOW + 11, NOW + 12)  # worse there
    assert falls_back(NOW + 10, math.inf, NOW + 100)  # the primary has no worker at all
    assert not falls_back(NOW + 10, math.inf, math.inf)


loads = st.builds(
    ModelLoad,
    free=st.integers(0, 64),
    total=st.integers(1, 64),
    service_s=st.floats(0.001, 100.0),
)


@given(load=loads, ahead=st.integers(0, 10_000), more=st.integers(0, 1000))
def test_the_estimate_never_improves_with_more_ahead(
    load: ModelLoad, ahead: int, more: int
) -> None:
    first, later = estimated_finish(NOW, ahead, load), estimated_finish(NOW, ahead + more, load)
    assert first is not None
    assert later is not None
    assert NOW < first <= later


@given(load=loads, ahead=st.integers(0, 10_000), budget=st.floats(0.0, 1000.0))
def test_a_request_whose_estimate_meets_its_deadline_keeps_its_model(
    load: ModelLoad, ahead: int, budget: float
) -> None:
    primary = estimated_finish(NOW, ahead, load)
    assert primary is not None
    if primary <= NOW + budget:
        assert not falls_back(NOW + budget, primary, NOW)


def test_an_unknown_model_is_refused_only_after_the_grace() -> None:
    check = ModelCheck(listening_since=NOW, grace_s=3.0)
    assert not check.unknown("big", set(), NOW + 1)  # too early to say
    assert check.unknown("big", {"small"}, NOW + 3)
    assert not check.unknown("big", {"big"}, NOW + 3)
    assert not check.unknown(None, set(), NOW + 3)  # no model named: any worker


# -- the policy: lanes by model, fallback ---------------------------------------------------------


def test_a_lane_goes_only_to_workers_of_its_model() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "to-big", "big")
    add(policy, "to-small", "small")
    add(policy, "anywhere", None)
    got, _ = placed(policy, [worker("b", "big", 4), worker("s", "small", 4)])
    assert got["to-big"] == "b"
    assert got["to-small"] == "s"
    assert got["anywhere"] in {"b", "s"}


def test_a_model_without_free_slots_waits_even_if_others_are_idle() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "r", "big")
    assert placed(policy, [worker("b", "big", 0), worker("s", "small", 4)]) == ({}, [])
    assert policy.waiting() == 1
    assert placed(policy, [worker("b", "big", 1), worker("s", "small", 4)]) == ({"r": "b"}, [])


def test_a_due_lane_without_room_on_its_model_waits_for_a_heartbeat_not_the_clock() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "r", "big")
    plan = policy.plan(NOW, [worker("b", "big", 0), worker("s", "small", 4)])
    assert plan.wake_at is None  # not `now`: the stepper would spin
    add(policy, "also", "small")
    plan = policy.plan(NOW, [worker("b", "big", 0), worker("s", "small", 4)])
    assert [p.item for d in plan.dispatches for p in d.passengers] == ["also"]


def test_a_request_that_would_miss_its_deadline_runs_on_its_fallback() -> None:
    policy: Policy[str] = Policy(config())
    for i in range(8):  # two waves ahead on a saturated `big` (4 slots, 2 s a request)
        add(policy, f"ahead{i}", "big")
    add(policy, "may-fall-back", "big", fallback="small", deadline_in_s=3.0)
    add(policy, "must-wait", "big", deadline_in_s=3.0)
    add(policy, "has-time", "big", fallback="small", deadline_in_s=60.0)
    workers = [worker("b", "big", 0, service_s=2.0), worker("s", "small", 4, service_s=0.5)]
    assert placed(policy, workers) == ({"may-fall-back": "s"}, ["may-fall-back"])
    assert policy.waiting() == 10  # the rest wait on `big`


def test_only_requests_of_a_better_or_the_same_tier_that_came_first_count_as_ahead() -> None:
    policy: Policy[str] = Policy(config())
    for i in range(8):
        add(policy, f"bg{i}", "big", tier=BG)
    add(policy, "bg-late", "big", fallback="small", deadline_in_s=4.5, tier=BG)
    add(policy, "int-late", "big", fallback="small", deadline_in_s=4.5)
    workers = [worker("b", "big", 0, service_s=2.0), worker("s", "small", 0, service_s=0.5)]
    # Interactive rides before all background: one wave (4 s) and it is done in time.
    assert placed(policy, workers) == ({}, ["bg-late"])


def test_with_room_on_the_primary_only_a_too_slow_model_sends_it_elsewhere() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "room", "big", fallback="small", deadline_in_s=3.0)
    got = placed(policy, [worker("b", "big", 4, service_s=2.0), worker("s", "small", 4)])
    assert got == ({"room": "b"}, [])
    add(policy, "too-slow-there", "big", fallback="small", deadline_in_s=1.0)
    got = placed(policy, [worker("b", "big", 4, service_s=2.0), worker("s", "small", 4)])
    assert got == ({"too-slow-there": "s"}, ["too-slow-there"])


def test_nothing_falls_back_without_a_measurement_of_the_primary() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "unmeasured", "big", fallback="small", deadline_in_s=0.5)
    assert placed(policy, [worker("b", "big", 0), worker("s", "small", 4)]) == ({}, [])


def test_a_request_falls_back_to_a_model_nobody_serves_never() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "r", "big", fallback="gone", deadline_in_s=1.0)
    assert placed(policy, [worker("b", "big", 0, service_s=5.0)]) == ({}, [])


def test_a_fallen_back_request_keeps_its_deadline() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "r", "big", fallback="small", deadline_in_s=1.0)
    workers = [worker("b", "big", 0, service_s=5.0), worker("s", "small", 0, service_s=0.1)]
    assert placed(policy, workers) == ({}, ["r"])  # moved, but `small` is full too
    plan = policy.plan(NOW + 1.0, workers)
    assert [p.item for p in plan.expired] == ["r"]
    assert policy.waiting() == 0


# -- service times from heartbeats --------------------------------------------------------------


def beat(held: list[tuple[str, int]]) -> Heartbeat:
    return Heartbeat(
        worker_id="w1",
        model="big",
        total_slots=4,
        free_slots=4 - len(held),
        running=len(held),
        queued_tokens=0,
        utilisation=0.0,
        batch_partition=0,
        held=held,
        interval_ms=100.0,
        started_at=1.0,
    )


def test_a_workers_service_time_is_how_long_requests_stay_held() -> None:
    registry = WorkerRegistry()
    registry.beat(beat([("a", 0), ("b", 0)]), now=10.0)
    assert [s.service_s for s in registry.slots(10.0)] == [None]
    registry.beat(beat([("b", 0)]), now=12.0)  # a took 2 s
    assert [(s.model, s.service_s) for s in registry.slots(12.0)] == [("big", 2.0)]
    registry.beat(beat([]), now=14.0)  # b took 4 s: smoothed in
    (slots,) = registry.slots(14.0)
    assert slots.service_s is not None
    assert 2.0 < slots.service_s < 4.0
    assert registry.models() == {"big"}
