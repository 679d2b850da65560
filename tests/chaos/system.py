"""The system under chaos: every service as a process (two workers, two edges) and the injector.

The injector plays a fault plan: it kills a process with SIGKILL at the planned time and, as a
supervisor would, starts it again after the planned pause. A broker fault kills the node that
leads the planned partition at that moment (`Brokers`, present when the run has a cluster).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shared.messages import Heartbeat
from tests.chaos.faults import BROKER_KINDS, Fault
from tests.stack import Stack, free_port, wait_until

WORKERS = ("worker-a", "worker-b")

# Quick failure detection that two busy cores do not trip falsely (as in
# tests/test_scheduler_failover.py): a worker is dead after 1.5 s without a beat.
CHAOS_ENV = {
    "TOKENBUS_SCHEDULER_ID": "sched-a",  # a restart takes its partitions back at once
    "TOKENBUS_WORKER_ID": "worker-a",
    "TOKENBUS_WORKER_HEARTBEAT_MS": "300",
    "TOKENBUS_SCHEDULER_WORKER_MISSED_BEATS": "5",
    "TOKENBUS_SCHEDULER_RECOVERY_GRACE_MS": "300",
    "TOKENBUS_EDGE_LEASE_TTL_S": "3",  # a restarted edge gets a results partition soon
    # 50 tokens/s per sequence: a request streams for 0.2-0.8 s, so every kill finds some
    # mid-stream.
    "TOKENBUS_WORKER_SIM_TOKEN_RATE": "50",
}


class Brokers(Protocol):
    """What the injector needs of a cluster: who leads a partition, kill -9, restart."""

    def leader(self, topic: str, partition: int) -> int: ...

    def kill(self, node: int) -> None: ...

    def restart(self, node: int) -> None: ...


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

    @classmethod
    def start(cls, stack: Stack) -> ChaosSystem:
        stack.start()  # ingest, scheduler, worker-a, edge-a
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
        system.launch("worker-b")
        system.launch("edge-b")
        wait_until(lambda: stack.edge_ready(port_b), 90, "edge B's /healthz")
        wait_until(lambda: system.workers_heard() >= set(WORKERS), 90, "both workers' beats")
        return system

    @property
    def urls(self) -> list[str]:
        return [self.stack.ws_url, f"ws://127.0.0.1:{self.port_b}/v1/chat"]

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
    """Plays a fault plan against the system; `done` lists what happened, when."""

    system: ChaosSystem
    brokers: Brokers | None
    log: Callable[[str], None]
    done: list[str] = field(default_factory=list)

    async def run(self, faults: list[Fault], zero: float) -> None:
        for fault in faults:
            delay = zero + fault.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            # A fault waits for the previous restart: one failure at a time, as planned.
            await self._play(fault, zero)

    async def _play(self, fault: Fault, zero: float) -> None:
        struck = time.monotonic() - zero
        if fault.kind in BROKER_KINDS:
            if self.brokers is None:
                raise RuntimeError(f"{fault.describe()}: this run has no cluster to kill nodes of")
            brokers = self.brokers
            topic_kind, partition = fault.target.split("/")
            topics = self.system.stack.topics
            topic = topics.requests if topic_kind == "requests" else topics.results
            node = await asyncio.to_thread(brokers.leader, topic, int(partition))
            what = f"broker node {node} (leader of {fault.target})"
            await asyncio.to_thread(brokers.kill, node)
            await asyncio.sleep(fault.down_s)
            await asyncio.to_thread(brokers.restart, node)
        else:
            what = fault.target
            await asyncio.to_thread(self.system.kill, fault.target)
            await asyncio.sleep(fault.down_s)
            self.system.launch(fault.target)
        line = (
            f"t={struck:5.1f}s kill -9 {what}; started again at t={time.monotonic() - zero:5.1f}s"
        )
        self.done.append(line)
        self.log(line)
