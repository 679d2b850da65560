"""The system under chaos: every service as a process (two workers, two edges) and the injector.

The injector plays a fault plan: it kills a process with SIGKILL at the planned time and, as a
supervisor would, starts it again after the planned pause. A node fault strikes the node that
leads the planned partition at that moment (`Brokers`, present when the run has a cluster):
kill -9 and a restart, SIGSTOP and SIGCONT, or a network fault on the services' link to it
(`Network`: Toxiproxy between the services and each node). Each fault played leaves a
window (from its strike to its end) for the availability figures.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from deploy.kafka import launcher
from services.worker.engine_health import EXIT_ENGINE_SICK
from shared.kafka import create_topics, make_admin, wait_for_broker
from shared.messages import Heartbeat
from shared.settings import TokenbusSettings
from tests.chaos.availability import FaultWindow
from tests.chaos.faults import BROKER_KINDS, ENGINE_KINDS, HANG_KINDS, Fault
from tests.chaos.toxiproxy import Toxiproxy
from tests.stack import Stack, free_port, new_prefix
from tests.stack_dumps import dump_stacks

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
    # A hung engine (`engine-hang`) is seen after 3 s without output while it holds work.
    "TOKENBUS_WORKER_ENGINE_STALL_S": "3",
}
# How long an engine fault may take to end its worker: the stall, the watch, the last beat.
ENGINE_EXIT_S = 20.0


class Brokers(Protocol):
    """What the injector needs of a cluster: who leads a partition, kill -9, restart."""

    def leader(self, topic: str, partition: int) -> int: ...

    def coordinator(self, group: str) -> int: ...

    def kill(self, node: int) -> None: ...

    def restart(self, node: int) -> None: ...

    def pause(self, node: int) -> None: ...

    def resume(self, node: int) -> None: ...


class Network(Protocol):
    """What the injector needs of the links between the services and each node."""

    def apply(self, kind: str, node: int) -> None: ...

    def clear(self, node: int) -> None: ...


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


async def _create_topics(stack: Stack) -> None:
    await wait_for_broker(stack.settings, timeout_s=60)
    await create_topics(stack.settings, stack.topics.partitions())


async def _coordinator(bootstrap: str, group: str) -> int:
    admin = make_admin(TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap))
    await admin.start()
    try:
        return int(await admin.find_coordinator(group))
    finally:
        await admin.close()


@dataclass(frozen=True)
class ProxiedLinks:
    """`Network` over Toxiproxy: each network fault kind as the toxic that plays it."""

    proxy: Toxiproxy

    def apply(self, kind: str, node: int) -> None:
        if kind == "net-latency":
            self.proxy.latency(node, ms=100, jitter_ms=30)
        elif kind == "net-bandwidth":
            self.proxy.bandwidth(node, kb_per_s=32)
        elif kind == "net-black-hole":
            self.proxy.black_hole(node)
        elif kind == "net-reset":
            self.proxy.reset_peer(node)
        elif kind == "net-slow-close":
            self.proxy.slow_close(node, delay_ms=2000)
        else:
            raise ValueError(f"no network fault {kind!r}")

    def clear(self, node: int) -> None:
        self.proxy.clear(node)


@dataclass(frozen=True)
class LocalCluster:
    """`Brokers` of a local KRaft cluster started by the project's launcher; `network`:
    its proxies, when the services reach it through Toxiproxy."""

    cluster: launcher.Cluster
    network: Network | None = None

    def leader(self, topic: str, partition: int) -> int:
        return asyncio.run(_leader(self.cluster.bootstrap_servers, topic, partition))

    def coordinator(self, group: str) -> int:
        return asyncio.run(_coordinator(self.cluster.bootstrap_servers, group))

    def kill(self, node: int) -> None:
        launcher.kill_node(self.cluster, node)

    def restart(self, node: int) -> None:
        launcher.start_node(self.cluster, node)

    def pause(self, node: int) -> None:
        self._signal(node, signal.SIGSTOP)

    def resume(self, node: int) -> None:
        self._signal(node, signal.SIGCONT)

    def _signal(self, node: int, sig: signal.Signals) -> None:
        pid = launcher.running_pid(self.cluster.node(node))
        if pid is None:
            raise RuntimeError(f"node {node} is not running: cannot send it {sig.name}")
        os.kill(pid, sig)


def _fault_file(stack: Stack, worker: str) -> str:
    return str(stack.log_dir / f"{stack.prefix}-worker-{worker}.fault")


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


def fresh_run_dir(path: Path) -> Path:
    """`path` emptied, with its `logs/` folder: a check's run directory, kept after it for a
    post-mortem and cleared by the next run."""
    shutil.rmtree(path, ignore_errors=True)
    (path / "logs").mkdir(parents=True)
    return path


def chaos_stack(cluster: launcher.Cluster, run_dir: Path, **env: str) -> Stack:
    """A stack on `cluster` with the chaos settings (CHAOS_ENV, `env` on top), logging under
    `run_dir`; `ChaosSystem.start` starts its processes."""
    return Stack(
        bootstrap=cluster.bootstrap_servers,
        prefix=new_prefix(),
        log_dir=run_dir / "logs",
        env_overrides={**CHAOS_ENV, **env},
    )


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
            "worker-a": Service(
                "worker", "worker", {"TOKENBUS_WORKER_SIM_FAULT_FILE": _fault_file(stack, "a")}
            ),
            "worker-b": Service(
                "worker",
                "worker-b",
                {
                    "TOKENBUS_WORKER_ID": "worker-b",
                    "TOKENBUS_WORKER_BATCH_PARTITION": "1",
                    "TOKENBUS_WORKER_SIM_FAULT_FILE": _fault_file(stack, "b"),
                },
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

    @property
    def api_urls(self) -> list[str]:
        """The OpenAI API of each edge (with the `default` tenant's key, `api_key`)."""
        return [f"http://127.0.0.1:{port}/v1" for port in (self.stack.edge_port, self.port_b)]

    @property
    def api_key(self) -> str:
        return self.stack.keys["default"]

    def launch(self, name: str) -> None:
        service = self.services[name]
        if (proc := self.stack.processes.get(service.key)) is not None and proc.poll() is None:
            # Two faults on one instance at once would leave a process no one stops.
            raise RuntimeError(f"{name} is running already (pid {proc.pid}): not started twice")
        self.stack.start_service(service.module, key=service.key, **service.env)

    def kill(self, name: str) -> None:
        self.stack.stop_service(self.services[name].key, signal.SIGKILL)

    def break_engine(self, name: str, fault: str) -> int | None:
        """Make worker `name`'s engine die or hang (`dead`, `hang`); wait until the worker
        exits on its own, as it must; its exit code (None: it did not within ENGINE_EXIT_S,
        and it is killed)."""
        service = self.services[name]
        Path(service.env["TOKENBUS_WORKER_SIM_FAULT_FILE"]).write_text(fault)
        proc = self.stack.processes[service.key]
        try:
            return proc.wait(timeout=ENGINE_EXIT_S)
        except subprocess.TimeoutExpired:
            self.kill(name)
            return None

    def dump_stacks(self, timeout_s: float = 10.0) -> dict[str, list[str]]:
        """Where every task of every running service waits (tests/stack_dumps.py), by name."""
        running = {
            name: (proc, self.stack.log(service.key))
            for name, service in self.services.items()
            if (proc := self.stack.processes.get(service.key)) is not None
        }
        return dump_stacks(running, timeout_s)

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
    network: Network | None = None
    done: list[str] = field(default_factory=list)
    windows: list[FaultWindow] = field(default_factory=list)  # one per fault played
    self_exits: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # not begun when the load ended
    # Engine faults whose worker did not exit by itself with EXIT_ENGINE_SICK in time.
    engine_misses: list[str] = field(default_factory=list)
    closed: bool = False  # the load has ended: no fault begins any more
    _down: set[str] = field(default_factory=set)  # killed by a fault, not yet restarted
    _one_node: asyncio.Lock = field(default_factory=asyncio.Lock)
    _instances: dict[str, asyncio.Lock] = field(default_factory=dict)  # by service instance

    async def run(self, faults: list[Fault], zero: float) -> None:
        """Each fault strikes at its own time; node faults one after another (see below), and
        faults on one service instance too."""
        async with asyncio.TaskGroup() as tg:
            for fault in faults:
                tg.create_task(self._at(fault, zero))

    async def _at(self, fault: Fault, zero: float) -> None:
        delay = zero + fault.at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if fault.node_fault:
            async with self._one_node:
                if not self._skip(fault, zero):
                    await self._strike_node(fault, zero)
            return
        # One fault at a time per service instance: a kill of a worker whose engine fault
        # still waits for it to exit would take that exit for the engine fault's (seen: -9).
        async with self._instances.setdefault(fault.target, asyncio.Lock()):
            if self._skip(fault, zero):
                return
            if fault.kind in ENGINE_KINDS:
                await self._break_engine(fault, zero)
            else:
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
        label = f"kill -9 {fault.target}"
        self._played(f"t={struck:5.1f}s {label}", zero, label, struck)

    async def _break_engine(self, fault: Fault, zero: float) -> None:
        """The worker's engine dies or hangs; the worker must exit by itself (code 70),
        and is started again `down_s` later, as its supervisor would."""
        struck = time.monotonic() - zero
        self._down.add(fault.target)
        how = fault.kind.removeprefix("engine-")
        try:
            code = await asyncio.to_thread(self.system.break_engine, fault.target, how)
            await asyncio.sleep(fault.down_s)
            self.system.launch(fault.target)
        finally:
            self._down.discard(fault.target)
        if code != EXIT_ENGINE_SICK:
            self.engine_misses.append(f"{fault.describe()}: exit code {code}")
        label = f"engine {how} {fault.target}"
        self._played(f"t={struck:5.1f}s {label} (exit {code})", zero, label, struck)

    async def _strike_node(self, fault: Fault, zero: float) -> None:
        """Strike the node leading the fault's partition; undo it; wait until it is back.

        Called under `_one_node`: a JVM takes from seconds to a minute to start on a busy
        machine, and the next node fault waits until every node is back, so at most one
        node of three is ever away (the cluster's min.insync.replicas=2 holds). Service
        faults do not wait for it.
        """
        if self.brokers is None:
            raise RuntimeError(f"{fault.describe()}: this run has no cluster to strike")
        brokers = self.brokers
        topic_kind, partition = fault.target.split("/")
        topics = self.system.stack.topics
        topic = topics.requests if topic_kind == "requests" else topics.results
        if fault.kind in HANG_KINDS and os.environ.get("TOKENBUS_CHAOS_HANG") == "coordinator":
            # For a diagnosis: hang the node coordinating the scheduler's group instead
            # (findings 14 and 16 showed only when the hung node was that one).
            group = f"{self.system.stack.prefix}.scheduler"
            node = await asyncio.to_thread(brokers.coordinator, group)
            of = f"coordinator of {group}"
        else:
            node = await asyncio.to_thread(brokers.leader, topic, int(partition))
            of = f"leader of {fault.target}"
        struck = time.monotonic() - zero
        if fault.kind in BROKER_KINDS:
            await asyncio.to_thread(brokers.kill, node)
            await asyncio.sleep(fault.down_s)
            await asyncio.to_thread(brokers.restart, node)
            what = f"kill -9 broker node {node}"
        elif fault.kind in HANG_KINDS:
            await asyncio.to_thread(brokers.pause, node)
            try:
                await asyncio.sleep(fault.down_s)
            finally:
                await asyncio.to_thread(brokers.resume, node)
            what = f"SIGSTOP broker node {node} for {fault.down_s:.1f}s"
        else:
            if self.network is None:
                raise RuntimeError(f"{fault.describe()}: this run has no proxies to fault")
            await asyncio.to_thread(self.network.apply, fault.kind, node)
            try:
                await asyncio.sleep(fault.down_s)
            finally:
                await asyncio.to_thread(self.network.clear, node)
            what = f"{fault.kind} on node {node} for {fault.down_s:.1f}s"
        label = f"{fault.kind} (node {node})"
        self._played(f"t={struck:5.1f}s {what} ({of})", zero, label, struck)

    def _played(self, what: str, zero: float, label: str, struck: float) -> None:
        ended = time.monotonic() - zero
        line = f"{what}; over at t={ended:5.1f}s"
        self.done.append(line)
        self.windows.append(FaultWindow(label, struck, ended))
        self.log(line)
