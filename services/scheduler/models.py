"""Models and fallback: which workers serve a lane, which models are unknown, when to fall back.

Pure: worker slots and the clock in, decisions out. The policy asks `serves` for a lane's
candidate workers and `falls_back` (with `estimated_finish`) whether a waiting request
moves to its fallback model; the scheduler shell asks `ModelCheck.unknown` before it
refuses a lane's requests with `invalid_request`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import Protocol


class ServingWorker(Protocol):
    """What this module reads of a worker (`policy.WorkerSlots`)."""

    @property
    def free(self) -> int: ...

    @property
    def total(self) -> int: ...

    @property
    def model(self) -> str | None: ...

    @property
    def service_s(self) -> float | None: ...


def serves(worker_model: str | None, lane_model: str | None) -> bool:
    """Whether a worker may take a lane's requests: a lane without a model takes any worker."""
    return lane_model is None or worker_model == lane_model


@dataclass(frozen=True)
class ModelLoad:
    """One model's live workers, as a plan sees them."""

    free: int  # slots free now
    total: int  # slots in all
    service_s: float | None  # how long one request holds a slot (measured); None: unknown

    @classmethod
    def of(cls, workers: Iterable[ServingWorker], model: str | None) -> ModelLoad:
        mine = [w for w in workers if serves(w.model, model)]
        times = [w.service_s for w in mine if w.service_s is not None]
        return cls(
            free=sum(w.free for w in mine),
            total=sum(w.total for w in mine),
            service_s=sum(times) / len(times) if times else None,
        )


def estimated_finish(now: float, ahead: int, load: ModelLoad) -> float | None:
    """When a request with `ahead` requests queued before it on a model would finish.

    The free slots take the first requests now; the rest go in waves of `total` slots,
    each wave one service time long (a request waits for whole waves: the slots it waits
    for free up one service time after they were taken, on average a bit less, so this
    errs late). Infinite if the model has no live worker; None if it is unknown (no
    request has finished on the model yet, and this one would have to wait).
    """
    if load.total <= 0:
        return math.inf
    if load.service_s is None:
        return None
    waves = 0 if ahead < load.free else (ahead - load.free) // load.total + 1
    return now + (waves + 1) * load.service_s


def falls_back(deadline_at: float | None, primary: float | None, fallback: float | None) -> bool:
    """Whether a request runs on its fallback model instead of its primary.

    Only when the primary's estimate misses the deadline, and the fallback is no worse
    (an unknown fallback estimate counts as better: its workers have not finished
    anything yet, so they are likely idle). Without a deadline, or with an unknown
    primary estimate, the request keeps its model.
    """
    if deadline_at is None or primary is None or primary <= deadline_at:
        return False
    return fallback is None or fallback < primary


@dataclass(frozen=True)
class ModelCheck:
    """Which named models a scheduler refuses as unknown.

    A scheduler that has just started may not have heard every worker's heartbeat yet:
    it refuses nothing before `grace_s` after `listening_since`.
    """

    listening_since: float
    grace_s: float

    def unknown(self, model: str | None, known: Set[str], now: float) -> bool:
        if model is None or model in known:
            return False
        return now >= self.listening_since + self.grace_s
