"""Property tests of the batching policy over random arrivals, on a simulated clock.

The simulation drives the policy the way the scheduler process does: it calls `plan` when a
request arrives, when a worker slot frees, and at the `wake_at` the last plan asked for,
rounded up to the next scheduling tick. Workers are slot counters; a dispatched request
holds its slot for a drawn service time.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.departure import AdaptiveRule, CostModel, DepartureRule, FixedRule
from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.policy import Policy, WorkerSlots
from shared.messages import Tier

INT, BG = Tier.interactive, Tier.background
TICK = 0.001  # the scheduler's timer granularity, seconds
EPS = 1e-9


@dataclass(frozen=True)
class Arrival:
    at: float
    tier: Tier
    cost: int
    prompt_tokens: int
    deadline_in: float | None
    service: float  # seconds it holds a worker slot once dispatched
    tenant: str = "default"


@dataclass
class Outcome:
    """What happened to every request, and a snapshot of each plan for the invariants."""

    dispatched: dict[int, float] = field(default_factory=dict)  # arrival index -> time
    expired: dict[int, float] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    seen: list[int] = field(default_factory=list)  # every index each time it left
    violations: list[str] = field(default_factory=list)
    stuck: int = 0


def simulate(
    config: PolicyConfig, rule: DepartureRule, arrivals: list[Arrival], slots: list[int]
) -> Outcome:
    policy: Policy[int] = Policy(config, rule)
    out = Outcome()
    free = list(slots)
    releases: list[tuple[float, int]] = []  # (time, worker index)
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at)
    # index -> arrival time per tier, in arrival order: the first is the oldest waiting.
    waiting: dict[Tier, dict[int, float]] = {INT: {}, BG: {}}
    wake: float | None = None
    now = 0.0
    while True:
        times = []
        if pending:
            times.append(arrivals[pending[0]].at)
        if releases:
            times.append(releases[0][0])
        if wake is not None:
            # The process's timer fires on the next tick at or after `wake_at`.
            times.append(max(wake, math.ceil(wake / TICK - 1e-6) * TICK))
        if not times:
            break
        now = max(now, min(times))
        while releases and releases[0][0] <= now + EPS:
            free[heapq.heappop(releases)[1]] += 1
        while pending and arrivals[pending[0]].at <= now + EPS:
            i = pending.pop(0)
            a = arrivals[i]
            deadline = None if a.deadline_in is None else a.at + a.deadline_in
            queued = policy.add(
                i,
                tier=a.tier,
                cost=a.cost,
                prompt_tokens=a.prompt_tokens,
                now=now,
                deadline_at=deadline,
                tenant=a.tenant,
            )
            if queued is None:
                out.refused.add(i)
                out.seen.append(i)
            else:
                waiting[a.tier][i] = now
        workers = [WorkerSlots(f"w{k}", f, slots[k]) for k, f in enumerate(free)]
        # Aged background outranks interactive while its recent share is below the minimum.
        aging_active = policy.background_share < config.background_min_share
        plan = policy.plan(now, workers)
        wake = plan.wake_at
        for p in plan.expired:
            out.expired[p.item] = now
            out.seen.append(p.item)
            waiting[p.tier].pop(p.item)
        given_to = [0] * len(slots)
        left: dict[Tier, bool] = {INT: False, BG: False}  # non-aged background / interactive
        aging = config.background_aging_ms / 1000.0
        for d in plan.dispatches:
            limits = config.tiers[d.tier]
            if len(d.passengers) > limits.max_batch_size:
                out.violations.append(f"batch of {len(d.passengers)} > {limits.max_batch_size}")
            if d.tokens > limits.max_batch_tokens:
                out.violations.append(f"batch of {d.tokens} tokens > {limits.max_batch_tokens}")
            k = int(d.worker_id[1:])
            given_to[k] += len(d.passengers)
            for p in d.passengers:
                i = p.item
                out.dispatched[i] = now
                out.seen.append(i)
                arrived = waiting[p.tier].pop(i)
                if p.tier is INT:
                    left[INT] = True
                elif now - arrived < aging - EPS:
                    left[BG] = True
                heapq.heappush(releases, (now + arrivals[i].service, k))
        for k, n in enumerate(given_to):
            if n > free[k]:
                out.violations.append(f"worker {k} got {n} with {free[k]} free")
            free[k] -= n
        # Priority: a non-aged background request left while an interactive one was overdue,
        # or an interactive one left while an aged background one stayed behind. Only the
        # oldest waiting of each tier can be overdue or aged first; cases within float
        # rounding of the bound are left to the wait-bound assertions.
        oldest: dict[Tier, tuple[int, float] | None] = {
            t: next(iter(w.items()), None) for t, w in waiting.items()
        }
        first_int, first_bg = oldest[INT], oldest[BG]
        if left[BG] and first_int is not None:
            i, arrived = first_int
            if now - arrived > config.tiers[INT].max_wait_ms / 1000.0 + EPS:
                out.violations.append(f"background rode while interactive {i} was overdue")
        if aging_active and left[INT] and first_bg is not None:
            i, arrived = first_bg
            if now - arrived > aging + EPS:
                out.violations.append(f"interactive rode while background {i} had aged")
    out.stuck = policy.waiting()
    return out


@st.composite
def configs(draw: st.DrawFn) -> tuple[PolicyConfig, DepartureRule]:
    def tier(max_wait: list[float]) -> TierLimits:
        return TierLimits(
            max_batch_size=draw(st.integers(1, 16)),
            max_batch_tokens=draw(st.integers(200, 4000)),
            max_wait_ms=draw(st.sampled_from(max_wait)),
        )

    interactive = tier([0.0, 5.0, 10.0])
    background = tier([50.0, 200.0])
    config = PolicyConfig(
        tiers={INT: interactive, BG: background},
        background_aging_ms=draw(st.sampled_from([200.0, 400.0])),
        background_min_share=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        fill_from_other_tier=draw(st.booleans()),
        fair_share=draw(st.booleans()),
        tenant_weights=draw(st.sampled_from([{}, {"a": 3.0, "b": 0.5}])),
        batching=draw(st.sampled_from(["pack", "buckets"])),
        bucket_edges=(64, 512),
    )
    rules: list[DepartureRule] = [
        FixedRule(),
        AdaptiveRule(CostModel(0.001, 0.02)),
        AdaptiveRule(CostModel(0.0, 0.5)),
    ]
    rule = draw(st.sampled_from(rules))
    return config, rule


@st.composite
def arrival_lists(draw: st.DrawFn, max_service: float = 0.05) -> list[Arrival]:
    n = draw(st.integers(1, 60))
    out = []
    for _ in range(n):
        out.append(
            Arrival(
                at=draw(st.integers(0, 800)) / 1000.0,
                tier=draw(st.sampled_from([INT, BG])),
                cost=draw(st.integers(1, 1200)),
                prompt_tokens=draw(st.integers(1, 1000)),
                deadline_in=draw(st.none() | st.integers(1, 300).map(lambda ms: ms / 1000.0)),
                service=draw(st.integers(1, int(max_service * 1000))) / 1000.0,
                tenant=draw(st.sampled_from(["a", "b", "c"])),
            )
        )
    return out


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_exactly_once(arrivals: list[Arrival], out: Outcome) -> None:
    assert out.stuck == 0, "requests left in the backlog with capacity and time to spare"
    assert sorted(out.seen) == list(range(len(arrivals))), "a request left twice or never"
    for i in out.refused:
        assert arrivals[i].cost > 0
    assert not out.violations, out.violations[:5]


def assert_deadlines(arrivals: list[Arrival], out: Outcome) -> None:
    for i, t in out.dispatched.items():
        a = arrivals[i]
        if a.deadline_in is not None:
            # (Equal within float rounding is the boundary, not past it.)
            assert t < a.at + a.deadline_in + EPS, f"request {i} dispatched past its deadline"
    for i, t in out.expired.items():
        a = arrivals[i]
        assert a.deadline_in is not None
        assert a.at + a.deadline_in - EPS <= t <= a.at + a.deadline_in + TICK + EPS


@PROPERTY
@given(configs(), arrival_lists())
def test_with_capacity_free_every_request_leaves_once_within_max_wait_plus_a_tick(
    setup: tuple[PolicyConfig, DepartureRule], arrivals: list[Arrival]
) -> None:
    config, rule = setup
    out = simulate(config, rule, arrivals, slots=[1000, 1000])
    assert_exactly_once(arrivals, out)
    assert_deadlines(arrivals, out)
    for i in range(len(arrivals)):
        a = arrivals[i]
        if i in out.refused:
            assert a.cost > config.tiers[a.tier].max_batch_tokens
            continue
        if i in out.dispatched:
            wait = out.dispatched[i] - a.at
            bound = config.tiers[a.tier].max_wait_ms / 1000.0 + TICK
            assert wait <= bound + EPS, f"{a.tier} request {i} waited {wait:.4f} s > {bound} s"


@PROPERTY
@given(
    configs(), arrival_lists(max_service=0.2), st.lists(st.integers(1, 4), min_size=1, max_size=3)
)
def test_with_scarce_capacity_limits_priority_and_aging_hold(
    setup: tuple[PolicyConfig, DepartureRule], arrivals: list[Arrival], slots: list[int]
) -> None:
    config, rule = setup
    out = simulate(config, rule, arrivals, slots=slots)
    assert_exactly_once(arrivals, out)
    assert_deadlines(arrivals, out)


@settings(PROPERTY, max_examples=40)
@given(
    configs(),
    st.integers(0, 300),  # when the background request arrives, ms
    st.integers(1, 2),  # interactive arrivals per ms
    st.integers(1, 10),  # service time, ms
)
def test_background_waits_at_most_its_aging_bound_under_an_interactive_flood(
    setup: tuple[PolicyConfig, DepartureRule], bg_at_ms: int, per_ms: int, service_ms: int
) -> None:
    config, rule = setup
    # One background request among interactive ones: its share is below any positive minimum.
    config = replace(config, background_min_share=max(config.background_min_share, 0.01))
    service = service_ms / 1000.0
    flood = [
        Arrival(ms / 1000.0, INT, 10, 10, None, service)
        for ms in range(0, 800)
        for _ in range(per_ms)
    ]
    background = Arrival(bg_at_ms / 1000.0, BG, 10, 10, None, service)
    arrivals = [background, *flood]
    out = simulate(config, rule, arrivals, slots=[1])
    assert_exactly_once(arrivals, out)
    wait = out.dispatched[0] - background.at
    # Aged, it goes first; it still needs the one slot to come free.
    bound = config.background_aging_ms / 1000.0 + service + TICK
    assert wait <= bound + EPS, f"background waited {wait:.4f} s > {bound:.4f} s"
