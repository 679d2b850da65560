"""Fair share between tenants inside a tier: the pure policy on a simulated clock.

The simulation drives `Policy` the way the scheduler does: `plan` on every arrival, every
freed slot and at the `wake_at` the last plan asked for. One worker, a fixed service time
per request; fair share on and off (arrival order) are compared on the same arrivals.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.fairness import FairQueue
from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.policy import Policy, WorkerSlots
from shared.messages import Tier

INT, BG = Tier.interactive, Tier.background
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Req:
    at: float
    tenant: str
    cost: int
    tier: Tier = INT


@dataclass
class Run:
    """Per plan: when, which requests left (indices), and who still waits afterwards."""

    plans: list[tuple[float, list[int], Counter[str]]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # every dispatched index, in order


def config(
    *,
    batch: int = 4,
    tokens: int = 1_000_000,
    fair: bool = True,
    weights: dict[str, float] | None = None,
    max_wait_ms: float = 0.0,
) -> PolicyConfig:
    limits = TierLimits(max_batch_size=batch, max_batch_tokens=tokens, max_wait_ms=max_wait_ms)
    return PolicyConfig(
        tiers={INT: limits, BG: limits},
        background_aging_ms=1000.0,
        fill_from_other_tier=False,
        fair_share=fair,
        tenant_weights=weights or {},
    )


def simulate(cfg: PolicyConfig, reqs: list[Req], *, slots: int, service: float) -> Run:
    policy: Policy[int] = Policy(cfg)
    run = Run()
    free = slots
    releases: list[float] = []
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].at)
    waiting: Counter[str] = Counter()
    wake: float | None = None
    while True:
        times = [t for t in (reqs[pending[0]].at if pending else None, wake) if t is not None]
        if releases:
            times.append(releases[0])
        if not times:
            break
        now = min(times)
        while releases and releases[0] <= now:
            heapq.heappop(releases)
            free += 1
        while pending and reqs[pending[0]].at <= now:
            i = pending.pop(0)
            r = reqs[i]
            policy.add(i, tier=r.tier, cost=r.cost, prompt_tokens=1, now=now, tenant=r.tenant)
            waiting[r.tenant] += 1
        plan = policy.plan(now, [WorkerSlots("w", free, slots)])
        assert not plan.expired
        left = [p.item for d in plan.dispatches for p in d.passengers]
        for i in left:
            waiting[reqs[i].tenant] -= 1
            heapq.heappush(releases, now + service)
        free -= len(left)
        assert free >= 0
        run.plans.append((now, left, +waiting))
        run.order.extend(left)
        wake = plan.wake_at if plan.wake_at is not None and plan.wake_at > now else None
    assert policy.waiting() == 0
    return run


def flood(tenant: str, costs: list[int], at: float = 0.0) -> list[Req]:
    return [Req(at, tenant, c) for c in costs]


costs_st = st.lists(st.integers(1, 500), min_size=5, max_size=80)


@PROPERTY
@given(
    a=costs_st,
    b=costs_st,
    weight_a=st.integers(1, 4),
    weight_b=st.integers(1, 4),
    batch=st.integers(1, 8),
    slots=st.integers(1, 8),
)
def test_two_backlogged_tenants_each_get_their_weighted_share_within_one_request(
    a: list[int], b: list[int], weight_a: int, weight_b: int, batch: int, slots: int
) -> None:
    reqs = flood("a", a) + flood("b", b)  # a's whole backlog arrives first
    weights = {"a": float(weight_a), "b": float(weight_b)}
    run = simulate(config(batch=batch, weights=weights), reqs, slots=slots, service=0.01)
    served = {"a": 0, "b": 0}
    bound = max(max(a) / weight_a, max(b) / weight_b)
    for _, left, still in run.plans:
        for i in left:
            served[reqs[i].tenant] += reqs[i].cost
        if still["a"] and still["b"]:  # both stayed backlogged through this plan
            gap = served["a"] / weight_a - served["b"] / weight_b
            assert abs(gap) <= bound + 1e-9, (served, bound)


@PROPERTY
@given(
    reqs=st.lists(
        st.builds(
            Req,
            at=st.integers(0, 300).map(lambda ms: ms / 1000.0),
            tenant=st.just("only"),
            cost=st.integers(1, 500),
            tier=st.sampled_from([INT, BG]),
        ),
        min_size=1,
        max_size=60,
    ),
    batch=st.integers(1, 8),
    tokens=st.integers(500, 3000),
    slots=st.integers(1, 6),
)
def test_a_lone_tenant_is_served_exactly_as_without_fair_share(
    reqs: list[Req], batch: int, tokens: int, slots: int
) -> None:
    fair = simulate(config(batch=batch, tokens=tokens), reqs, slots=slots, service=0.02)
    fifo = simulate(config(batch=batch, tokens=tokens, fair=False), reqs, slots=slots, service=0.02)
    assert fair.plans == fifo.plans


@PROPERTY
@given(
    reqs=st.lists(
        st.builds(
            Req,
            at=st.integers(0, 300).map(lambda ms: ms / 1000.0),
            tenant=st.sampled_from(["a", "b", "c", "d"]),
            cost=st.integers(1, 500),
        ),
        min_size=1,
        max_size=80,
    ),
    batch=st.integers(1, 8),
    slots=st.integers(1, 6),
)
def test_fair_share_is_work_conserving(reqs: list[Req], batch: int, slots: int) -> None:
    """Whoever rides, as many ride at every plan as in arrival order: no slot idles."""
    fair = simulate(config(batch=batch), reqs, slots=slots, service=0.02)
    fifo = simulate(config(batch=batch, fair=False), reqs, slots=slots, service=0.02)
    assert [(t, len(left)) for t, left, _ in fair.plans] == [
        (t, len(left)) for t, left, _ in fifo.plans
    ]


def test_a_newcomer_rides_the_next_free_slot_not_behind_the_flood() -> None:
    reqs = [*flood("a", [300] * 200), Req(1.05, "b", 20)]
    fair = simulate(config(batch=4), reqs, slots=4, service=0.1)
    fifo = simulate(config(batch=4, fair=False), reqs, slots=4, service=0.1)
    b = len(reqs) - 1

    def left_at(run: Run) -> float:
        return next(t for t, left, _ in run.plans if b in left)

    # Four slots free together every 0.1 s: b takes one of the next four.
    assert left_at(fair) == pytest.approx(1.1)
    assert left_at(fifo) > 4.0  # behind the other 150 or so of a's requests


def test_idle_time_earns_no_credit() -> None:
    """b, idle while a was served alone, then floods: from then on they share equally."""
    reqs = flood("a", [100] * 300) + flood("b", [100] * 100, at=2.0)
    run = simulate(config(batch=1), reqs, slots=1, service=0.01)
    after = [reqs[i].tenant for t, left, _ in run.plans if t >= 2.0 for i in left]
    first = Counter(after[:100])
    assert abs(first["a"] - first["b"]) <= 1


def test_weights_split_tokens_in_proportion() -> None:
    reqs = flood("gold", [60] * 400) + flood("free", [60] * 400)
    cfg = config(batch=2, weights={"gold": 3.0})
    run = simulate(cfg, reqs, slots=2, service=0.01)
    first = Counter(reqs[i].tenant for i in run.order[:400])
    assert first["gold"] == 300
    assert first["free"] == 100


def test_cost_is_in_tokens_not_requests() -> None:
    """Equal weights, a's requests ten times b's size: b gets ten requests per one of a's."""
    reqs = flood("a", [1000] * 50) + flood("b", [100] * 300)
    run = simulate(config(batch=1), reqs, slots=1, service=0.01)
    first = Counter(reqs[i].tenant for i in run.order[:110])
    assert first["a"] == 10
    assert first["b"] == 100


def test_within_a_tenant_requests_keep_arrival_order() -> None:
    reqs = [Req(0.0, t, c) for t, c in zip("abab" * 30, range(1, 121), strict=True)]
    run = simulate(config(batch=3), reqs, slots=2, service=0.01)
    for tenant in "ab":
        mine = [i for i in run.order if reqs[i].tenant == tenant]
        assert mine == sorted(mine)


def test_priority_between_tiers_stays_above_fair_share() -> None:
    """A tenant far behind its share in background still waits for interactive."""
    policy: Policy[str] = Policy(config(batch=1))
    for k in range(5):
        policy.add(f"a{k}", tier=INT, cost=100, prompt_tokens=1, now=0.0, tenant="a")
    policy.add("b0", tier=BG, cost=1, prompt_tokens=1, now=0.0, tenant="b")
    plan = policy.plan(0.0, [WorkerSlots("w", 5, 6)])
    assert [p.item for d in plan.dispatches for p in d.passengers] == [f"a{k}" for k in range(5)]


@dataclass(frozen=True)
class Fake:
    """A fake waiting request: just what the fair queue reads."""

    tenant: str
    cost: int
    number: int


def test_counters_of_tenants_gone_idle_are_forgotten() -> None:
    """One tenant always waits; ten thousand others come, ride and go: memory stays bounded."""
    queue: FairQueue[Fake] = FairQueue({}, first_fit_scan=8)
    numbers = iter(range(1_000_000))
    for _ in range(3):
        queue.add(Fake("busy", 10, next(numbers)))
    for n in range(10_000):
        queue.add(Fake(f"t{n}", 10, next(numbers)))
        for p in queue.select(limit=2, token_budget=1000):
            queue.charge(p)
            if p.tenant == "busy":
                queue.add(Fake("busy", 10, next(numbers)))
        assert len(queue.counters) <= 2 * len(queue.queues) + 64
    assert set(queue.queues) == {"busy"}


def test_an_empty_lane_forgets_everything() -> None:
    queue: FairQueue[Fake] = FairQueue({}, first_fit_scan=8)
    p = Fake("a", 10, 0)
    queue.add(p)
    queue.charge(p)
    assert not queue.counters
    assert queue.virtual == 0.0


def test_removed_requests_cost_their_tenant_nothing() -> None:
    queue: FairQueue[Fake] = FairQueue({}, first_fit_scan=8)
    a0, a1, b0 = Fake("a", 100, 0), Fake("a", 100, 1), Fake("b", 100, 2)
    for p in (a0, a1, b0):
        queue.add(p)
    queue.remove(a0)  # expired, say
    assert queue.select(limit=2, token_budget=1000) == [a1, b0]


def test_select_moves_nothing_until_charged() -> None:
    queue: FairQueue[Fake] = FairQueue({}, first_fit_scan=8)
    reqs = [Fake("a", 10, 0), Fake("a", 10, 1), Fake("b", 10, 2)]
    for p in reqs:
        queue.add(p)
    first = queue.select(limit=2, token_budget=1000)
    assert queue.select(limit=2, token_budget=1000) == first == [reqs[0], reqs[2]]
    queue.charge(reqs[0])
    assert queue.select(limit=2, token_budget=1000) == [reqs[2], reqs[1]]


def test_a_request_too_big_for_the_budget_keeps_its_tenants_turn() -> None:
    queue: FairQueue[Fake] = FairQueue({}, first_fit_scan=8)
    big, small, other = Fake("a", 900, 0), Fake("a", 10, 1), Fake("b", 10, 2)
    for p in (big, small, other):
        queue.add(p)
    assert queue.select(limit=3, token_budget=100) == [small, other]
    queue.charge(small)
    queue.charge(other)
    assert queue.select(limit=3, token_budget=1000) == [big]
