"""The system under chaos: every service as a process (two workers, two edges) and the injector.

The injector plays a fault plan: it kills a process with SIGKILL at the planned time and, as a
supervisor would, starts it again after the planned pause. A broker fault kills the node that
leads the planned partition at that moment (`Brokers`, present when the run has a cluster).
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from deploy.kafka import launcher
from shared.kafka import create_topics, make_admin, wait_for_broker
from shared.messages import Heartbeat
from shared.settings import TokenbusSettings
from tests.chaos.faults import BROKER_KINDS, Fault
from tests.stack import Stack, free_port

WORKERS = ("worker-a", "worker-b")

# Quick failure detection that two busy cores do not trip falsely (as in
# tests/test_scheduler_failover.py): a worker is dead after 1.5 s without a beat.
CHAOS_ENV = {
    "TOKENBUS_SCHEDULER_ID": "sched-a",  # a restart takes its partitions back at once
    "TOKENBUS_WORKER_ID": "worker-a",
    "TOKENBUS_WORKER_HEARTBEAT_MS": "300",
    "TOKENBUS_SCHEDULER_WORKER_MISSED_BEATS": "5",
    "TOKENBUS_SCHEDULER_RECOVERY_GRACE_MS": "300",
    # 50 tokens/s per sequence: a request streams for 0.2-0.8 s, so every kill finds some
    # mid-stream.
    "TOKENBUS_WORKER_SIM_TOKEN_RATE": "50",
}


class Brokers(Protocol):
    """What the injector needs of a cluster: who leads a partition, kill -9, restart."""

    def leader(self, topic: str, partition: int) -> int: ...

    def kill(self, node: int) -> None: ...

    def restart(self, node: int) -> None: ...


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


async def _create_topics(stack: Stack) -> None:
    await wait_for_broker(stack.settings, timeout_s=60)
    await create_topics(stack.settings, stack.topics.partitions())


@dataclass(frozen=True)
class LocalCluster:
    """`Brokers` of a local KRaft cluster started by the project's launcher."""

    cluster: launcher.Cluster

    def leader(self, topic: str, partition: int) -> int:
        return asyncio.run(_leader(self.cluster.bootstrap_servers, topic, partition))

    def kill(self, node: int) -> None:
        launcher.kill_node(self.cluster, node)

    def restart(self, node: int) -> None:
        launcher.start_node(self.cluster, node)


async def _leader(bootstrap: str, topic: str, partition: int) -> int:
    admin = make_admin(TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap))
    await admin.start()
    try:
        for entry in await admin.describe_topics([topic]):
            for p in entry["partitions"]:
                if p["partition"] == partition and p["leader"] >= 0:
                    return int(p["leader"])
    finally:
        await admin.close()
    raise RuntimeError(f"{topic}/{partition} has no leader now")


@dataclass(frozen=True)
class Service:
    module: str  # services.<module>
    key: str  # the Stack's process key (and log file name)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ChaosSystem:
    stack: Stack
    services: dict[str, Service]
    port_b: int

    startup_exits: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, stack: Stack, timeout_s: float = 150) -> ChaosSystem:
        """Topics, then all six processes; ready once both edges answer and both workers beat.

        A service that exits while the system comes up is started again, as a supervisor
        would (seen: an edge whose first admin request timed out on a loaded machine); each
        such exit is kept in `startup_exits`.
        """
        asyncio.run(_create_topics(stack))
        stack.edge_port = free_port()
        port_b = free_port()
        services = {
            "ingest": Service("ingest", "ingest"),
            "scheduler": Service("scheduler", "scheduler"),
            "worker-a": Service("worker", "worker"),
            "worker-b": Service(
                "worker",
                "worker-b",
                {"TOKENBUS_WORKER_ID": "worker-b", "TOKENBUS_WORKER_BATCH_PARTITION": "1"},
            ),
            "edge-a": Service("edge", "edge"),
            "edge-b": Service("edge", "edge-b", {"TOKENBUS_EDGE_PORT": str(port_b)}),
        }
        system = cls(stack, services, port_b)
        for name in services:
            system.launch(name)
        deadline = time.monotonic() + timeout_s
        heard: set[str] = set()
        while True:
            system._relaunch_exited()
            edges = _healthy(stack.edge_port) and _healthy(port_b)
            if edges and heard < set(WORKERS):
                heard = system.workers_heard()
            if edges and heard >= set(WORKERS):
                return system
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"system not ready in {timeout_s:.0f} s: edges ready={edges},"
                    f" workers heard={sorted(heard)}, exits={system.startup_exits}"
                )
            time.sleep(0.5)

    def _relaunch_exited(self) -> None:
        for name, service in self.services.items():
            proc = self.stack.processes.get(service.key)
            if proc is not None and proc.poll() is not None:
                self.startup_exits.append(f"{name} (code {proc.returncode})")
                self.launch(name)

    @property
    def urls(self) -> list[str]:
        # Both with the `default` tenant's key: the edges refuse sockets without one.
        return [self.stack.ws_url, self.stack.ws_url_as("default", port=self.port_b)]

    def launch(self, name: str) -> None:
        service = self.services[name]
        self.stack.start_service(service.module, key=service.key, **service.env)

    def kill(self, name: str) -> None:
        self.stack.stop_service(self.services[name].key, signal.SIGKILL)

    def workers_heard(self) -> set[str]:
        values = self.stack.read(self.stack.topics.workers)
        return {Heartbeat.model_validate_json(v).worker_id for v in values}


@dataclass
class Injector:
    """Plays a fault plan against the system and supervises it.

    `done` lists the faults played, when; `self_exits` every service that exited without
    being killed (it is started again at once, as `tokenbus up` or systemd would).
    """

    system: ChaosSystem
    brokers: Brokers | None
    log: Callable[[str], None]
    done: list[str] = field(default_factory=list)
    self_exits: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # not begun when the load ended
    closed: bool = False  # the load has ended: no fault begins any more
    _down: set[str] = field(default_factory=set)  # killed by a fault, not yet restarted
    _one_broker: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def run(self, faults: list[Fault], zero: float) -> None:
        """Each fault strikes at its own time; broker faults one after another (see below)."""
        async with asyncio.TaskGroup() as tg:
            for fault in faults:
                tg.create_task(self._at(fault, zero))

    async def _at(self, fault: Fault, zero: float) -> None:
        delay = zero + fault.at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if fault.kind in BROKER_KINDS:
            async with self._one_broker:
                if not self._skip(fault, zero):
                    await self._kill_broker(fault, zero)
        elif not self._skip(fault, zero):
            await self._kill_service(fault, zero)

    def close(self) -> None:
        """The load has ended: faults not begun yet are skipped (and listed), the ones under
        way finish (a node is started again and waited for), so that the drain that follows
        waits for a whole system, not for a JVM's start on a busy machine."""
        self.closed = True

    def _skip(self, fault: Fault, zero: float) -> bool:
        if not self.closed:
            return False
        now = time.monotonic() - zero
        line = f"{fault.describe()}: not begun by t={now:.1f}s, when the load had ended"
        self.skipped.append(line)
        self.log(line)
        return True

    async def supervise(self, zero: float) -> None:
        """Until cancelled: start again any service that exited on its own."""
        while True:
            await asyncio.sleep(0.5)
            for name, service in self.system.services.items():
                proc = self.system.stack.processes.get(service.key)
                if name in self._down or proc is None or proc.poll() is None:
                    continue
                line = (
                    f"t={time.monotonic() - zero:5.1f}s {name} exited on its own"
                    f" (code {proc.returncode}); started again"
                )
                self.self_exits.append(line)
                self.log(line)
                self.system.launch(name)

    async def _kill_service(self, fault: Fault, zero: float) -> None:
        struck = time.monotonic() - zero
        self._down.add(fault.target)
        try:
            await asyncio.to_thread(self.system.kill, fault.target)
            await asyncio.sleep(fault.down_s)
            self.system.launch(fault.target)
        finally:
            self._down.discard(fault.target)
        self._played(f"t={struck:5.1f}s kill -9 {fault.target}", zero)

    async def _kill_broker(self, fault: Fault, zero: float) -> None:
        """Kill the node leading the fault's partition; start it again; wait until it is up.

        Called under `_one_broker`: a JVM takes from seconds to a minute to start on a busy
        machine, and the next broker fault waits until every node is back, so at most one
        node of three is ever down (the cluster's min.insync.replicas=2 holds). Service
        faults do not wait for it.
        """
        if self.brokers is None:
            raise RuntimeError(f"{fault.describe()}: this run has no cluster to kill nodes of")
        brokers = self.brokers
        struck = time.monotonic() - zero
        topic_kind, partition = fault.target.split("/")
        topics = self.system.stack.topics
        topic = topics.requests if topic_kind == "requests" else topics.results
        node = await asyncio.to_thread(brokers.leader, topic, int(partition))
        await asyncio.to_thread(brokers.kill, node)
        await asyncio.sleep(fault.down_s)
        await asyncio.to_thread(brokers.restart, node)
        self._played(
            f"t={struck:5.1f}s kill -9 broker node {node} (leader of {fault.target})", zero
        )

    def _played(self, what: str, zero: float) -> None:
        line = f"{what}; started again at t={time.monotonic() - zero:5.1f}s"
        self.done.append(line)
        self.log(line)
