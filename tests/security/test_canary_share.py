"""Issue 37, N7: one tenant's traffic cannot outweigh every other tenant's in a canary's
verdict.

Before: every finished request counted in its worker's outcomes and every shadow score in
its window, whoever sent it. A tenant flooding the canary with easy answers (short prompts,
no failures, quick first tokens, answers the gold agrees with) diluted the regression that
other tenants' requests showed, and the canary stayed out. Now no tenant counts past
`canary_tenant_share` (0.5) of the evidence beside others (shared/tenant_share.py): a
regression seen by the other tenants shows at half its strength at least.

The attack is sent as the worker and the scheduler meet it: the worker's own outcome counts
(`OutcomeCounts`, with the settings a worker starts with) carried by heartbeats, the
scheduler's own windows and judge (`CanaryWindows`, `judge`). With `canary_tenant_share` 1
(the old behaviour) each test's verdict is the attacker's.
"""

from __future__ import annotations

import pytest

from services.scheduler.canary import CanaryWindows, judge
from services.scheduler.settings import SchedulerSettings
from services.worker.outcomes import OutcomeCounts
from shared.messages import ErrorCode
from shared.tenant_share import SLICE_S, allowance, capped
from shared.verdicts import VariantEvidence
from tests.test_canary import MODEL, REQUEST, RULE, T0, FakeWorker, done, error, shadow_score

DEFAULTS = SchedulerSettings()
SHARE, FLOOR = DEFAULTS.canary_tenant_share, DEFAULTS.canary_tenant_floor
VICTIMS = ("acme", "globex", "initech")
ATTACKER = "mallory"


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Worker(FakeWorker):
    """A worker of `variant` counting as a worker does (`OutcomeCounts` with a tenant
    share), its beats as a worker sends them."""

    def __init__(self, name: str, variant: str | None, share: float, clock: Clock) -> None:
        super().__init__(name, variant)
        self.clock = clock
        self.counts = OutcomeCounts(share, FLOOR, clock)

    def finish(self, tenant: str, failed: bool = False) -> None:
        request = REQUEST.model_copy(update={"tenant": tenant})
        self.counts.record(request, error(ErrorCode.internal) if failed else done(0.03))

    def send(self, windows: CanaryWindows) -> None:
        windows.beat(self.beat(self.clock.now), self.clock.now)


def verdict(windows: CanaryWindows, now: float) -> VariantEvidence:
    found = judge(RULE, MODEL, ["c"], windows, now, "s1").of("c")
    assert found is not None
    return found


def errors_hidden_by_a_flood(share: float) -> VariantEvidence:
    """30 s: the victims' requests fail one in five on the canary (an engine regression);
    the attacker sends 100 quick answers a second through the canary beside them."""
    clock = Clock()
    windows = CanaryWindows(RULE.window_s, share, FLOOR)
    base, canary = Worker("w-base", None, share, clock), Worker("w-canary", "c", share, clock)
    for second in range(31):
        clock.now = T0 + second
        base.send(windows)
        canary.send(windows)
        for i, tenant in enumerate(VICTIMS * 2):
            base.finish(tenant)
            canary.finish(tenant, failed=(second * 6 + i) % 5 == 0)
        for _ in range(100):
            canary.finish(ATTACKER)
    clock.now = T0 + 31  # the last beats
    base.send(windows)
    canary.send(windows)
    return verdict(windows, clock.now)


def test_a_flood_of_easy_answers_does_not_hide_a_canarys_errors() -> None:
    assert errors_hidden_by_a_flood(1.0).verdict == "ok"  # before: the flood hid them
    found = errors_hidden_by_a_flood(SHARE)
    assert found.regressed == ["errors"]
    assert found.error_rate is not None
    assert found.error_rate >= 0.2 * (1 - SHARE)


def scores_hidden_by_a_flood(share: float) -> VariantEvidence:
    """The canary's answers to the victims agree with the gold's half the time; the
    attacker's 300 (prompts whose answers any model gets right) every time."""
    windows = CanaryWindows(RULE.window_s, share, FLOOR)
    now = T0 + 30
    for i in range(30):
        windows.score(shadow_score(None, 1.0, T0 + i, tenant=VICTIMS[i % 3]), now)
        windows.score(shadow_score("c", float(i % 2), T0 + i, tenant=VICTIMS[i % 3]), now)
    for i in range(300):
        windows.score(shadow_score("c", 1.0, T0 + i * 0.1, tenant=ATTACKER), now)
    _answered_everywhere(windows, now)
    return verdict(windows, now)


def test_a_flood_of_easy_scores_does_not_hide_a_worse_answering_canary() -> None:
    assert scores_hidden_by_a_flood(1.0).verdict == "ok"  # before: 300 of 330 agreed
    found = scores_hidden_by_a_flood(SHARE)
    assert found.regressed == ["quality"]
    assert found.quality is not None
    assert found.quality <= 0.5 + SHARE * 0.5


def test_a_tenant_alone_counts_whole_and_beside_others_at_most_its_share() -> None:
    """As requests end, never later: a heartbeat carries them at once. Counted is never
    taken back, so a tenant alone counts whole; beside another, up to the allowance, and
    more as the other's requests grow."""
    clock = Clock()
    counts = OutcomeCounts(SHARE, FLOOR, clock)
    mine = REQUEST.model_copy(update={"tenant": ATTACKER})
    theirs = REQUEST.model_copy(update={"tenant": "acme"})
    for _ in range(100):
        counts.record(mine, done(0.03))
    assert counts.snapshot().answered == 100  # alone: a deployment of one tenant, as before
    clock.now += SLICE_S  # a new slice: the other tenant is there first this time
    counts.record(theirs, done(0.03))
    for _ in range(100):
        counts.record(mine, done(0.03))
    assert counts.snapshot().answered == 100 + 1 + FLOOR  # beside one: the floor
    for _ in range(20):
        counts.record(theirs, done(0.03))
    assert counts.snapshot().answered == 100 + 21 + 21  # as many as the other's, now


@pytest.mark.parametrize("others", [0, 1, 10, 1000])
def test_the_allowance_keeps_a_tenant_at_its_share_above_the_floor(others: int) -> None:
    mine = allowance(SHARE, others, FLOOR)
    if others == 0:
        assert mine == float("inf")
    else:
        assert mine >= FLOOR
        assert mine <= FLOOR or mine / (mine + others) <= SHARE


def test_capped_drops_each_tenants_oldest_and_keeps_the_order() -> None:
    items = [("a", 0), ("b", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 5)]
    assert capped(items, lambda item: item[0], 0.5, 0) == [("b", 1), ("a", 3), ("a", 4), ("b", 5)]
    assert capped(items, lambda item: item[0], 1.0, 0) == items


def _answered_everywhere(windows: CanaryWindows, now: float) -> None:
    """Enough plain answers on both sides that only quality can decide."""
    clock = Clock()
    clock.now = now - 20
    base, canary = Worker("w-base", None, 1.0, clock), Worker("w-canary", "c", 1.0, clock)
    base.send(windows)
    canary.send(windows)
    for _ in range(RULE.min_requests):
        base.finish("acme")
        canary.finish("acme")
    clock.now = now - 1
    base.send(windows)
    canary.send(windows)
