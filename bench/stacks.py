"""Stacks the bench starts for itself: the four services on fresh topics, or the direct server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from bench.observe import DeploymentObserver
from bench.ports import free_port, free_port_pair
from deploy import test_ledger
from services.edge import keys as keyfile
from shared.kafka import create_topics, delete_topics, wait_for_broker
from shared.settings import TokenbusSettings
from shared.topics import Topics

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("ingest", "scheduler", "worker", "edge")
READY_TIMEOUT_S = 120.0  # a loaded 2-core machine can take this long to start a stack
STOP_TIMEOUT_S = 10.0
BENCH_LIMITS: dict[str, object] = {
    "rps": 1e6,
    "burst": 1_000_000,
    "concurrency": 1_000_000,
    "tokens_per_min": 10**12,
    "sockets": 1_000_000,
}


class StackError(Exception):
    """A stack did not start or died; the message carries the end of its log."""


@contextlib.asynccontextmanager
async def private_broker(say: Callable[[str], None] = print) -> AsyncIterator[str]:
    """A one-node broker of the bench's own, on free ports and a temporary state dir."""
    from deploy.kafka import launcher

    with tempfile.TemporaryDirectory(prefix="tokenbus-bench-kafka-") as state:
        cluster = launcher.Cluster(port=free_port_pair(), state_dir=Path(state))
        say(f"starting a private Kafka broker on port {cluster.port}")
        await asyncio.to_thread(launcher.start, cluster)
        try:
            yield cluster.bootstrap_servers
        finally:
            await asyncio.to_thread(launcher.stop, cluster)


class Stack:
    """Processes started for one policy; `ws_url` is where clients connect."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, source: Path = ROOT) -> None:
        self.name = name
        self.port = free_port()
        self.log_dir = log_dir
        # Whose services run: this checkout, or another one (an older commit, to compare).
        self.source = source
        path = os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))
        self.env = {
            **os.environ,
            "PYTHONPATH": path,
            "TOKENBUS_LOG_LEVEL": "WARNING",  # per-request INFO lines would cost CPU in the run
            "TOKENBUS_RESUME_SECRET": secrets.token_hex(16),
            **env,
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.observer: DeploymentObserver | None = None
        # A service run by another Python than the bench's: the vLLM worker's environment.
        self.pythons: dict[str, str] = {}

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/chat"

    @property
    def pids(self) -> dict[str, int]:
        """Process id of each service this stack started, by name."""
        return {key: proc.pid for key, proc in self.processes.items()}

    @property
    def worker_metrics_url(self) -> str | None:
        """The worker's Prometheus `/metrics` (engine CPU is read there), if it has one."""
        return None

    async def start(self) -> None:
        raise NotImplementedError

    async def wait_idle(self, timeout_s: float) -> bool:
        raise NotImplementedError

    def _spawn(self, key: str, module: str, env: dict[str, str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{self.name}-{key}.log", "ab") as log:
            # Own process group, so stopping it also ends whatever it spawned.
            self.processes[key] = subprocess.Popen(
                [self.pythons.get(key, sys.executable), "-m", module],
                cwd=self.source,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def _until_healthy(self) -> None:
        await self.until_answers(f"http://127.0.0.1:{self.port}/readyz", READY_TIMEOUT_S)

    async def until_answers(self, url: str, timeout_s: float) -> None:
        """Until `url` answers 200 (a /readyz); StackError if a process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(answers_200, url):
            self.check_alive()
            if time.monotonic() > deadline:
                raise StackError(f"{self.name}: {url} not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    def check_alive(self) -> None:
        for key, proc in self.processes.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{self.name}-{key}.log").read_text()[-2000:]
                raise StackError(f"{self.name}: {key} exited with {proc.returncode}:\n{tail}")

    async def stop(self) -> None:
        for proc in self.processes.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(p.poll() is None for p in self.processes.values()):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        for proc in self.processes.values():
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


class PipelineStack(Stack):
    """Ingest, scheduler, worker and edge on a fresh topic prefix of a running broker."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_dir: Path,
        bootstrap: str,
        tenants: tuple[str, ...] = (),
        source: Path = ROOT,
        workers: int = 1,
    ) -> None:
        self.prefix = f"bench{name}{uuid.uuid4().hex[:8]}"
        super().__init__(name, env, log_dir, source)
        self.worker_metrics_port = free_port()
        # More than one worker: each its own id and batches partition (the topic has 4).
        self.workers = workers
        self.env.update(
            KAFKA_BOOTSTRAP_SERVERS=bootstrap,
            TOKENBUS_TOPIC_PREFIX=self.prefix,
            TOKENBUS_EDGE_HOST="127.0.0.1",
            TOKENBUS_EDGE_PORT=str(self.port),
        )
        self.settings = TokenbusSettings(
            KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=self.prefix
        )
        # The edge requires a key: one for the bench (and one per extra tenant), with limits
        # the load never reaches.
        keys, self.api_key, _ = keyfile.add_key(keyfile.KeysFile(), "bench", BENCH_LIMITS, 0.0)
        self.api_keys: dict[str, str] = {}
        for tenant in tenants:
            keys, self.api_keys[tenant], _ = keyfile.add_key(keys, tenant, BENCH_LIMITS, 0.0)
        keys_file = (log_dir / f"{name}-keys.json").resolve()  # services may run elsewhere
        keyfile.save(keys_file, keys)
        self.env["TOKENBUS_EDGE_KEYS_FILE"] = str(keys_file)

    @property
    def ws_url(self) -> str:
        return f"ws://bench:{self.api_key}@127.0.0.1:{self.port}/v1/chat"

    def ws_url_as(self, tenant: str) -> str:
        """The chat URL with `tenant`'s key (one of the `tenants` it was made with)."""
        return f"ws://{tenant}:{self.api_keys[tenant]}@127.0.0.1:{self.port}/v1/chat"

    async def start(self) -> None:
        await wait_for_broker(self.settings, timeout_s=30)
        await create_topics(
            self.settings, Topics(self.prefix).partitions(), configs=self.settings.topic_configs()
        )
        # Counted with the tests' stacks when `make test` runs a bench (tests/test_bench_*).
        test_ledger.note(test_ledger.STACK, where=f"bench {self.name}")
        for name in SERVICES:
            env = self.env
            if name == "worker":
                env = {**env, "TOKENBUS_METRICS_PORT": str(self.worker_metrics_port)}
                if self.workers > 1:
                    env |= self.worker_env(0)
            self._spawn(name, f"services.{name}", env)
        # The extra workers: `worker-1`, `worker-2`, ... (the first keeps the name `worker`).
        for index in range(1, self.workers):
            env = {**self.env, "TOKENBUS_METRICS_PORT": str(free_port()), **self.worker_env(index)}
            self._spawn(f"worker-{index}", "services.worker", env)
        await self._until_healthy()
        self.observer = DeploymentObserver(self.settings)
        await self.observer.start()

    def start_worker(self, key: str, env: dict[str, str], python: str | None = None) -> None:
        """One more worker process, started now: the stack's variables, then `env`; run by
        `python` (the vLLM worker's environment) if given."""
        if python is not None:
            self.pythons[key] = python
        self._spawn(
            key, "services.worker", {**self.env, "TOKENBUS_METRICS_PORT": str(free_port()), **env}
        )

    def worker_env(self, index: int) -> dict[str, str]:
        """Worker `index`'s id and batches partition, when the stack runs several."""
        partitions = Topics(self.prefix).partitions()[Topics(self.prefix).batches]
        return {
            "TOKENBUS_WORKER_ID": f"{self.name}-w{index}",
            "TOKENBUS_WORKER_BATCH_PARTITION": str(index % partitions),
        }

    @property
    def worker_metrics_url(self) -> str | None:
        """The first worker's `/metrics`."""
        return f"http://127.0.0.1:{self.worker_metrics_port}/metrics"

    async def wait_idle(self, timeout_s: float) -> bool:
        assert self.observer is not None
        return await self.observer.wait_idle(timeout_s)

    async def stop(self) -> None:
        if self.observer is not None:
            await self.observer.stop()
        await super().stop()
        await delete_topics(self.settings, Topics(self.prefix).partitions())


class DirectStack(Stack):
    """`python -m bench.direct`: the engine behind a WebSocket, in one process."""

    async def start(self) -> None:
        env = {**self.env, "TOKENBUS_BENCH_DIRECT_PORT": str(self.port)}
        self._spawn("direct", "bench.direct", env)
        await self._until_healthy()

    async def wait_idle(self, timeout_s: float) -> bool:
        url = f"http://127.0.0.1:{self.port}/healthz"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                body = await asyncio.to_thread(_get, url)
                state = json.loads(body)
                if state.get("running") == 0 and state.get("queued") == 0:
                    return True
            await asyncio.sleep(0.1)
        return False


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=1.0) as response:
        body: bytes = response.read()
        return body


def answers_200(url: str) -> bool:
    """Whether `url` answers 200 within a second (a health probe)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _signal_group(proc: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)
