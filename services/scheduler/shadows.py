"""Shadow validation's sampling: which queued requests are also run on their model's gold
variant (ADR 0057).

A request is sampled when its model's rollout has a `shadow`, the variant chosen for it is
not the gold, and a hash of its request_id falls under the shadow's percent: the same
request is sampled or not on every scheduler and every attempt. A sampled request is
marked (`QueuedRequest.shadow_gold`); the worker that answers it queues its gold run.

Never sampled: a pinned request (an eval item, or a gold run itself: `variant` set), a
route's request (`cascade_step` set: its answer may be another model's), and a request of
no model.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from services.scheduler.admission import Waiting
from services.scheduler.variants import Rollouts
from shared.messages import QueuedRequest
from shared.variants import BASELINE, Shadow

_SCALE = 2.0**64


def sampled(request_id: str, percent: float) -> bool:
    """Whether a request falls in a `percent` (0-100) sample, by a hash of its id."""
    if percent <= 0.0:
        return False
    digest = hashlib.blake2b(f"shadow\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE * 100.0 < percent


def gold_for(request: QueuedRequest, shadow: Shadow | None, variant: str | None) -> str | None:
    """The gold variant `request`, chosen to run on `variant` (None: the baseline), is also
    run on; None: not sampled."""
    if shadow is None or request.variant is not None or request.cascade_step is not None:
        return None
    if shadow.gold == (variant or BASELINE):
        return None  # its answer is the gold's own
    return shadow.gold if sampled(request.request_id, shadow.percent) else None


def shadowed(w: Waiting, rollouts: Rollouts, model: str | None, variant: str | None) -> Waiting:
    """`w`, marked with its gold when it is sampled for shadow validation."""
    rollout = None if model is None else rollouts.get(model)
    gold = gold_for(w.request, None if rollout is None else rollout.shadow, variant)
    if gold is None or gold == w.request.shadow_gold:
        return w
    return replace(w, request=w.request.model_copy(update={"shadow_gold": gold}))
