"""Pinned-variant requests on plain values: the request field, where the scheduler places a
pinned request (services/scheduler/pinned.py, models.py), and who may pin over the edge
(services/edge/auth.py, keys.py, `tokenbus keys create --scope`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.edge import keys as keyfile
from services.edge.auth import not_permitted
from services.edge.keys import PIN_VARIANT, KeyStore, Principal
from services.edge.quotas import TenantLimits
from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.pinned import Placement, placement
from services.scheduler.policy import Plan, Policy, WorkerSlots
from services.scheduler.variants import Rollouts
from shared.messages import ChatRequest, ErrorCode, Tier
from shared.variants import ModelRollout, Variant
from tests.factories import openai_chat, queued_request, translated
from tokenbus.cli import main

NOW = 1000.0
MODEL = "m"


def config() -> PolicyConfig:
    return PolicyConfig(
        tiers={t: TierLimits(max_batch_size=4, max_batch_tokens=1000, max_wait_ms=0) for t in Tier},
        background_aging_ms=1000.0,
        fill_from_other_tier=False,
    )


def worker(name: str, variant: str | None, model: str = MODEL) -> WorkerSlots:
    return WorkerSlots(name, 4, 4, model=model, variant=variant)


def add(
    policy: Policy[str],
    name: str,
    variant: str | None,
    *,
    pinned: bool,
    deadline_at: float | None = None,
) -> None:
    added = policy.add(
        name,
        tier=Tier.interactive,
        cost=100,
        prompt_tokens=10,
        now=NOW,
        deadline_at=deadline_at,
        model=MODEL,
        variant=variant,
        pinned=pinned,
    )
    assert added is not None


def where(plan: Plan[str]) -> dict[str, str]:
    return {p.item: d.worker_id for d in plan.dispatches for p in d.passengers}


# -- the request field --------------------------------------------------------------------------


def test_a_pinned_request_is_never_cached_and_an_unpinned_one_says_nothing_of_it() -> None:
    pinned = ChatRequest(prompt="hi", temperature=0, variant="fp8")
    assert not pinned.cacheable
    assert ChatRequest(prompt="hi", temperature=0, variant="baseline").variant == "baseline"
    plain = ChatRequest(prompt="hi", temperature=0)
    assert plain.cacheable
    assert "variant" not in plain.model_dump_json()  # the wire is as before variants


def test_a_variant_that_is_no_variant_name_is_refused() -> None:
    with pytest.raises(ValidationError, match="variant"):
        ChatRequest(prompt="hi", variant="a/b")


def test_the_openai_api_passes_the_variant_on() -> None:
    assert translated(openai_chat(variant="fp8")).variant == "fp8"
    assert translated(openai_chat()).variant is None


# -- where the scheduler places it --------------------------------------------------------------


def test_a_pinned_request_runs_on_its_variant_whatever_the_rollout_says() -> None:
    rollouts = Rollouts()
    rollouts.apply(MODEL, ModelRollout(model=MODEL, variants=[Variant(name="c", percent=100)]))
    assert placement(rollouts, MODEL, "k", None, "small") == Placement("c", False, "small")
    assert placement(rollouts, MODEL, "k", "fp8", "small") == Placement("fp8", True, None)
    assert placement(rollouts, MODEL, "k", "baseline", "small") == Placement(None, True, None)
    assert queued_request(variant="fp8").variant == "fp8"  # the tier record carries it


def test_a_pinned_variant_without_a_live_worker_waits_and_never_goes_to_the_baseline() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "pinned", "fp8", pinned=True, deadline_at=NOW + 5)
    add(policy, "chosen", "fp8", pinned=False)  # chosen by the rollout: moves
    plan = policy.plan(NOW, [worker("base", None)])
    assert where(plan) == {"chosen": "base"}
    assert [(p.item, v) for p, v in plan.to_baseline] == [("chosen", "fp8")]
    assert policy.waiting() == 1
    # Its worker starts in time: it runs there.
    plan = policy.plan(NOW + 1, [worker("base", None), worker("q", "fp8")])
    assert where(plan) == {"pinned": "q"}


def test_a_pinned_request_whose_variant_never_comes_ends_at_its_deadline() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "pinned", "fp8", pinned=True, deadline_at=NOW + 5)
    assert where(policy.plan(NOW + 1, [worker("base", None)])) == {}
    plan = policy.plan(NOW + 5, [worker("base", None)])
    assert [p.item for p in plan.expired] == ["pinned"]
    assert where(plan) == {}


def test_a_pin_to_a_variant_no_worker_declares_is_answered_after_the_unserved_hold() -> None:
    """Issue 37, N3: without a deadline, a pin to a variant no live worker declares was
    held for ever (its tier partition's commit stayed behind it). After the scheduler's
    unserved hold it is answered; the hold runs from when the lane was first seen waiting
    unserved, and the plan wakes for it."""
    policy: Policy[str] = Policy(replace(config(), unserved_hold_s=30.0))
    add(policy, "nope", "no-such-variant", pinned=True)
    add(policy, "fine", None, pinned=False)
    plan = policy.plan(NOW, [worker("base", None)])
    assert where(plan) == {"fine": "base"}
    assert plan.unserved == []
    assert plan.wake_at == NOW + 30.0
    assert policy.plan(NOW + 29, [worker("base", None)]).unserved == []
    plan = policy.plan(NOW + 30, [worker("base", None)])
    assert [(p.item, p.variant, p.pinned) for p in plan.unserved] == [
        ("nope", "no-such-variant", True)
    ]
    assert policy.waiting() == 0


def test_a_lane_served_again_within_the_hold_keeps_its_requests() -> None:
    policy: Policy[str] = Policy(replace(config(), unserved_hold_s=30.0))
    add(policy, "pinned", "fp8", pinned=True)
    assert policy.plan(NOW + 20, [worker("base", None)]).unserved == []
    # A worker of it (full: no slot free) appears: served, so the clock stops...
    busy = WorkerSlots("q", 0, 4, model=MODEL, variant="fp8")
    assert policy.plan(NOW + 25, [worker("base", None), busy]).unserved == []
    # ...and starts again only when it is gone.
    assert policy.plan(NOW + 40, [worker("base", None)]).unserved == []
    assert policy.plan(NOW + 70, [worker("base", None)]).unserved != []


def test_a_request_pinned_to_the_baseline_never_rides_on_a_variant() -> None:
    policy: Policy[str] = Policy(config())
    add(policy, "pinned", None, pinned=True)
    assert where(policy.plan(NOW, [worker("q", "fp8")])) == {}
    assert where(policy.plan(NOW, [worker("q", "fp8"), worker("base", None)])) == {"pinned": "base"}


# -- who may pin over the edge ------------------------------------------------------------------


def principal(*scopes: str) -> Principal:
    return Principal("acme", "k-00000000", "0" * 64, TenantLimits(), frozenset(scopes))


def test_only_a_key_with_the_pin_variant_scope_may_pin() -> None:
    pinned = ChatRequest(prompt="hi", variant="fp8", client_id="c1")
    refused = not_permitted(principal(), pinned)
    assert refused is not None
    assert refused.code is ErrorCode.invalid_request
    assert refused.client_id == "c1"
    assert refused.message.startswith("variant: this API key may not pin a variant")
    assert not_permitted(principal(PIN_VARIANT), pinned) is None
    assert not_permitted(principal(), ChatRequest(prompt="hi")) is None


def test_keys_create_scope_reaches_the_edges_principal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    args = ["keys", "--file", str(path), "create", "--tenant", "acme"]
    assert main([*args, "--scope", PIN_VARIANT]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(args) == 0
    plain = capsys.readouterr().out.strip().splitlines()[-1]
    store = KeyStore(path)
    found, other = store.lookup(key), store.lookup(plain)
    assert found is not None
    assert other is not None
    assert found.scopes == {PIN_VARIANT}
    assert other.scopes == frozenset()
    assert [e.scopes for e in keyfile.load(path).keys] == [[PIN_VARIANT], []]
    assert main(["keys", "--file", str(path), "list"]) == 0
    assert f"scopes={PIN_VARIANT}" in capsys.readouterr().out


def test_an_unknown_scope_is_refused_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    with pytest.raises(SystemExit) as exited:
        main(["keys", "--file", str(path), "create", "--tenant", "acme", "--scope", "admin"])
    assert exited.value.code == 2
    assert "invalid choice: 'admin'" in capsys.readouterr().err
    assert not path.exists()
