"""Where each passenger of a leaving batch goes: least loaded, or by prefix affinity.

Pure: the policy hands it the passengers' prefix keys (shared/prefixes.py) and the workers'
free and total slots; it answers a worker per passenger, and remembers which worker last
served each key (that worker's engine holds the prefix in its KV cache).

- `least_loaded` (the behaviour before prefix routing): the batch goes to the worker with
  most free slots, the rest of it to the next one when that one has too little room.
- `prefix`: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA
  2018), with the last server remembered. A key's preferred worker is the one that last
  served it, else its first choice by rendezvous hashing (highest random weight), which
  every scheduler replica computes alike and which moves only the keys of a worker that
  leaves. A worker may take a passenger while it has a free slot and its busy slots stay
  within `ceil(load_factor * average utilisation * its slots)`, the average counting the
  passenger, or within half its slots (below that, balance buys nothing: a decode step
  of a continuous-batching engine is memory-bound, about as long with few sequences as
  with many, while a miss costs a whole prefill). When the preferred worker is full or
  over both, the passenger goes to the least loaded worker instead (which becomes the
  key's last server).
- The hold (ADR 0034): a key with a live last server holds its history in that worker's
  cache; anywhere else the whole history is prefilled again, while at usual loads a slot
  there frees within a fraction of a second. Like Dynamo's KV-aware router and SGLang's
  cache-aware router, which weigh the cached prefix against the wait, the router then
  keeps the passenger for that worker until `hold_until` (`Router.hold_until`: at most
  its tier's hold after its arrival, never within one hold of its deadline): it goes
  there as soon as the worker has a free slot, past the load bound (the bound is for
  placing keys by hash; here the cache decides), and while the worker is full it is held
  (None: it stays in the backlog). After its hold, the rules above apply. A key never
  served (nothing cached) is never held.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal

from shared.messages import Tier

RoutingMode = Literal["least_loaded", "prefix"]

# Keys whose last server is remembered (least recently routed forgotten first): ~100 bytes
# each, so about 10 MB at most.
DEFAULT_MEMORY = 100_000
# Mirrokni et al.'s c: a worker takes at most 25 % more than the average load (Vimeo's
# deployment of the paper; HAProxy's `hash-balance-factor` documents 150 %, i.e. 1.5).
DEFAULT_LOAD_FACTOR = 1.25
# A worker less than this share busy takes its keys whatever the average load.
AFFINITY_FLOOR = 0.5
# The longest a passenger waits for its last server's next free slot, per tier: about the
# prefill a hit saves (a few thousand tokens of history; ADR 0034 has the estimate) for
# interactive; background waits longer, as its deadline is loose
# (`make bench-affinity` measures the interactive one, docs/benchmarks.md).
DEFAULT_HOLD_S = {Tier.interactive: 0.3, Tier.background: 2.0}


class Router:
    """Routes passengers by mode; in `prefix` mode remembers each key's last server."""

    def __init__(
        self,
        mode: RoutingMode = "least_loaded",
        *,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        memory: int = DEFAULT_MEMORY,
        hold_s: Mapping[Tier, float] | None = None,
    ) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be at least 1")
        if memory < 1:
            raise ValueError("memory must be at least 1")
        self.mode = mode
        self.load_factor = load_factor
        self.memory = memory
        self.hold_s = dict(DEFAULT_HOLD_S if hold_s is None else hold_s)
        if any(v < 0 for v in self.hold_s.values()):
            raise ValueError("hold_s must not be negative")
        self._last: OrderedDict[str, str] = OrderedDict()
        self.hits = 0  # passengers placed on their preferred worker
        self.spills = 0  # passengers whose preferred worker was full or at its bound
        self.holds = 0  # times a passenger was held for its full last server

    def hold_until(self, tier: Tier, arrived: float, deadline_at: float | None) -> float:
        """Until when a passenger may wait for its full last server (`prefix` mode).

        At most the tier's hold after its arrival, and never within one hold of its
        deadline (so that it still has that long to start elsewhere).
        """
        hold = self.hold_s.get(tier, 0.0) if self.mode == "prefix" else 0.0
        until = arrived + hold
        if deadline_at is not None:
            until = min(until, deadline_at - hold)
        return until

    def route(
        self,
        keys: Sequence[str | None],
        free: Mapping[str, int],
        totals: Mapping[str, int],
        queued: Mapping[str, int] | None = None,
        *,
        now: float = 0.0,
        hold_until: Sequence[float] | None = None,
    ) -> list[str | None]:
        """A worker for each key, in order; at most `free[w]` passengers go to worker `w`.

        `free` holds the workers with room (> 0), `totals` every live worker's slots (those
        without room included: they count in the average load). None for a passenger held
        for its full last server: `now` is before its `hold_until` (module docstring); it
        stays in the backlog. Passengers beyond the total room are not routed: the answer
        is then shorter than `keys`.
        """
        room = {w: n for w, n in free.items() if n > 0}
        queued = queued or {}
        if self.mode == "least_loaded":
            return list(self._least_loaded(len(keys), room, queued))
        out: list[str | None] = []
        for i, key in enumerate(keys):
            if not room:
                break
            warm = self._warm(key, totals)
            holding = hold_until is not None and now < hold_until[i] and warm is not None
            if holding and room.get(warm or "", 0) <= 0:
                self.holds += 1
                out.append(None)
                continue
            worker = warm if holding else self._preferred(key, room, totals)
            if worker is None:
                worker = _most_room(room, queued)
                if key is not None:
                    self.spills += 1
            else:
                self.hits += 1
            out.append(worker)
            room[worker] -= 1
            if room[worker] <= 0:
                del room[worker]
            if key is not None:
                self._remember(key, worker)
        return out

    def last_server(self, key: str) -> str | None:
        return self._last.get(key)

    def prefers(self, key: str, worker: str, totals: Mapping[str, int]) -> bool:
        """Whether `worker` is the key's preferred one among the live workers `totals`."""
        last = self._last.get(key)
        if last is None or last not in totals:
            last = rendezvous(key, totals)
        return last == worker

    def served(self, key: str, worker: str) -> None:
        """Remember a placement made outside `route` (a batch's spare room filled)."""
        self._remember(key, worker)

    def _least_loaded(self, n: int, room: dict[str, int], queued: Mapping[str, int]) -> list[str]:
        out: list[str] = []
        while len(out) < n and room:
            worker = _most_room(room, queued)
            take = min(room.pop(worker), n - len(out))
            out.extend([worker] * take)
        return out

    def _preferred(
        self, key: str | None, room: Mapping[str, int], totals: Mapping[str, int]
    ) -> str | None:
        """The key's preferred worker if it may take one more now; else None."""
        if key is None:
            return None
        worker = self._last.get(key)
        if worker is None or worker not in totals:
            worker = rendezvous(key, totals)
        if worker is None or room.get(worker, 0) <= 0:
            return None
        return worker if self._within_bound(worker, room, totals) else None

    def _warm(self, key: str | None, totals: Mapping[str, int]) -> str | None:
        """The key's last server if it is live (its cache holds the key's prefix)."""
        worker = None if key is None else self._last.get(key)
        return worker if worker is not None and worker in totals else None

    def _within_bound(
        self, worker: str, room: Mapping[str, int], totals: Mapping[str, int]
    ) -> bool:
        capacity = sum(totals.values())
        busy = sum(totals[w] - room.get(w, 0) for w in totals)
        bound = math.ceil(self.load_factor * (busy + 1) * totals[worker] / capacity)
        bound = max(bound, math.floor(AFFINITY_FLOOR * totals[worker]))
        return totals[worker] - room.get(worker, 0) + 1 <= bound

    def _remember(self, key: str, worker: str) -> None:
        self._last[key] = worker
        self._last.move_to_end(key)
        while len(self._last) > self.memory:
            self._last.popitem(last=False)


def rendezvous(key: str, workers: Mapping[str, int] | Sequence[str]) -> str | None:
    """The worker with the highest hash of (key, worker): the key's first choice."""
    best: tuple[int, str] | None = None
    for worker in workers:
        weight = int.from_bytes(
            hashlib.blake2b(f"{key}\x00{worker}".encode(), digest_size=8).digest(), "big"
        )
        if best is None or (weight, worker) > best:
            best = (weight, worker)
    return None if best is None else best[1]


def _most_room(room: Mapping[str, int], queued: Mapping[str, int]) -> str:
    """The least loaded worker: most free slots, then least queued work, then by id."""
    return max(room, key=lambda w: (room[w], -queued.get(w, 0), w))
