"""Fair share between tenants inside one lane: weighted fair queuing on tokens.

Each tenant of a lane has its own queue (arrival order) and a virtual token counter: the
tokens (`Passenger.cost`, prompt + max_tokens) dispatched for it, divided by its weight.
The prompt's tokens are its bound (shared/tokens.py: never below the model's count), so no
prompt is charged less than it costs; the counters are not settled with the real usage,
which the scheduler never sees (results go to the edges): a tenant is overcharged by its
unused max_tokens and the bound's slack, never undercharged (ADR 0046).
A batch takes requests from the tenant with the lowest counter first, so over any stretch
in which two tenants both wait, the tokens each gets divided by its weight differ by at
most one request's cost divided by the weight. A tenant that arrives at an empty queue
starts at the lane's virtual time (the counter of the tenant served last, before it was
charged): idle time earns no credit, and a newcomer neither starves the others nor waits
behind their whole backlog. This is the Virtual Token Counter of Sheng et al., "Fairness
in Serving Large Language Models" (OSDI 2024), and start-time fair queuing's clock.

Pure and lazy: `select` only plans (on scratch counters); `charge` is what moves the
counters, for the requests that actually left, so a batch cut short costs nothing.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar


class Fare(Protocol):
    """What the fair queue needs to know of a waiting request."""

    @property
    def tenant(self) -> str: ...

    @property
    def cost(self) -> int: ...

    @property
    def number(self) -> int: ...  # arrival order, unique per backlog


F = TypeVar("F", bound=Fare)

DEFAULT_WEIGHT = 1.0


class FairQueue(Generic[F]):
    """Per-tenant queues of one lane and their virtual token counters.

    Caller: `Lane` (add, remove, select, charge). Affects: the queues, `counters`, `virtual`.
    """

    def __init__(
        self, weights: Mapping[str, float], first_fit_scan: int, *, fair: bool = True
    ) -> None:
        self.weights = weights
        self.first_fit_scan = first_fit_scan
        self.fair = fair  # off: one queue for everybody, i.e. arrival order
        self.queues: dict[str, OrderedDict[int, F]] = {}
        self.counters: dict[str, float] = {}  # tokens served / weight, per tenant
        self.virtual = 0.0  # the lane's clock: a newcomer's counter starts here at least

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, DEFAULT_WEIGHT)

    def tenant_of(self, p: F) -> str:
        return p.tenant if self.fair else ""

    def add(self, p: F) -> None:
        tenant = self.tenant_of(p)
        queue = self.queues.get(tenant)
        if queue is None:
            queue = self.queues[tenant] = OrderedDict()
            # Back from idle (or new): no credit for the time away.
            self.counters[tenant] = max(self.counters.get(tenant, self.virtual), self.virtual)
        queue[p.number] = p

    def remove(self, p: F) -> None:
        """Drop a request that will not ride (expired, revoked); nobody is charged."""
        tenant = self.tenant_of(p)
        queue = self.queues.get(tenant)
        if queue is not None and queue.pop(p.number, None) is not None and not queue:
            self._idle(tenant)

    def charge(self, p: F) -> None:
        """`p` rides now: remove it and move its tenant's counter (and the lane's clock)."""
        tenant = self.tenant_of(p)
        counter = self.counters[tenant]
        self.virtual = max(self.virtual, counter)
        self.counters[tenant] = counter + p.cost / self.weight(tenant)
        queue = self.queues[tenant]
        del queue[p.number]
        if not queue:
            self._idle(tenant)

    def _idle(self, tenant: str) -> None:
        del self.queues[tenant]
        if not self.queues:
            # Nobody waits: everyone got all they asked for, nobody is owed anything.
            self.counters.clear()
            self.virtual = 0.0
            return
        # A counter at or behind the clock would be lifted to it on return anyway.
        if self.counters[tenant] <= self.virtual:
            del self.counters[tenant]
        if len(self.counters) > 2 * len(self.queues) + 64:
            self.counters = {
                t: c for t, c in self.counters.items() if t in self.queues or c > self.virtual
            }

    def select(
        self,
        limit: int,
        token_budget: int,
        admit: Callable[[F], bool] | None = None,
    ) -> list[F]:
        """Up to `limit` requests within `token_budget`, lowest counter first; nothing moves.

        Within a tenant, oldest first, first fit: a request that does not fit what is left
        of the budget is passed over (at most `first_fit_scan` of them per batch) and keeps
        its tenant's turn for the next batch. `admit` ends a tenant's scan at the first of
        its requests it rejects (the aged prefix of each tenant's queue).
        """
        if len(self.queues) == 1:  # the common case, and fair share off: arrival order
            (queue,) = self.queues.values()
            return first_fit(queue.values(), limit, token_budget, admit, self.first_fit_scan)
        # (scratch counter, arrival number of the tenant's next candidate, tenant): ties go
        # to the older request, so equal counters are served in arrival order.
        heap: list[tuple[float, int, str]] = []
        cursors: dict[str, Iterator[F]] = {}
        peeked: dict[str, F] = {}
        for tenant, queue in self.queues.items():
            cursor = iter(queue.values())
            head = next(cursor)
            cursors[tenant], peeked[tenant] = cursor, head
            heap.append((self.counters[tenant], head.number, tenant))
        heapq.heapify(heap)
        out: list[F] = []
        tokens = 0
        skipped = 0
        while heap and len(out) < limit and tokens < token_budget:
            counter, _, tenant = heapq.heappop(heap)
            p = peeked.pop(tenant)
            if admit is not None and not admit(p):
                continue  # the rest of this tenant's queue is younger still
            if tokens + p.cost > token_budget:
                skipped += 1
                if skipped > self.first_fit_scan:
                    break
            else:
                out.append(p)
                tokens += p.cost
                counter += p.cost / self.weight(tenant)
            following = next(cursors[tenant], None)
            if following is not None:
                peeked[tenant] = following
                heapq.heappush(heap, (counter, following.number, tenant))
        return out


def first_fit(
    queue: Iterable[F],
    limit: int,
    token_budget: int,
    admit: Callable[[F], bool] | None,
    scan: int,
) -> list[F]:
    """`FairQueue.select` for one queue: oldest first, first fit, same limits."""
    out: list[F] = []
    tokens = 0
    skipped = 0
    for p in queue:
        if len(out) >= limit or tokens >= token_budget:
            break
        if admit is not None and not admit(p):
            break
        if tokens + p.cost > token_budget:
            skipped += 1
            if skipped > scan:
                break
            continue
        out.append(p)
        tokens += p.cost
    return out
