"""The batching policy: given the backlog, the clock and the workers' free slots, what leaves now.

Tiers are served by rank (aged background, interactive, background); inside a lane, who
rides is fair share between tenants (backlog.py, fairness.py).

Pure: no Kafka, no clock of its own. The scheduler process calls `add` for every request
it reads and `plan(now, workers)` whenever something changed or `Plan.wake_at` came.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from services.scheduler.backlog import DEFAULT_TENANT, Backlog, Lane, LaneKey, Passenger
from services.scheduler.departure import DepartureRule, DispatchReason, FixedRule
from services.scheduler.limits import PolicyConfig
from services.scheduler.models import Serving, fall_back, serves_lane, to_baseline, unserved
from services.scheduler.routing import Router
from shared.messages import Tier

T = TypeVar("T")

# Lane ranks, lowest first: aged background outranks interactive (the starvation bound),
# interactive outranks the rest of background.
AGED, INTERACTIVE, BACKGROUND = 0, 1, 2
# Weight of one dispatched request in the background share (an exponential moving
# average over roughly the last 1 / SHARE_SMOOTHING requests).
SHARE_SMOOTHING = 0.01


@dataclass(frozen=True)
class WorkerSlots:
    """What one live worker can take now, as the scheduler last learned it."""

    worker_id: str
    free: int
    total: int
    queued_tokens: int = 0
    model: str | None = None  # the model it serves
    variant: str | None = None  # the variant of `model` it runs; None: the baseline
    service_s: float | None = None  # how long a request holds one of its slots, measured


@dataclass
class Dispatch(Generic[T]):
    """One batch, addressed to one worker."""

    worker_id: str
    tier: Tier
    reason: DispatchReason
    passengers: list[Passenger[T]]
    filled: int = 0  # passengers taken from the other tier to use spare room

    @property
    def tokens(self) -> int:
        return sum(p.cost for p in self.passengers)


@dataclass
class Plan(Generic[T]):
    """What to do now. Every added request ends in exactly one list, once."""

    dispatches: list[Dispatch[T]] = field(default_factory=list)
    expired: list[Passenger[T]] = field(default_factory=list)
    fell_back: list[Passenger[T]] = field(default_factory=list)  # moved to their fallback model
    # Moved from a variant without a live worker to their model's baseline (models.py).
    to_baseline: list[tuple[Passenger[T], str]] = field(default_factory=list)
    # Waiting where no live worker has served for `unserved_hold_s`: answered (models.py).
    unserved: list[Passenger[T]] = field(default_factory=list)
    wake_at: float | None = None  # call `plan` again by then, even if nothing happens


@dataclass
class _Held:
    """Passengers held for their full last server during one plan (routing.py)."""

    until: dict[int, float] = field(default_factory=dict)  # by number: when the hold ends
    stuck: set[LaneKey] = field(default_factory=set)  # lanes where all that may leave is held


def _within(passengers: list[Passenger[T]], limit: int, budget: int) -> list[Passenger[T]]:
    """The leading passengers within a batch's size and token limits."""
    out: list[Passenger[T]] = []
    tokens = 0
    for p in passengers:
        if len(out) >= limit:
            break
        if tokens + p.cost <= budget:
            out.append(p)
            tokens += p.cost
    return out


class Policy(Generic[T]):
    """Per-tier bus rule with token budgets, priority, aging, fill and capacity."""

    def __init__(
        self, config: PolicyConfig, rule: DepartureRule | None = None, router: Router | None = None
    ) -> None:
        self.config = config
        self.rule: DepartureRule = rule or FixedRule()
        self.router = router or Router()
        self.backlog: Backlog[T] = Backlog(config)
        self.background_share = 0.0  # of recently dispatched requests
        self._totals: dict[str, int] = {}  # every live worker's slots, as of this plan
        self._unserved_since: dict[LaneKey, float] = {}  # lanes waiting with no live worker

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
    ) -> Passenger[T] | None:
        """Queue a request; None if it can never ride (larger than its tier's token budget)."""
        if cost > self.config.tiers[tier].max_batch_tokens:
            return None
        return self.backlog.add(
            item,
            tier=tier,
            cost=cost,
            prompt_tokens=prompt_tokens,
            now=now,
            deadline_at=deadline_at,
            tenant=tenant,
            model=model,
            fallback=fallback if fallback != model else None,
            prefix=prefix,
            variant=variant,
            pinned=pinned,
        )

    def plan(self, now: float, workers: Sequence[WorkerSlots]) -> Plan[T]:
        plan: Plan[T] = Plan(expired=self.backlog.expire(now))
        plan.fell_back = fall_back(self.backlog, now, workers)
        live = [(w.model, w.variant) for w in workers]
        plan.to_baseline = to_baseline(self.backlog, live)
        plan.unserved = unserved(
            self.backlog, live, now, self._unserved_since, self.config.unserved_hold_s
        )
        free = {w.worker_id: w.free for w in workers if w.free > 0}
        queued = {w.worker_id: w.queued_tokens for w in workers}
        self._totals = {w.worker_id: w.total for w in workers}
        total = sum(w.total for w in workers)
        load = 1.0 if total <= 0 else 1.0 - min(total, sum(free.values())) / total
        # Aging is decided once per plan, from the share before it.
        aging = self.background_share < self.config.background_min_share
        aged_before = now - self.config.background_aging_ms / 1000.0 if aging else -math.inf
        models: dict[str, Serving] = {w.worker_id: (w.model, w.variant) for w in workers}
        held = _Held()
        self._place(plan, now, free, queued, load, aged_before, models, held)
        self._fill(plan, free, aged_before)
        plan.wake_at = self._wake_at(now, load, free, models, held)
        for d in plan.dispatches:
            for p in d.passengers:
                background = 1.0 if p.tier is Tier.background else 0.0
                self.background_share += SHARE_SMOOTHING * (background - self.background_share)
        return plan

    def _place(
        self,
        plan: Plan[T],
        now: float,
        free: dict[str, int],
        queued: dict[str, int],
        load: float,
        aged_before: float,
        models: dict[str, Serving],
        held: _Held,
    ) -> None:
        """Due lanes, best rank first, each as batches on the workers (of its model) with
        most room."""
        while free:
            best: tuple[tuple[int, float, int], Lane[T], DispatchReason] | None = None
            for lane in self.backlog.busy_lanes():
                if lane.key in held.stuck:
                    continue
                if not any(serves_lane(models.get(w), lane.key) for w in free):
                    continue
                reason = self.rule.reason(lane, now, load)
                if reason is None:
                    continue
                key = self._order(lane, aged_before)
                if best is None or key < best[0]:
                    best = (key, lane, reason)
            if best is None:
                return
            (rank, _, _), lane, reason = best
            # Unaged background leaves each worker's reserve to interactive arrivals.
            room = {
                w: n - self._reserved(w, rank)
                for w, n in free.items()
                if serves_lane(models.get(w), lane.key) and n > self._reserved(w, rank)
            }
            if not room:
                held.stuck.add(lane.key)
                continue
            limits = lane.limits
            admit = (lambda p: p.arrived <= aged_before) if rank == AGED else None
            # Passengers held for their full last server (routing.py) stay in the lane: the
            # selection reaches past those held earlier in this plan, then leaves them out.
            waiting = [p for p in lane if p.number in held.until] if held.until else []
            chosen = self.backlog.select(
                lane.key,
                limits.max_batch_size + len(waiting),
                limits.max_batch_tokens + sum(p.cost for p in waiting),
                admit,
            )
            chosen = _within(
                [p for p in chosen if p.number not in held.until],
                limits.max_batch_size,
                limits.max_batch_tokens,
            )
            # Only the workers serving the lane's model and variant take it (models.py);
            # among them the router says where each passenger goes (routing.py): least
            # loaded, the batch whole unless its worker has too little room; or by prefix
            # affinity, perhaps holding some. A batch splits into one part per worker, each
            # within every limit (ADR 0034).
            totals = {w: n for w, n in self._totals.items() if serves_lane(models.get(w), lane.key)}
            hold_until = [self.router.hold_until(p.tier, p.arrived, p.deadline_at) for p in chosen]
            where = self.router.route(
                [p.prefix for p in chosen], room, totals, queued, now=now, hold_until=hold_until
            )
            parts: dict[str, list[Passenger[T]]] = {}
            for p, until, worker in zip(chosen, hold_until, where, strict=False):
                if worker is None:
                    held.until[p.number] = until
                else:
                    parts.setdefault(worker, []).append(p)
            if not parts:  # all held (or no room): nothing more leaves this lane now
                held.stuck.add(lane.key)
            for worker, part in parts.items():
                self.backlog.discard(lane.key, part)
                plan.dispatches.append(Dispatch(worker, lane.key.tier, reason, part))
                self._use(free, worker, len(part))
                self._use(room, worker, len(part))

    def _fill(self, plan: Plan[T], free: dict[str, int], aged_before: float) -> None:
        """Spare room in leaving batches (and on their workers), best rank first.

        Runs after every due lane was placed, so it only uses slots nobody due needed.
        Candidates are the batch's own lane and, if configured, the other tier's lane of
        the same length bucket.
        """
        for d in plan.dispatches:
            limits = self.config.tiers[d.tier]
            first = d.passengers[0]
            own = self.backlog.lane_of(d.tier, first.prompt_tokens, first.model, first.variant)
            keys = [own]
            if self.config.fill_from_other_tier:
                other = Tier.background if d.tier is Tier.interactive else Tier.interactive
                keys.append(own._replace(tier=other))
            lanes = [lane for k in keys if (lane := self.backlog.lanes.get(k)) and len(lane)]
            lanes.sort(key=lambda ln: self._order(ln, aged_before))
            # With prefix routing, only riders that prefer this worker (or have no key).
            admit = self._prefers(d.worker_id) if self.router.mode == "prefix" else None
            for lane in lanes:
                spare = free.get(d.worker_id, 0)
                if lane.key.tier is Tier.background:
                    spare -= self._reserved(
                        d.worker_id, self._rank(lane.key.tier, lane.head(), aged_before)
                    )
                room = min(limits.max_batch_size - len(d.passengers), spare)
                budget = limits.max_batch_tokens - d.tokens
                if room <= 0 or budget <= 0:
                    break
                taken = self.backlog.select(lane.key, room, budget, admit)
                self.backlog.discard(lane.key, taken)
                for p in taken:
                    if p.prefix is not None and self.router.mode == "prefix":
                        self.router.served(p.prefix, d.worker_id)
                if lane.key.tier is not d.tier:
                    d.filled += len(taken)
                d.passengers.extend(taken)
                self._use(free, d.worker_id, len(taken))

    def _prefers(self, worker: str) -> Callable[[Passenger[T]], bool]:
        def admit(p: Passenger[T]) -> bool:
            return p.prefix is None or self.router.prefers(p.prefix, worker, self._totals)

        return admit

    def _wake_at(
        self,
        now: float,
        load: float,
        free: dict[str, int],
        models: dict[str, Serving],
        held: _Held,
    ) -> float | None:
        """The next time a plan could differ without any new arrival or capacity.

        Only lanes with room left on their model's workers count: a lane due but without
        room waits for a heartbeat (which wakes the scheduler), not for the clock. A lane
        whose passengers are all held waits for the first hold to end (or a heartbeat: the
        last server freeing a slot releases its passengers at once).
        """
        times: list[float] = list(held.until.values())
        # An unserved lane's hold ends (models.py `unserved`).
        times.extend(t + self.config.unserved_hold_s for t in self._unserved_since.values())
        deadline = self.backlog.next_deadline()
        if deadline is not None:
            times.append(deadline)
        if free:
            times.extend(
                self.rule.due_at(lane, now, load)
                for lane in self.backlog.busy_lanes()
                if lane.key not in held.stuck
                and any(serves_lane(models.get(w), lane.key) for w in free)
            )
        return max(now, min(times)) if times else None

    def _order(self, lane: Lane[T], aged_before: float) -> tuple[int, float, int]:
        head = lane.head()
        return (self._rank(lane.key.tier, head, aged_before), head.arrived, head.number)

    @staticmethod
    def _rank(tier: Tier, head: Passenger[T], aged_before: float) -> int:
        if tier is Tier.interactive:
            return INTERACTIVE
        return AGED if head.arrived <= aged_before else BACKGROUND

    def _reserved(self, worker: str, rank: int) -> int:
        """Slots of `worker` a lane of `rank` may not take: the interactive reserve, for
        background that has not aged (aged background outranks it, as it does interactive)."""
        if rank != BACKGROUND or self.config.interactive_reserve <= 0:
            return 0
        return math.ceil(self.config.interactive_reserve * self._totals.get(worker, 0))

    @staticmethod
    def _use(free: dict[str, int], worker: str, n: int) -> None:
        free[worker] -= n
        if free[worker] <= 0:
            del free[worker]

    def waiting(self) -> int:
        return len(self.backlog)
