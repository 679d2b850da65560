"""Seeded fault plans: what fails when, and for how long.

Pure: a seed and the fault kinds in, a list of faults out, so a run's faults print as one
line each and `TOKENBUS_CHAOS_SEED=<seed>` plays the same plan again.

Service faults kill -9 a process. Engine faults make a worker's engine die or hang inside
the live process (the sim's fault file): the worker must see it, exit, and be started again
(issue 38, item 2). Node faults strike the broker node that leads a planned
partition at that moment: kill -9 (`broker-*-leader`), SIGSTOP then SIGCONT (`broker-hang`:
a GC pause, a stuck disk), or a network fault on the services' link to that node only,
through Toxiproxy (`net-*`). Node faults never overlap: one node of three at a time, and
the next begins `NODE_SETTLE_S` after the last one ended (a killed node's JVM is up again).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

# A kind names what is killed; the plan picks the instance where there are several: a
# service instance, or for a broker kind the partition whose leader dies ("requests/2").
BROKER_KINDS = ("broker-requests-leader", "broker-results-leader")
HANG_KINDS = ("broker-hang",)
NET_KINDS = ("net-latency", "net-bandwidth", "net-black-hole", "net-reset", "net-slow-close")
NODE_KINDS = (*BROKER_KINDS, *HANG_KINDS, *NET_KINDS)
SERVICE_KINDS = ("ingest", "scheduler", "worker", "edge")
ENGINE_KINDS = ("engine-dead", "engine-hang")
# Edges lease the lowest free results partitions: 0 and 1 carry the traffic.
_LEADERS = (*(f"requests/{p}" for p in range(4)), "results/0", "results/1")
INSTANCES = {
    "worker": ("worker-a", "worker-b"),
    **{kind: ("worker-a", "worker-b") for kind in ENGINE_KINDS},
    "edge": ("edge-a", "edge-b"),
    "broker-requests-leader": tuple(f"requests/{p}" for p in range(4)),
    "broker-results-leader": ("results/0", "results/1"),
    **{kind: _LEADERS for kind in (*HANG_KINDS, *NET_KINDS)},
}
# How long each kind of fault lasts (seconds, drawn uniformly): a service or node killed
# stays down this long before it is started again; a hang or a network fault lasts this long.
DURATION_S: dict[str, tuple[float, float]] = {
    "broker-hang": (6.0, 15.0),
    "net-black-hole": (20.0, 20.0),
    **{kind: (6.0, 10.0) for kind in NET_KINDS if kind != "net-black-hole"},
}
KILL_DOWN_S = (0.5, 3.0)
# After a node fault, the next one waits this long: a killed node's JVM is up again (8-25 s
# on two busy cores) and its replicas back in sync, so one node of three is away at a time.
NODE_SETTLE_S = 12.0
WHAT = {
    "broker-hang": "SIGSTOP {who}, SIGCONT after {s}",
    "net-latency": "100 ms ± 30 ms latency on the services' link to {who} for {s}",
    "net-bandwidth": "32 KB/s on the services' link to {who} for {s}",
    "net-black-hole": "black hole (Toxiproxy `timeout`) on the services' link to {who} for {s}",
    "net-reset": "connection resets on the services' link to {who} for {s}",
    "net-slow-close": "slow close (2 s) on the services' link to {who} for {s}",
    "engine-dead": "the engine of {who} dies; started again {s} after it exits",
    "engine-hang": "the engine of {who} hangs; started again {s} after it exits",
}


@dataclass(frozen=True)
class Fault:
    at_s: float  # from the start of the load
    kind: str
    target: str  # a service instance, or "<topic>/<partition>" whose leader broker dies
    down_s: float  # dead this long before it is started again, as a supervisor would

    @property
    def node_fault(self) -> bool:
        return self.kind in NODE_KINDS

    @property
    def ends_s(self) -> float:
        return self.at_s + self.down_s

    def describe(self) -> str:
        who = f"the leader of {self.target}" if self.node_fault else self.target
        if self.kind in WHAT:
            what = WHAT[self.kind].format(who=who, s=f"{self.down_s:.1f}s")
            return f"t={self.at_s:5.1f}s {what}"
        return f"t={self.at_s:5.1f}s kill -9 {who}, restart after {self.down_s:.1f}s"


def plan(
    seed: int,
    kinds: Sequence[str],
    start_s: float,
    end_s: float,
    down_s: tuple[float, float] = KILL_DOWN_S,
) -> list[Fault]:
    """One fault per entry of `kinds`, in a seeded order, at seeded times from `start_s`.

    The window [start_s, end_s) is cut into equal slots, one fault in the first half of
    each, so two faults are at least half a slot apart: each one's restart has begun
    before the next strikes. A node fault also waits until `NODE_SETTLE_S` after the
    previous node fault ended, so the plan may run past `end_s` (the load lasts until the
    last fault has ended: `last_end_s`). A kind that comes again takes the next instance
    in turn (edge-a, then edge-b): clients that moved off the first edge are on the second
    when it dies.
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
    node_free_s = start_s
    for i, kind in enumerate(order):
        instances = INSTANCES.get(kind, (kind,))
        target = instances[turn[kind] % len(instances)]
        turn[kind] += 1
        at = round(start_s + i * slot + rng.uniform(0, slot / 2), 2)
        if kind in DURATION_S:
            lasts = round(rng.uniform(*DURATION_S[kind]), 2)
        elif kind in NODE_KINDS:
            lasts = round(rng.uniform(*down_s), 2)
        else:
            lasts = round(min(rng.uniform(*down_s), slot / 2), 2)
        if kind in NODE_KINDS:
            at = max(at, node_free_s)
            node_free_s = at + lasts + NODE_SETTLE_S
        faults.append(Fault(at_s=at, kind=kind, target=target, down_s=lasts))
    return sorted(faults, key=lambda f: f.at_s)


def last_end_s(faults: Sequence[Fault]) -> float:
    """When the plan's last fault ends (0 for none)."""
    return max((f.ends_s for f in faults), default=0.0)
