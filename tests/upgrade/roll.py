"""A rolling upgrade of the whole system, one process at a time, in the documented order
(docs/operations.md, "Upgrades"): workers with a surge worker first, the schedulers, ingest,
the edges each with a surge edge, then the broker nodes by controlled shutdown, each waited
for until every partition's replicas are back in sync.

Each step runs a process of the target release (`Stack.trees`) before or after stopping one
of the other with SIGTERM, as Kubernetes' rolling update does (maxSurge 1, maxUnavailable
0 for workers and edges). Clients reach the edges through two slots, a load balancer's
endpoints: a surge edge takes a slot once it is ready, before the edge it replaces is told
to drain.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

from deploy.kafka import launcher
from shared.kafka import make_admin
from shared.settings import TokenbusSettings
from tests.chaos.openai_load import OpenAiRequester
from tests.chaos.system import ChaosSystem, Service, _healthy
from tests.stack import Stack, free_port

SURGE_PARTITION = "2"  # the batches topic has 4; workers a and b hold 0 and 1
READY_S = 90.0  # a process of either release answers /readyz within this
# An edge drains for up to TOKENBUS_EDGE_DRAIN_S (20 s) and then shuts down; a worker hands
# its continuable runs back at once and waits its drain window for the rest.
STOP_S = 60.0
ISR_S = 120.0  # every partition's replicas in sync again after a node's restart


@dataclass
class Step:
    what: str  # e.g. "worker-a -> 1d3b61c"
    started_s: float
    ended_s: float
    exit_code: int | None  # of the process stopped (0: it stopped by itself on SIGTERM;
    # None: it had to be killed)
    stopped: bool = True  # False: the step only started a process


@dataclass
class Fleet:
    """The system being rolled: its processes, the edge slots clients use, what was done."""

    system: ChaosSystem
    cluster: launcher.Cluster
    ws_slots: list[str]  # the WebSocket URL behind each edge slot (WsUser reads it per connect)
    apis: list[OpenAiRequester]
    say: Callable[[str], None]
    zero: float
    steps: list[Step] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    edges: list[str] = field(default_factory=lambda: ["edge-a", "edge-b"])  # name per slot
    _retiring: set[str] = field(default_factory=set)
    _generation: int = 0

    @property
    def stack(self) -> Stack:
        return self.system.stack

    def now(self) -> float:
        return time.monotonic() - self.zero

    async def roll(self, tree: Path, label: str) -> None:
        """Every process to the release in `tree`, in the documented order."""
        self._generation += 1
        self.say(f"t={self.now():5.1f}s rolling to {label}")
        await self._workers(tree, label)
        for name in ("scheduler", "scheduler-b"):
            await self._in_place(name, tree, label)
        await self._in_place("ingest", tree, label)
        for slot in range(len(self.edges)):
            await self._edge(slot, tree, label)
        for node in self.cluster.nodes:
            await self._broker(node.node_id)
        self.say(f"t={self.now():5.1f}s rolled to {label}")

    async def supervise(self) -> None:
        """Until cancelled: a process that exits when the roll did not stop it is listed
        and started again, as its supervisor would."""
        while True:
            await asyncio.sleep(0.5)
            for name, service in list(self.system.services.items()):
                proc = self.stack.processes.get(service.key)
                if name in self._retiring or proc is None or proc.poll() is None:
                    continue
                line = f"t={self.now():5.1f}s {name} exited on its own (code {proc.returncode})"
                self.unexpected_exits.append(line)
                self.say(line + "; started again")
                self.system.launch(name)

    # -- the steps --------------------------------------------------------------------------

    async def _workers(self, tree: Path, label: str) -> None:
        surge = "worker-s"
        env = {"TOKENBUS_WORKER_ID": surge, "TOKENBUS_WORKER_BATCH_PARTITION": SURGE_PARTITION}
        started = self.now()
        await self._start(surge, Service("worker", f"{surge}.{self._generation}", env), tree)
        self._done(f"surge {surge} up at {label}", started, None, stopped=False)
        for name in ("worker-a", "worker-b"):
            await self._in_place(name, tree, label)
        started = self.now()
        code = await self._stop(surge)
        self.system.services.pop(surge)
        self._done(f"surge {surge} drained", started, code)

    async def _in_place(self, name: str, tree: Path, label: str) -> None:
        """Stop `name` (SIGTERM: its drain), then start it again from `tree`."""
        started = self.now()
        code = await self._stop(name)
        await self._start(name, self.system.services[name], tree)
        self._done(f"{name} -> {label}", started, code)

    async def _edge(self, slot: int, tree: Path, label: str) -> None:
        """A surge edge of the new release; once ready it takes the slot, and the edge
        that had it drains (ADR 0073) and stops."""
        started = self.now()
        old = self.edges[slot]
        name = f"edge-{'ab'[slot]}.{self._generation}"
        port = free_port()
        await self._start(name, Service("edge", name, {"TOKENBUS_EDGE_PORT": str(port)}), tree)
        self.ws_slots[slot] = self.stack.ws_url_as("default", port=port)
        for api in self.apis:
            api.repoint(slot, f"http://127.0.0.1:{port}/v1")
        self.edges[slot] = name
        code = await self._stop(old)
        self.system.services.pop(old)
        self._done(f"{old} -> {name} at {label}", started, code)

    async def _broker(self, node: int) -> None:
        started = self.now()
        clean = await asyncio.to_thread(launcher.stop_node, self.cluster, node)
        await asyncio.to_thread(launcher.start_node, self.cluster, node)
        await in_sync(self.cluster.bootstrap_servers, self.stack.prefix, ISR_S)
        self._done(f"broker node {node} restarted, replicas in sync", started, 0 if clean else -9)

    # -- processes ---------------------------------------------------------------------------

    async def _start(self, name: str, service: Service, tree: Path) -> None:
        self.system.services[name] = service
        self.stack.trees[service.key] = tree
        await asyncio.to_thread(self.system.launch, name)
        port = (
            int(service.env["TOKENBUS_EDGE_PORT"])
            if "TOKENBUS_EDGE_PORT" in service.env
            else self.stack.health_ports[service.key]
        )
        deadline = time.monotonic() + READY_S
        while not await asyncio.to_thread(_healthy, port):
            proc = self.stack.processes[service.key]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"{name} ({tree.name}) not ready in {READY_S:.0f} s (code {proc.poll()}):"
                    f" see {self.stack.log(service.key)}"
                )
            await asyncio.sleep(0.5)

    async def _stop(self, name: str) -> int | None:
        """SIGTERM `name` and wait for it to exit by itself; its exit code (None: it did
        not within STOP_S and was killed)."""
        self._retiring.add(name)
        proc = self.stack.processes[self.system.services[name].key]
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                return await asyncio.to_thread(proc.wait, STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
                return None
        finally:
            self._retiring.discard(name)

    def _done(self, what: str, started: float, code: int | None, stopped: bool = True) -> None:
        step = Step(what, started, self.now(), code, stopped)
        self.steps.append(step)
        self.say(f"t={step.started_s:5.1f}-{step.ended_s:5.1f}s {what} (exit {code})")


async def in_sync(bootstrap: str, prefix: str, timeout_s: float) -> None:
    """Wait until every partition of the stack's topics and of Kafka's own has all its
    replicas in sync."""
    admin = make_admin(TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap))
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            behind = await _behind(admin, prefix)
            if not behind:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas not in sync after {timeout_s:.0f} s: {behind[:5]}")
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


async def _behind(admin: AIOKafkaAdminClient, prefix: str) -> list[str]:
    names = [
        t
        for t in await admin.list_topics()
        if t.startswith(f"{prefix}.") or t in ("__consumer_offsets", "__transaction_state")
    ]
    behind = []
    for entry in await admin.describe_topics(names):
        for p in entry["partitions"]:
            if p["leader"] < 0 or set(p["isr"]) != set(p["replicas"]):
                behind.append(f"{entry['topic']}/{p['partition']}")
    return behind
