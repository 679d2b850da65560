"""Models and fallback: which workers serve a lane, which models are unknown, when to fall back.

Pure: worker slots and the clock in, decisions out. The policy asks `serves` for a lane's
candidate workers and `fall_back` which waiting requests move to their fallback model
(each decided by `estimated_finish` and `falls_back`); the scheduler shell asks
`ModelCheck.unknown` before it refuses a lane's requests with `invalid_request` (known: a
model a known worker serves, or one of `served_models`, which are held while cold:
cold_start.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Protocol, TypeVar

from services.scheduler.backlog import Backlog, LaneKey, Passenger
from shared.messages import Tier

T = TypeVar("T")


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


# A worker's model and the variant of it that it runs (None: the model's baseline).
Serving = tuple[str | None, str | None]


def serves_lane(worker: Serving | None, lane: LaneKey) -> bool:
    """Whether a worker (its model and variant; None: unknown) may take a lane's requests:
    of the lane's model (`serves`), and only of the lane's variant, so that a variant takes
    just the conversations chosen for it and a baseline lane only baseline workers."""
    if worker is None:
        return False
    model, variant = worker
    return serves(model, lane.model) and variant == lane.variant


def to_baseline(backlog: Backlog[T], live: Iterable[Serving]) -> list[tuple[Passenger[T], str]]:
    """Move the waiting requests of each variant without a live worker to their model's
    baseline, where that has one; return those moved, each with the variant it left
    (ADR 0054).

    `live`: every live worker's model and variant (full ones too: a variant whose workers
    are busy keeps its requests). Where neither has a live worker, the requests wait on
    their variant (its worker may be starting). A request pinned to its variant (its own
    `variant` field) never moves: it waits for the variant's worker until its deadline.
    """
    serving = set(live)
    out: list[tuple[Passenger[T], str]] = []
    for lane in backlog.busy_lanes():
        key = lane.key
        if key.variant is None or any(serves_lane(w, key) for w in serving):
            continue
        if not any(serves_lane(w, key._replace(variant=None)) for w in serving):
            continue
        for p in list(lane):
            if p.pinned:
                continue
            backlog.to_baseline(p)
            out.append((p, key.variant))
    return out


def unserved(
    backlog: Backlog[T],
    live: Iterable[Serving],
    now: float,
    since: dict[LaneKey, float],
    hold_s: float,
) -> list[Passenger[T]]:
    """Remove and return the waiting requests of each lane no live worker has served for
    `hold_s` (`since`: when each lane was first seen waiting unserved, kept by the caller;
    a lane served again is forgotten). Not moved, and not held for ever: answered."""
    serving = set(live)
    out: list[Passenger[T]] = []
    waiting = set()
    for lane in backlog.busy_lanes():
        key = lane.key
        if any(serves_lane(w, key) for w in serving):
            continue
        waiting.add(key)
        if now - since.setdefault(key, now) < hold_s:
            continue
        for p in list(lane):
            backlog.remove(p)
            out.append(p)
    for key in [k for k in since if k not in waiting]:
        del since[key]
    return out


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


def fall_back(
    backlog: Backlog[T], now: float, workers: Sequence[ServingWorker]
) -> list[Passenger[T]]:
    """Move each waiting request that may fall back, and whose deadline its model's backlog
    would miss, to its fallback model's lane; return those moved (once per request).

    Who is ahead of a request on its model: the model's waiting requests of a better tier,
    then those of its own tier that arrived before it. Requests that would meet their
    deadline even behind everything waiting on their model are passed over cheaply; only
    for the rest is the model's queue ordered.
    """
    movable = [p for p in backlog.movable() if p.deadline_at is not None]
    if not movable:
        return []
    lanes: dict[str | None, list[Passenger[T]]] = {}
    for lane in backlog.busy_lanes():
        lanes.setdefault(lane.key.model, []).extend(lane)
    loads: dict[str | None, ModelLoad] = {}

    def load_of(model: str | None) -> ModelLoad:
        if model not in loads:
            loads[model] = ModelLoad.of(workers, model)
        return loads[model]

    queues: dict[str | None, list[tuple[int, int]]] = {}  # model -> (rank, number), sorted

    def queue_of(model: str | None) -> list[tuple[int, int]]:
        if model not in queues:
            queues[model] = sorted((_rank(p.tier), p.number) for p in lanes.get(model, []))
        return queues[model]

    moved: dict[str, int] = {}  # requests moved to a model in this plan
    out: list[Passenger[T]] = []
    for p in sorted(movable, key=lambda p: p.number):
        target = p.fallback
        assert target is not None, "only requests with a fallback are movable"
        load = load_of(p.model)
        worst = estimated_finish(now, len(lanes.get(p.model, [])), load)
        if worst is None or (p.deadline_at is not None and worst <= p.deadline_at):
            continue  # unknown, or met even behind everyone: no need to count
        ahead = bisect.bisect_left(queue_of(p.model), (_rank(p.tier), p.number))
        primary = estimated_finish(now, ahead, load)
        waiting_there = len(lanes.get(target, [])) + moved.get(target, 0)
        fallback = estimated_finish(now, waiting_there, load_of(target))
        if falls_back(p.deadline_at, primary, fallback):
            backlog.move(p, target)
            moved[target] = moved.get(target, 0) + 1
            out.append(p)
    return out


def _rank(tier: Tier) -> int:
    return 0 if tier is Tier.interactive else 1


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
        return self.settled(now)

    def settled(self, now: float) -> bool:
        """Whether every live worker has been heard by now: before, a model may only seem
        unknown, or without a live worker (cold_start.py)."""
        return now >= self.listening_since + self.grace_s
