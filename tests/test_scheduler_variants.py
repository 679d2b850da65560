"""Variants in the scheduler, on plain values: the rollouts it follows (services/scheduler/
variants.py) and how the policy places a variant's requests (models.py, policy.py)."""

from __future__ import annotations

import dataclasses

from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.policy import Plan, Policy, WorkerSlots
from services.scheduler.variants import RolloutReader, Rollouts
from shared.kafka import encode
from shared.messages import Tier
from shared.variants import ModelRollout, Variant, choose
from tests.factories import consumer_record

INT = Tier.interactive
NOW = 1000.0
MODEL = "m"


def config() -> PolicyConfig:
    return PolicyConfig(
        tiers={t: TierLimits(max_batch_size=4, max_batch_tokens=1000, max_wait_ms=0) for t in Tier},
        background_aging_ms=1000.0,
        fill_from_other_tier=False,
    )


def worker(name: str, variant: str | None, free: int = 4, model: str = MODEL) -> WorkerSlots:
    return WorkerSlots(name, free, 4, model=model, variant=variant)


def add(policy: Policy[str], name: str, variant: str | None, model: str | None = MODEL) -> None:
    added = policy.add(
        name, tier=INT, cost=100, prompt_tokens=10, now=NOW, model=model, variant=variant
    )
    assert added is not None


def where(plan: Plan[str]) -> dict[str, str]:
    return {p.item: d.worker_id for d in plan.dispatches for p in d.passengers}


# -- placing a variant's requests ---------------------------------------------------------------


def test_each_variant_goes_only_to_its_own_workers() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "b1", None)
    add(policy, "c1", "canary")
    add(policy, "b2", None)
    add(policy, "c2", "canary")
    plan = policy.plan(NOW, [worker("base", None), worker("can", "canary")])
    assert where(plan) == {"b1": "base", "b2": "base", "c1": "can", "c2": "can"}
    assert plan.to_baseline == []


def test_a_full_variant_keeps_its_requests_and_lends_no_room() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "c1", "canary")
    add(policy, "b1", None)
    plan = policy.plan(NOW, [worker("base", None), worker("can", "canary", free=0)])
    assert where(plan) == {"b1": "base"}  # c1 waits for its variant's slot
    assert plan.to_baseline == []
    assert policy.waiting() == 1
    # Nor does the baseline's work ride on the canary's room.
    add(policy, "b2", None)
    plan = policy.plan(NOW, [worker("base", None, free=0), worker("can", "canary")])
    assert where(plan) == {"c1": "can"}


def test_a_variant_without_a_live_worker_falls_back_to_the_baseline() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "c1", "canary")
    add(policy, "c2", "canary")
    plan = policy.plan(NOW, [worker("base", None)])
    assert where(plan) == {"c1": "base", "c2": "base"}
    assert sorted((p.item, v) for p, v in plan.to_baseline) == [
        ("c1", "canary"),
        ("c2", "canary"),
    ]


def test_without_any_live_worker_of_the_model_a_variant_waits_for_its_own() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "c1", "canary")
    plan = policy.plan(NOW, [worker("other", None, model="other-model")])
    assert where(plan) == {}
    assert plan.to_baseline == []
    plan = policy.plan(NOW, [worker("can", "canary")])  # its worker has started
    assert where(plan) == {"c1": "can"}


def test_a_request_of_no_model_never_rides_on_a_variant() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "any", None, model=None)
    plan = policy.plan(NOW, [worker("can", "canary")])
    assert where(plan) == {}
    plan = policy.plan(NOW, [worker("can", "canary"), worker("base", None)])
    assert where(plan) == {"any": "base"}


# -- the rollouts it follows --------------------------------------------------------------------


def rollout(percent: float, model: str = MODEL) -> ModelRollout:
    return ModelRollout(model=model, variants=[Variant(name="canary", percent=percent)])


def test_rollouts_choose_by_the_models_shares() -> None:
    rollouts = Rollouts()
    assert rollouts.variant_of(MODEL, "k") is None  # no rollout: the baseline
    rollouts.apply(MODEL, rollout(100))
    assert rollouts.variant_of(MODEL, "k") == "canary"
    assert rollouts.variant_of(None, "k") is None
    assert rollouts.variant_of("other", "k") is None
    rollouts.apply(MODEL, rollout(30))
    keys = [f"k{i}" for i in range(200)]
    assert [rollouts.variant_of(MODEL, k) for k in keys] == [
        choose(k, {None: 70.0, "canary": 30.0}) for k in keys
    ]
    rollouts.apply(MODEL, None)
    assert rollouts.variant_of(MODEL, "k") is None


def reader(rollouts: Rollouts, seen: list[ModelRollout]) -> RolloutReader:
    # `_take` reads no Kafka: the consumer and admin client are never used here.
    return RolloutReader(None, rollouts, None, "t.variants", seen.append)


def test_the_reader_applies_rollouts_and_tombstones() -> None:
    rollouts, seen = Rollouts(), list[ModelRollout]()
    r = reader(rollouts, seen)
    record = consumer_record("t.variants", encode(rollout(25)), key=MODEL.encode())
    assert r._take(record) is None
    taken = rollouts.get(MODEL)
    assert taken is not None
    assert taken.weights() == {None: 75.0, "canary": 25.0}
    assert [s.model for s in seen] == [MODEL]
    assert r._take(dataclasses.replace(record, value=None)) is None
    assert rollouts.get(MODEL) is None


def test_the_reader_refuses_what_it_cannot_use() -> None:
    rollouts, seen = Rollouts(), list[ModelRollout]()
    r = reader(rollouts, seen)
    bad = [
        (consumer_record("t", b"{not json", key=b"m"), "Invalid JSON"),
        (consumer_record("t", encode(rollout(25)), key=None), "needs its model name as key"),
        (consumer_record("t", encode(rollout(25, model="x")), key=b"m"), "is not the record's"),
        (
            consumer_record(
                "t", b'{"model":"m","variants":[{"name":"a","percent":101}]}', key=b"m"
            ),
            "less than or equal to 100",
        ),
    ]
    for record, why in bad:
        problem = r._take(record)
        assert problem is not None
        assert why in problem, (problem, why)
    assert rollouts.get(MODEL) is None
    assert seen == []
