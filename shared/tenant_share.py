"""No one tenant above a share of a canary's evidence (issue 37, N7).

A canary's verdict (services/scheduler/canary.py) rests on the outcomes its workers count and
on the shadow scores of its sampled requests. Traffic is the tenants', so a tenant sending
most of a window could decide it: flood the canary with answers that fail or score badly
(and have it rolled back), or with easy ones (and keep a regression in). Here, beside
`others` items of every other tenant, one tenant's items count up to
`share / (1 - share) * others`, its share of what counts then at most `share`, and always
up to `floor`. A tenant alone (no other's item beside its own) counts whole: a deployment
with one tenant judges its canaries as before. `share` 1 counts everything.

Two forms of the same rule: a worker counts as requests end (services/worker/outcomes.py,
with `allowance`: its counts are cumulative, as heartbeats carry them, so one past the
allowance counts later or never), a scheduler caps a window of scores (`capped`: each
tenant's oldest beyond its allowance left out). Pure.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

SLICE_S = 10.0  # a worker's slice: a canary window (60 s by default) spans several


def allowance(share: float, others: int, floor: int) -> int | float:
    """How many of one tenant's items count beside `others` of everyone else's."""
    if share >= 1.0 or others == 0:
        return math.inf
    return max(floor, math.floor(share / (1.0 - share) * others))


def capped(items: Sequence[T], tenant_of: Callable[[T], str], share: float, floor: int) -> list[T]:
    """`items` (oldest first) less each tenant's oldest beyond its allowance, in order."""
    per = Counter(tenant_of(item) for item in items)
    drop = {t: n - allowance(share, len(items) - n, floor) for t, n in per.items()}
    out: list[T] = []
    for item in items:
        tenant = tenant_of(item)
        if drop[tenant] > 0:
            drop[tenant] -= 1
            continue
        out.append(item)
    return out
