"""Seeded fault plans: which process is killed with SIGKILL when, and how long it stays down.

Pure: a seed and the fault kinds in, a list of faults out, so a run's faults print as one
line each and `TOKENBUS_CHAOS_SEED=<seed>` plays the same plan again.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

# A kind names what is killed; the plan picks the instance where there are several: a
# service instance, or for a broker kind the partition whose leader dies ("requests/2").
BROKER_KINDS = ("broker-requests-leader", "broker-results-leader")
SERVICE_KINDS = ("ingest", "scheduler", "worker", "edge")
INSTANCES = {
    "worker": ("worker-a", "worker-b"),
    "edge": ("edge-a", "edge-b"),
    "broker-requests-leader": tuple(f"requests/{p}" for p in range(4)),
    # Edges lease the lowest free results partitions: 0 and 1 carry the traffic.
    "broker-results-leader": ("results/0", "results/1"),
}


@dataclass(frozen=True)
class Fault:
    at_s: float  # from the start of the load
    kind: str
    target: str  # a service instance, or "<topic>/<partition>" whose leader broker dies
    down_s: float  # dead this long before it is started again, as a supervisor would

    def describe(self) -> str:
        what = f"the leader of {self.target}" if self.kind in BROKER_KINDS else self.target
        return f"t={self.at_s:5.1f}s kill -9 {what}, restart after {self.down_s:.1f}s"


def plan(
    seed: int,
    kinds: Sequence[str],
    start_s: float,
    end_s: float,
    down_s: tuple[float, float] = (0.5, 3.0),
) -> list[Fault]:
    """One fault per entry of `kinds`, in a seeded order, at seeded times in [start_s, end_s).

    The window is cut into equal slots, one fault in the first half of each, so two faults
    are at least half a slot apart: each one's restart has begun before the next strikes.
    A kind that comes again takes the next instance in turn (edge-a, then edge-b): clients
    that moved off the first edge are on the second when it dies.
    """
    if not kinds:
        return []
    if end_s <= start_s:
        raise ValueError(f"empty fault window [{start_s}, {end_s})")
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    slot = (end_s - start_s) / len(order)
    turn = {kind: rng.randrange(len(INSTANCES.get(kind, (kind,)))) for kind in sorted(set(order))}
    faults = []
    for i, kind in enumerate(order):
        instances = INSTANCES.get(kind, (kind,))
        target = instances[turn[kind] % len(instances)]
        turn[kind] += 1
        faults.append(
            Fault(
                at_s=round(start_s + i * slot + rng.uniform(0, slot / 2), 2),
                kind=kind,
                target=target,
                down_s=round(min(rng.uniform(*down_s), slot / 2), 2),
            )
        )
    return faults
