"""Prefix-affinity routing (services/scheduler/routing.py), the prefix key (shared/prefixes.py)
and the policy placing a batch by it: property tests on random workers and keys."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.policy import Policy, WorkerSlots
from services.scheduler.routing import Router, rendezvous
from shared.messages import ChatMessage, ChatRequest, Tier
from shared.prefixes import prefix_key

WORKER_IDS = [f"w{i}" for i in range(8)]
keys_st = st.lists(st.sampled_from([f"k{i}" for i in range(30)] + [None]), max_size=60)


@st.composite
def cluster(draw: st.DrawFn) -> tuple[dict[str, int], dict[str, int]]:
    """Equal-sized workers (Mirrokni's bound is for equal bins), each with some room used."""
    n = draw(st.integers(1, 6))
    size = draw(st.integers(1, 16))
    totals = dict.fromkeys(WORKER_IDS[:n], size)
    free = {w: draw(st.integers(0, size)) for w in totals}
    return totals, free


@settings(max_examples=300, deadline=None)
@given(cluster(), keys_st, st.floats(1.0, 2.0))
def test_bounded_load_is_never_exceeded(
    c: tuple[dict[str, int], dict[str, int]], keys: list[str | None], factor: float
) -> None:
    totals, free = c
    router = Router("prefix", load_factor=factor)
    room = dict(free)
    for key in keys:
        before = {w: totals[w] - room[w] for w in totals}
        where = router.route([key], {w: n for w, n in room.items() if n > 0}, totals)
        if sum(room.values()) == 0:
            assert where == []
            continue
        (worker,) = where
        assert room[worker] > 0, "a worker without a free slot got a request"
        busy = sum(before.values())
        bound = math.ceil(factor * (busy + 1) * totals[worker] / sum(totals.values()))
        bound = max(bound, totals[worker] // 2)  # below half busy, affinity always holds
        # By affinity only within the bound; beyond it, only the least loaded worker.
        least = max(room[w] for w in room)
        assert before[worker] + 1 <= bound or room[worker] == least
        room[worker] -= 1


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.lists(st.sampled_from([f"k{i}" for i in range(10)]), max_size=40))
def test_same_prefix_same_worker_while_it_has_room(n: int, keys: list[str]) -> None:
    totals = dict.fromkeys(WORKER_IDS[:n], 1000)  # ample room: the bound never binds
    router = Router("prefix", load_factor=2.0)
    first: dict[str, str] = {}
    for key in keys:
        (worker,) = router.route([key], totals, totals)
        assert first.setdefault(key, worker) == worker


def test_falls_back_to_the_least_loaded_when_the_preferred_is_full() -> None:
    totals = {"a": 4, "b": 4, "c": 4}
    router = Router("prefix")
    (home,) = router.route(["k"], totals, totals)
    free = dict(totals)
    free[home] = 0  # full now
    others = sorted(w for w in totals if w != home)
    free[others[0]] = 1
    (worker,) = router.route(["k"], {w: n for w, n in free.items() if n > 0}, totals)
    assert worker == others[1], "went to the least loaded worker"
    # ...which is now the key's last server: the next turn follows it there.
    (again,) = router.route(["k"], totals, totals)
    assert again == others[1]


def test_a_worker_at_its_bound_spills_even_with_free_slots() -> None:
    totals = {"a": 10, "b": 10}
    key = next(f"k{i}" for i in range(100) if rendezvous(f"k{i}", totals) == "a")
    router = Router("prefix", load_factor=1.25)
    # a: 6 busy, b: 0. Average with one more: 7/20; a's bound max(ceil(1.25*7*10/20), 5) = 5.
    (worker,) = router.route([key], {"a": 4, "b": 10}, totals)
    assert worker == "b"
    # a: 4 busy (under half its slots): it keeps its key although b is idle.
    (worker,) = Router("prefix", load_factor=1.25).route([key], {"a": 6, "b": 10}, totals)
    assert worker == "a"


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 8), st.data())
def test_worker_death_remaps_only_its_keys(n: int, data: st.DataObject) -> None:
    workers = WORKER_IDS[:n]
    totals = dict.fromkeys(workers, 10_000)
    keys = [f"conversation:{i}" for i in range(200)]
    router = Router("prefix")

    def each(r: Router, live: dict[str, int]) -> dict[str, str]:
        # One at a time on idle workers: the load bound never binds, only affinity shows.
        return {key: r.route([key], live, live)[0] for key in keys}

    before = each(router, totals)
    dead = data.draw(st.sampled_from(workers))
    alive = {w: t for w, t in totals.items() if w != dead}
    after = each(router, alive)
    for key in keys:
        if before[key] != dead:
            assert after[key] == before[key], "a key of a live worker moved"
        else:
            assert after[key] != dead
    # A fresh router (another scheduler replica) agrees: rendezvous hashing, no memory.
    assert each(Router("prefix"), alive) == after


def test_least_loaded_keeps_a_batch_whole_on_the_worker_with_most_room() -> None:
    router = Router("least_loaded")
    assert router.route(["a", "b", "c"], {"x": 2, "y": 5}, {"x": 8, "y": 8}) == ["y"] * 3
    assert router.route(["a"] * 7, {"x": 2, "y": 5}, {"x": 8, "y": 8}) == ["y"] * 5 + ["x"] * 2


def test_a_batch_splits_by_preferred_worker_in_the_policy() -> None:
    limits = TierLimits(max_batch_size=16, max_batch_tokens=10_000, max_wait_ms=0)
    config = PolicyConfig({Tier.interactive: limits, Tier.background: limits})
    policy: Policy[str] = Policy(config, router=Router("prefix", load_factor=2.0))
    workers = [WorkerSlots("a", 8, 8), WorkerSlots("b", 8, 8)]
    keys = [f"k{i}" for i in range(40)]
    home = {k: rendezvous(k, ["a", "b"]) for k in keys}
    chosen = [k for k in keys if home[k] == "a"][:2] + [k for k in keys if home[k] == "b"][:2]
    for k in chosen:
        policy.add(k, tier=Tier.interactive, cost=10, prompt_tokens=5, now=0.0, prefix=k)
    plan = policy.plan(1.0, workers)
    placed = {p.item: d.worker_id for d in plan.dispatches for p in d.passengers}
    assert placed == {k: home[k] for k in chosen}
    assert len(plan.dispatches) == 2  # one batch record per worker


def test_prefix_key_is_the_conversation_or_its_opening() -> None:
    system = ChatMessage(role="system", content="You are terse.")
    first = ChatMessage(role="user", content="hello")
    turn1 = ChatRequest(messages=[system, first])
    turn2 = ChatRequest(
        messages=[
            system,
            first,
            ChatMessage(role="assistant", content="hi"),
            ChatMessage(role="user", content="more"),
        ]
    )
    other = ChatRequest(messages=[system, ChatMessage(role="user", content="bye")])
    assert prefix_key(turn1, "t") == prefix_key(turn2, "t") != prefix_key(other, "t")
    named = ChatRequest(messages=[first], conversation_id="c-1")
    assert prefix_key(named, "t") == prefix_key(ChatRequest(prompt="z", conversation_id="c-1"), "t")
    assert prefix_key(named, "t").startswith("conversation:")
    assert prefix_key(ChatRequest(prompt="x" * 5000), "t") == prefix_key(
        ChatRequest(prompt="x" * 4000 + "y"), "t"
    )


def test_spare_room_is_filled_only_with_riders_that_prefer_that_worker() -> None:
    now = TierLimits(max_batch_size=16, max_batch_tokens=10_000, max_wait_ms=0)
    later = TierLimits(max_batch_size=16, max_batch_tokens=10_000, max_wait_ms=1000)
    config = PolicyConfig({Tier.interactive: now, Tier.background: later}, background_aging_ms=5000)
    policy: Policy[str] = Policy(config, router=Router("prefix", load_factor=2.0))
    workers = [WorkerSlots("a", 8, 8), WorkerSlots("b", 8, 8)]
    keys = [f"k{i}" for i in range(40)]
    to_a = [k for k in keys if rendezvous(k, ["a", "b"]) == "a"]
    to_b = [k for k in keys if rendezvous(k, ["a", "b"]) == "b"]
    policy.add(to_a[0], tier=Tier.interactive, cost=10, prompt_tokens=5, now=0.0, prefix=to_a[0])
    for k in (to_a[1], to_b[0]):  # background, not due: only spare room can take them now
        policy.add(k, tier=Tier.background, cost=10, prompt_tokens=5, now=0.0, prefix=k)
    plan = policy.plan(0.1, workers)
    placed = {p.item: d.worker_id for d in plan.dispatches for p in d.passengers}
    assert placed == {to_a[0]: "a", to_a[1]: "a"}
    assert policy.waiting() == 1  # to_b[0] waits for its own bus, to go to b
    assert policy.router.last_server(to_a[1]) == "a"
