"""The batching policy, case by case, on a fake clock: no Kafka, no sleeping."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.scheduler.departure import AdaptiveRule, CostModel, fit_cost_model
from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.policy import Dispatch, Plan, Policy, WorkerSlots
from shared.messages import Tier

INT, BG = Tier.interactive, Tier.background


@dataclass
class FakeClock:
    """Seconds since the test began; moved only by the test."""

    now: float = 1000.0

    def advance_ms(self, ms: float) -> float:
        self.now += ms / 1000.0
        return self.now


def config(**overrides: object) -> PolicyConfig:
    base: dict[str, object] = {
        "tiers": {
            INT: TierLimits(max_batch_size=4, max_batch_tokens=1000, max_wait_ms=10),
            BG: TierLimits(max_batch_size=8, max_batch_tokens=4000, max_wait_ms=200),
        },
        "background_aging_ms": 1000.0,
        "fill_from_other_tier": False,
    }
    base.update(overrides)
    return PolicyConfig(**base)  # type: ignore[arg-type]


def workers(*free: int, total: int = 64) -> list[WorkerSlots]:
    return [WorkerSlots(f"w{i}", f, total) for i, f in enumerate(free)]


ROOMY = workers(64)


def add(
    policy: Policy[str],
    name: str,
    tier: Tier,
    clock: FakeClock,
    cost: int = 100,
    prompt_tokens: int = 10,
    deadline_in_ms: float | None = None,
) -> None:
    deadline = None if deadline_in_ms is None else clock.now + deadline_in_ms / 1000.0
    queued = policy.add(
        name, tier=tier, cost=cost, prompt_tokens=prompt_tokens, now=clock.now, deadline_at=deadline
    )
    assert queued is not None


def names(d: Dispatch[str]) -> list[str]:
    return [p.item for p in d.passengers]


def summary(plan: Plan[str]) -> list[tuple[str, str, str, list[str]]]:
    return [(d.worker_id, d.tier.value, d.reason, names(d)) for d in plan.dispatches]


def test_a_full_batch_leaves_at_once() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    for i in range(5):
        add(policy, f"i{i}", INT, clock)
    plan = policy.plan(clock.now, ROOMY)
    assert summary(plan) == [("w0", "interactive", "full", ["i0", "i1", "i2", "i3"])]
    assert policy.waiting() == 1


def test_a_batch_leaves_when_its_oldest_waited_max_wait_and_not_before() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    add(policy, "i0", INT, clock)
    clock.advance_ms(4)
    add(policy, "i1", INT, clock)
    plan = policy.plan(clock.now, ROOMY)
    assert plan.dispatches == []
    assert plan.wake_at == pytest.approx(clock.now + 0.006)
    clock.advance_ms(5.9)
    assert policy.plan(clock.now, ROOMY).dispatches == []
    clock.advance_ms(0.1)
    assert summary(policy.plan(clock.now, ROOMY)) == [
        ("w0", "interactive", "timeout", ["i0", "i1"])
    ]


def test_token_budget_is_never_exceeded_and_small_requests_pass_a_big_one() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    add(policy, "a", INT, clock, cost=600)
    add(policy, "big", INT, clock, cost=500)
    add(policy, "small", INT, clock, cost=300)
    plan = policy.plan(clock.now, ROOMY)
    assert summary(plan) == [("w0", "interactive", "tokens", ["a", "small"])]
    assert plan.dispatches[0].tokens <= 1000
    clock.advance_ms(10)
    assert summary(policy.plan(clock.now, ROOMY)) == [("w0", "interactive", "timeout", ["big"])]


def test_a_request_larger_than_its_token_budget_is_refused_not_queued() -> None:
    policy = Policy[str](config())
    assert policy.add("huge", tier=INT, cost=1001, prompt_tokens=1, now=0.0) is None
    assert policy.waiting() == 0


def test_interactive_rides_first_when_slots_are_scarce() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    add(policy, "b0", BG, clock)
    clock.advance_ms(150)
    add(policy, "i0", INT, clock)
    clock.advance_ms(60)  # both overdue: b0 waited 210 ms, i0 60 ms
    plan = policy.plan(clock.now, workers(1))
    assert summary(plan) == [("w0", "interactive", "timeout", ["i0"])]
    assert summary(policy.plan(clock.now, workers(1))) == [("w0", "background", "timeout", ["b0"])]


def test_background_leaves_the_interactive_reserve_free_until_it_has_aged() -> None:
    """Issue 39: with a quarter of each worker kept for interactive arrivals, background
    takes 6 of 8 free slots (its batch fills, from its own lane too, no further), interactive
    takes the last two, and background that has aged takes them again."""
    clock = FakeClock()
    policy = Policy[str](config(interactive_reserve=0.25, fill_from_other_tier=True))
    for i in range(12):
        add(policy, f"b{i}", BG, clock)
    clock.advance_ms(210)  # due
    plan = policy.plan(clock.now, workers(8, total=8))
    assert summary(plan) == [("w0", "background", "full", [f"b{i}" for i in range(6)])]
    assert summary(policy.plan(clock.now, workers(2, total=8))) == []
    add(policy, "i0", INT, clock)
    add(policy, "i1", INT, clock)
    clock.advance_ms(20)
    assert summary(policy.plan(clock.now, workers(2, total=8))) == [
        ("w0", "interactive", "timeout", ["i0", "i1"])
    ]
    clock.advance_ms(1000)  # the rest of the background has aged: the reserve is theirs too
    plan = policy.plan(clock.now, workers(2, total=8))
    assert summary(plan) == [("w0", "background", "timeout", ["b6", "b7"])]


def test_aged_background_outranks_interactive() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    add(policy, "b-old", BG, clock)
    add(policy, "b-young", BG, clock)
    clock.advance_ms(790)
    add(policy, "b-new", BG, clock)
    clock.advance_ms(210)  # b-old and b-young waited the 1000 ms aging bound, b-new is due
    add(policy, "i0", INT, clock)
    clock.advance_ms(10)
    plan = policy.plan(clock.now, workers(2))
    # Only the aged prefix outranks interactive; b-new waits behind i0.
    assert summary(plan) == [("w0", "background", "timeout", ["b-old", "b-young"])]
    assert summary(policy.plan(clock.now, workers(2))) == [
        ("w0", "interactive", "timeout", ["i0"]),
        ("w0", "background", "timeout", ["b-new"]),
    ]


def test_aged_background_waits_like_the_rest_once_it_had_its_minimum_share() -> None:
    clock, policy = FakeClock(), Policy[str](config(background_min_share=0.1))
    policy.background_share = 0.5  # background had half of the recent dispatches
    add(policy, "b-old", BG, clock)
    clock.advance_ms(1000)
    add(policy, "i0", INT, clock)
    clock.advance_ms(10)
    assert summary(policy.plan(clock.now, workers(1))) == [("w0", "interactive", "timeout", ["i0"])]


def test_the_background_share_follows_what_was_dispatched() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    for i in range(50):
        add(policy, f"b{i}", BG, clock)
    clock.advance_ms(200)
    while policy.waiting():
        policy.plan(clock.now, ROOMY)
    assert 0.3 < policy.background_share < 0.5  # 50 of them, smoothed over ~100
    for i in range(300):
        add(policy, f"i{i}", INT, clock)
    clock.advance_ms(10)
    while policy.waiting():
        policy.plan(clock.now, ROOMY)
    assert policy.background_share < 0.05


def test_without_free_slots_the_backlog_stays_and_leaves_by_priority_later() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    for i in range(3):
        add(policy, f"b{i}", BG, clock)
        add(policy, f"i{i}", INT, clock)
    clock.advance_ms(500)
    plan = policy.plan(clock.now, workers(0, 0))
    assert plan.dispatches == []
    assert plan.wake_at is None  # nothing to do until capacity comes back
    assert policy.waiting() == 6
    order: list[str] = []
    for _ in range(6):  # one slot frees at a time
        order += [n for d in policy.plan(clock.now, workers(0, 1)).dispatches for n in names(d)]
    assert order == ["i0", "i1", "i2", "b0", "b1", "b2"]


def test_a_batch_goes_to_the_worker_with_most_room_and_never_exceeds_it() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    for i in range(4):
        add(policy, f"i{i}", INT, clock)
    plan = policy.plan(clock.now, workers(1, 3, 2))
    assert summary(plan) == [
        ("w1", "interactive", "full", ["i0", "i1", "i2"]),
        ("w2", "interactive", "full", ["i3"]),
    ]


def test_spare_room_is_filled_from_the_other_tier_only_when_enabled() -> None:
    for enabled in (True, False):
        clock, policy = FakeClock(), Policy[str](config(fill_from_other_tier=enabled))
        add(policy, "b0", BG, clock)
        add(policy, "i0", INT, clock)
        clock.advance_ms(10)
        plan = policy.plan(clock.now, ROOMY)
        first = plan.dispatches[0]
        assert names(first) == (["i0", "b0"] if enabled else ["i0"])
        assert first.filled == (1 if enabled else 0)


def test_fill_never_takes_a_slot_a_due_request_needed() -> None:
    clock, policy = FakeClock(), Policy[str](config(fill_from_other_tier=True))
    add(policy, "b0", BG, clock)
    add(policy, "i0", INT, clock)
    add(policy, "i1", INT, clock)
    clock.advance_ms(10)
    plan = policy.plan(clock.now, workers(2))
    assert summary(plan) == [("w0", "interactive", "timeout", ["i0", "i1"])]


def test_length_buckets_keep_short_and_long_prompts_apart() -> None:
    clock = FakeClock()
    bucketed = Policy[str](config(batching="buckets", bucket_edges=(100,)))
    packed = Policy[str](config(batching="pack"))
    for policy in (bucketed, packed):
        add(policy, "short", INT, clock, prompt_tokens=20)
        add(policy, "long", INT, clock, prompt_tokens=500)
    clock.advance_ms(10)
    assert sorted(names(d) for d in bucketed.plan(clock.now, ROOMY).dispatches) == [
        ["long"],
        ["short"],
    ]
    assert [names(d) for d in packed.plan(clock.now, ROOMY).dispatches] == [["short", "long"]]


def test_a_request_past_its_deadline_is_expired_never_dispatched() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    add(policy, "late", BG, clock, deadline_in_ms=50)
    plan = policy.plan(clock.now, workers(0))
    assert plan.wake_at == pytest.approx(clock.now + 0.05)
    clock.advance_ms(50)
    plan = policy.plan(clock.now, ROOMY)
    assert [p.item for p in plan.expired] == ["late"]
    assert plan.dispatches == []
    assert policy.waiting() == 0


def test_a_deadline_before_the_bus_leaves_sends_the_bus_early() -> None:
    clock, policy = FakeClock(), Policy[str](config())
    add(policy, "b0", BG, clock)
    add(policy, "urgent", BG, clock, deadline_in_ms=100)  # the bus would leave at 200 ms
    assert summary(policy.plan(clock.now, ROOMY)) == [
        ("w0", "background", "deadline", ["b0", "urgent"])
    ]


def adaptive(per_request_ms: float = 1.0, per_batch_ms: float = 20.0) -> Policy[str]:
    rule = AdaptiveRule(CostModel(per_request_ms / 1000.0, per_batch_ms / 1000.0))
    tiers = {
        INT: TierLimits(max_batch_size=32, max_batch_tokens=100_000, max_wait_ms=50),
        BG: TierLimits(max_batch_size=32, max_batch_tokens=100_000, max_wait_ms=200),
    }
    return Policy[str](config(tiers=tiers), rule)


def test_adaptive_sends_at_once_when_the_workers_are_idle() -> None:
    clock, policy = FakeClock(), adaptive()
    add(policy, "i0", INT, clock)
    assert summary(policy.plan(clock.now, workers(64, total=64))) == [
        ("w0", "interactive", "adaptive", ["i0"])
    ]


def test_adaptive_waits_while_busy_and_arrivals_are_fast_then_leaves_before_max_wait() -> None:
    clock, policy = FakeClock(), adaptive()
    busy = workers(8, total=64)  # 7/8 of the slots in use
    for i in range(4):  # one arrival per ms: newcomers pay for the wait
        add(policy, f"i{i}", INT, clock)
        assert policy.plan(clock.now, busy).dispatches == []
        clock.advance_ms(1)
    plan = policy.plan(clock.now, busy)
    assert plan.wake_at is not None
    # Nobody arrives any more: the bus leaves once waiting stops paying, well before 50 ms.
    clock.now = plan.wake_at
    plan = policy.plan(clock.now, busy)
    assert summary(plan) == [("w0", "interactive", "adaptive", ["i0", "i1", "i2", "i3"])]
    assert plan.dispatches[0].passengers[0].arrived + 0.05 > clock.now


def test_adaptive_still_honours_max_wait() -> None:
    clock, policy = FakeClock(), adaptive(per_request_ms=0.0, per_batch_ms=10_000.0)
    busy = workers(1, total=64)
    add(policy, "i0", INT, clock)
    clock.advance_ms(49)
    add(policy, "i1", INT, clock)
    assert policy.plan(clock.now, busy).dispatches == []
    clock.advance_ms(1)
    assert summary(policy.plan(clock.now, busy)) == [("w0", "interactive", "timeout", ["i0"])]


def test_the_cost_model_fit_recovers_a_line_and_keeps_the_prior_when_it_cannot() -> None:
    prior = CostModel(0.001, 0.02)
    samples = [(n, 0.004 * n + 0.015) for n in (1, 2, 4, 8, 16)]
    fitted = fit_cost_model(samples, prior)
    assert fitted.per_request_s == pytest.approx(0.004)
    assert fitted.per_batch_s == pytest.approx(0.015)
    assert fit_cost_model([(4, 0.1), (4, 0.2)], prior) == prior


def test_config_rejects_an_aging_bound_below_the_background_max_wait() -> None:
    with pytest.raises(ValueError, match="aging"):
        config(background_aging_ms=100.0)
