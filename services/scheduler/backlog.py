"""The scheduler's backlog: waiting requests in lanes (tier, length bucket, model, variant),
shared fairly.

A lane's bus leaves by its oldest request (arrival order); who rides it is decided by fair
share between the lane's tenants (`fairness.FairQueue`), oldest first within a tenant.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from services.scheduler.fairness import FairQueue
from services.scheduler.limits import PolicyConfig, TierLimits
from shared.messages import Tier

T = TypeVar("T")

# How many requests that do not fit the token budget a batch skips before it stops
# looking: bounds the work per batch while still letting small requests pass a big one.
FIRST_FIT_SCAN = 64
# The tenant of a request that names none (shared/messages.py RequestRecord's default).
DEFAULT_TENANT = "default"
# Weight of the newest gap in the arrival-rate estimate (exponential moving average).
RATE_SMOOTHING = 0.2


class LaneKey(NamedTuple):
    tier: Tier
    bucket: int
    model: str | None = None  # the model its requests run on; None: any worker
    variant: str | None = None  # the model's variant (shared/variants.py); None: its baseline


@dataclass(slots=True, eq=False)
class Passenger(Generic[T]):
    """One waiting request: the payload and what the policy decides on."""

    item: T
    tier: Tier
    cost: int  # prompt tokens + max_tokens
    prompt_tokens: int
    arrived: float
    deadline_at: float | None
    number: int  # arrival order, unique per backlog
    tenant: str = DEFAULT_TENANT  # whose fair share it rides on
    model: str | None = None  # the model it runs on (its lane's); None: any
    fallback: str | None = None  # the model it may run on instead (models.py)
    prefix: str | None = None  # prefix key (shared/prefixes.py): prefix-affinity routing
    variant: str | None = None  # the variant of `model` it runs on; None: the baseline
    pinned: bool = False  # its variant was named by the request: it never moves off it


class Lane(Generic[T]):
    """Requests of one tier and length bucket: in arrival order, and in per-tenant queues."""

    def __init__(
        self,
        key: LaneKey,
        limits: TierLimits,
        fair: FairQueue[Passenger[T]] | None = None,
    ) -> None:
        self.key = key
        self.limits = limits
        self.tokens = 0
        self.fair: FairQueue[Passenger[T]] = FairQueue({}, FIRST_FIT_SCAN) if fair is None else fair
        self._items: OrderedDict[int, Passenger[T]] = OrderedDict()
        self._deadlines: list[tuple[float, int]] = []  # lazy min-heap
        self.last_arrival: float | None = None
        self.mean_gap: float | None = None  # seconds between arrivals, smoothed

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Passenger[T]]:
        return iter(self._items.values())

    def head(self) -> Passenger[T]:
        return next(iter(self._items.values()))

    def add(self, p: Passenger[T]) -> None:
        self._items[p.number] = p
        self.fair.add(p)
        self.tokens += p.cost
        if p.deadline_at is not None:
            heapq.heappush(self._deadlines, (p.deadline_at, p.number))
        if self.last_arrival is not None:
            gap = max(0.0, p.arrived - self.last_arrival)
            self.mean_gap = (
                gap
                if self.mean_gap is None
                else (1 - RATE_SMOOTHING) * self.mean_gap + RATE_SMOOTHING * gap
            )
        self.last_arrival = p.arrived

    def remove(self, p: Passenger[T]) -> None:
        if self._items.pop(p.number, None) is not None:
            self.fair.remove(p)
            self.tokens -= p.cost

    def earliest_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._items:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def select(
        self,
        limit: int,
        token_budget: int,
        admit: Callable[[Passenger[T]], bool] | None = None,
    ) -> list[Passenger[T]]:
        """Up to `limit` requests within `token_budget`; nothing is removed.

        Fair share first (the tenant with the fewest tokens per weight served), oldest
        first within a tenant. First fit: a request that does not fit the remaining budget
        is passed over (it stays at the front for the next batch), so small requests behind
        it can still ride. `admit` stops a tenant's scan at the first request it rejects
        (used to take only the aged prefix of a lane).
        """
        return self.fair.select(limit, token_budget, admit)

    def discard(self, passengers: list[Passenger[T]]) -> None:
        for p in passengers:
            del self._items[p.number]
            self.fair.charge(p)
            self.tokens -= p.cost


class Backlog(Generic[T]):
    """Every waiting request of one scheduler, by lane; expires requests past deadline."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.lanes: dict[LaneKey, Lane[T]] = {}
        self._numbers = itertools.count()
        self._deadlines: list[tuple[float, int, LaneKey]] = []  # lazy min-heap
        self._where: dict[int, Passenger[T]] = {}
        self._movable: dict[int, Passenger[T]] = {}  # those that may fall back

    def __len__(self) -> int:
        return len(self._where)

    def lane_of(
        self, tier: Tier, prompt_tokens: int, model: str | None = None, variant: str | None = None
    ) -> LaneKey:
        if self.config.batching == "pack":
            return LaneKey(tier, 0, model, variant)
        return LaneKey(tier, bisect_left(self.config.bucket_edges, prompt_tokens), model, variant)

    def add(
        self,
        item: T,
        *,
        tier: Tier,
        cost: int,
        prompt_tokens: int,
        now: float,
        deadline_at: float | None = None,
        tenant: str = DEFAULT_TENANT,
        model: str | None = None,
        fallback: str | None = None,
        prefix: str | None = None,
        variant: str | None = None,
        pinned: bool = False,
    ) -> Passenger[T]:
        key = self.lane_of(tier, prompt_tokens, model, variant)
        number = next(self._numbers)
        p = Passenger(
            item,
            tier,
            cost,
            prompt_tokens,
            now,
            deadline_at,
            number,
            tenant,
            model=model,
            fallback=fallback,
            prefix=prefix,
            variant=variant,
            pinned=pinned,
        )
        self._enter(key, p)
        return p

    def _enter(self, key: LaneKey, p: Passenger[T]) -> None:
        lane = self.lanes.get(key)
        if lane is None:
            fair: FairQueue[Passenger[T]] = FairQueue(
                self.config.tenant_weights, FIRST_FIT_SCAN, fair=self.config.fair_share
            )
            lane = self.lanes[key] = Lane(key, self.config.tiers[p.tier], fair)
        lane.add(p)
        self._where[p.number] = p
        if p.fallback is not None:
            self._movable[p.number] = p
        if p.deadline_at is not None:
            heapq.heappush(self._deadlines, (p.deadline_at, p.number, key))

    def move(self, p: Passenger[T], model: str) -> None:
        """Move a waiting request to its lane on another model (its fallback), once.

        It keeps its arrival time and number, so it waits no longer there than it had here.
        It runs on the fallback model's baseline.
        """
        self.remove(p)
        p.model, p.fallback, p.variant = model, None, None
        self._enter(self.lane_of(p.tier, p.prompt_tokens, model), p)

    def to_baseline(self, p: Passenger[T]) -> None:
        """Move a waiting request to its model's baseline lane (its variant has no worker).

        It keeps its arrival time and number, as `move` does.
        """
        self.remove(p)
        p.variant = None
        self._enter(self.lane_of(p.tier, p.prompt_tokens, p.model), p)

    def select(
        self,
        key: LaneKey,
        limit: int,
        token_budget: int,
        admit: Callable[[Passenger[T]], bool] | None = None,
    ) -> list[Passenger[T]]:
        return self.lanes[key].select(limit, token_budget, admit)

    def discard(self, key: LaneKey, passengers: list[Passenger[T]]) -> None:
        """Remove passengers chosen by `select` on the same lane (they ride now)."""
        self.lanes[key].discard(passengers)
        for p in passengers:
            del self._where[p.number]
            self._movable.pop(p.number, None)

    def movable(self) -> list[Passenger[T]]:
        """Waiting requests that may still move to a fallback model."""
        return list(self._movable.values())

    def take(self, key: LaneKey, limit: int, token_budget: int) -> list[Passenger[T]]:
        taken = self.select(key, limit, token_budget)
        self.discard(key, taken)
        return taken

    def remove(self, p: Passenger[T]) -> None:
        self._movable.pop(p.number, None)
        if self._where.pop(p.number, None) is not None:
            self.lanes[self.lane_of(p.tier, p.prompt_tokens, p.model, p.variant)].remove(p)

    def passengers(self) -> list[Passenger[T]]:
        """Every waiting request, in no particular order."""
        return list(self._where.values())

    def remove_where(self, predicate: Callable[[T], bool]) -> list[Passenger[T]]:
        """Drop every waiting request whose payload matches (e.g. a revoked partition's)."""
        gone = [p for p in self._where.values() if predicate(p.item)]
        for p in gone:
            self.remove(p)
        return gone

    def expire(self, now: float) -> list[Passenger[T]]:
        """Remove and return every request whose deadline is at or before `now`."""
        out: list[Passenger[T]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, number, _ = heapq.heappop(self._deadlines)
            p = self._where.get(number)
            if p is not None:
                self.remove(p)
                out.append(p)
        return out

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._where:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def busy_lanes(self) -> list[Lane[T]]:
        return [lane for lane in self.lanes.values() if len(lane)]

    def waiting(self, tier: Tier) -> int:
        return sum(len(lane) for key, lane in self.lanes.items() if key.tier is tier)
