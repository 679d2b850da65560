"""Pinned-variant requests: a request that names its `variant` runs on that variant of its
model, not on the one its rollout would choose (shared/variants.py).

What pins: an offline evaluation (`tokenbus eval`) running a set on each variant it compares,
and a shadow run on the gold variant. Either wants the named variant's answer or none, so a
pinned request never moves: not to the baseline when its variant has no live worker
(models.py `to_baseline`), nor to a fallback model. It waits for a worker of its variant
while its deadline allows, then ends `deadline_exceeded`; and never longer than the
scheduler's unserved hold (TOKENBUS_SCHEDULER_UNSERVED_HOLD_S, models.py `unserved`) without
a live worker of it, then ends `overloaded` (issue 37, N3: a pin to a variant no worker
declares was held for ever, its tier partition's commit behind it). It is never answered from the
response cache nor stored there (`ChatRequest.cacheable`). Who may pin: any writer of the
requests topic (trusted), and over the edge only keys with the `pin_variant` scope.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.variants import Rollouts
from shared.variants import BASELINE


@dataclass(frozen=True)
class Placement:
    """Where a request waits: the variant of its model it runs on (None: the baseline),
    whether the request named it, and the model it may fall back to (None: none)."""

    variant: str | None
    pinned: bool
    fallback: str | None


def placement(
    rollouts: Rollouts, model: str | None, key: str, pinned: str | None, fallback: str | None
) -> Placement:
    """Where a request of `model` with conversation key `key` runs: on `pinned` (the
    request's own `variant` field; 'baseline' names the baseline) when it names one, with
    no fallback; else on the variant its model's rollout chooses for the key, with
    `fallback` (its own or its tier's fallback model)."""
    if pinned is not None:
        return Placement(None if pinned == BASELINE else pinned, pinned=True, fallback=None)
    return Placement(rollouts.variant_of(model, key), pinned=False, fallback=fallback)
