"""A real tokenbus stack for integration tests: four service processes on a real broker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from pydantic import SecretStr

from bench.ports import free_port
from deploy import test_ledger as ledger
from deploy.kafka import launcher
from deploy.kafka import secure as secured
from services.edge import keys as keyfile
from services.edge.resume import ResumeKeys
from shared.kafka import create_topics, delete_topics, make_admin, make_consumer, wait_for_broker
from shared.messages import Heartbeat, Tier
from shared.resets import SETTLE_REASON
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.stack_dumps import dump_stacks

ROOT = Path(__file__).resolve().parent.parent
CLI = "import sys; from tokenbus.cli import main; sys.exit(main())"  # `tokenbus`, by -c
SERVICES = ("ingest", "scheduler", "worker", "edge")
# Every stack's keys file has a key for each of these tenants; `default` is in `ws_url`.
TENANTS = ("default", "alice", "bob", "mallory")
# Limits no functional test reaches; quota tests give their tenant its own.
UNLIMITED: dict[str, object] = {
    "rps": 1e6,
    "burst": 1_000_000,
    "concurrency": 1_000_000,
    "tokens_per_min": 10**12,
    "sockets": 1_000_000,
}
# The timeouts a broker outage or hang must outlast to test what it is meant to (ADR 0065):
# batches expire and producers break, group sessions and the edge's lease lapse, models go
# stale, error answers give up. Short in the fault tests' stacks, so that a fault of
# FAULT_WINDOW_S outlasts each of them twice over; the production defaults are 10-30 s.
SHORT_CLIENT_TIMEOUTS: dict[str, str] = {
    "TOKENBUS_KAFKA_PRODUCER_REQUEST_TIMEOUT_MS": "4000",
    "TOKENBUS_INGEST_PUBLISH_TIMEOUT_MS": "4000",  # ingest's producer
    "TOKENBUS_KAFKA_SESSION_TIMEOUT_MS": "6000",  # the broker's group.min.session.timeout.ms
    "TOKENBUS_EDGE_LEASE_TTL_S": "4",
    "TOKENBUS_EDGE_MODELS_STALE_S": "4",
    "TOKENBUS_WORKER_RESULT_WRITE_TIMEOUT_S": "4",
}
FAULT_WINDOW_S = 12.0
# The fault tests' stack (`fault_stack`, one for the session on the faultable broker): the
# short timeouts, a sim slow enough that streams are still running when the broker goes
# (8 tokens/s: 100 tokens take 12 s), a stalled stream given up soon after the broker is
# back, and ingest's retries backing off to 2 s so that it is seen back soon.
FAULT_STACK_ENV: dict[str, str] = {
    **SHORT_CLIENT_TIMEOUTS,
    "TOKENBUS_WORKER_SIM_TOKEN_RATE": "8",
    "TOKENBUS_EDGE_STREAM_STALL_S": "20",
    "TOKENBUS_INGEST_RETRY_BACKOFF_MAX_MS": "2000",
}


def wait_until(predicate: object, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll `predicate()` until it is true; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@dataclass
class Stack:
    bootstrap: str
    prefix: str
    log_dir: Path
    env_overrides: dict[str, str] = field(default_factory=dict)
    # Kafka security as `TOKENBUS_KAFKA_*` variables: `client_env` for the stack's own
    # clients (topic setup, reads, teardown), `service_env` per service name on top of
    # `env_overrides`. Both empty: PLAINTEXT.
    client_env: dict[str, str] = field(default_factory=dict)
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    ready_timeout_s: float = 60.0
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    edge_port: int = 0
    # One per stack, strong (the edge refuses weak ones), shared by all its edges.
    resume_secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    # Tenants beyond TENANTS, or other limits for them: name -> TenantLimits fields.
    tenant_limits: dict[str, dict[str, object]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> its API key
    # The source tree the services run from (this checkout's by default), and by key where
    # one runs another (a rolling upgrade runs two releases side by side: tests/upgrade/).
    tree: Path = ROOT
    trees: dict[str, Path] = field(default_factory=dict)
    # Service key -> its /metrics, /healthz, /readyz port (an edge's is not its HTTP port,
    # which answers /healthz and /readyz but never /metrics).
    health_ports: dict[str, int] = field(default_factory=dict)
    # The workers `start` runs: service key -> its own variables (an engine, a model).
    workers: dict[str, dict[str, str]] = field(default_factory=lambda: {"worker": {}})
    # Counted in the run's ledger once, by the first service it starts, whatever path a
    # test takes to start it (`start`, a start of its own, or a single service).
    counted: bool = field(default=False, repr=False)

    @classmethod
    def logged_in(
        cls, cluster: launcher.Cluster, prefix: str, log_dir: Path, **fields: Any
    ) -> Stack:
        """A stack on a secured cluster: its own clients log in as the admin, each service as
        its own principal (whose ACLs the caller grants)."""
        return cls(
            bootstrap=cluster.bootstrap_servers,
            prefix=prefix,
            log_dir=log_dir,
            client_env=cluster.client_env(secured.ADMIN),
            service_env={name: cluster.client_env(name) for name in SERVICES},
            **fields,
        )

    def __post_init__(self) -> None:
        keys = keyfile.KeysFile()
        for tenant in dict.fromkeys([*TENANTS, *self.tenant_limits]):
            limits = self.tenant_limits.get(tenant, UNLIMITED)
            keys, self.keys[tenant], _ = keyfile.add_key(keys, tenant, limits, time.time())
        keyfile.save(self.keys_file, keys)

    @property
    def keys_file(self) -> Path:
        return self.log_dir / f"{self.prefix}-keys.json"

    @property
    def topics(self) -> Topics:
        return Topics(self.prefix)

    @property
    def settings(self) -> TokenbusSettings:
        return settings_from_env(
            self.client_env, KAFKA_BOOTSTRAP_SERVERS=self.bootstrap, topic_prefix=self.prefix
        )

    @property
    def resume_keys(self) -> ResumeKeys:
        """The keys the stack's edges sign resume tokens with (to forge or read tokens)."""
        return ResumeKeys.from_settings(SecretStr(self.resume_secret), None)

    @property
    def ws_url(self) -> str:
        """The chat WebSocket, with the `default` tenant's key in it (sent as Basic auth)."""
        return self.ws_url_as("default")

    def ws_url_as(self, tenant: str | None, port: int | None = None) -> str:
        """The chat WebSocket of an edge with `tenant`'s key in it; None: no credentials."""
        creds = f"{tenant}:{self.keys[tenant]}@" if tenant is not None else ""
        return f"ws://{creds}127.0.0.1:{port or self.edge_port}/v1/chat"

    @property
    def http_url(self) -> str:
        return self.http_url_at(self.edge_port)

    def http_url_at(self, port: int) -> str:
        """The HTTP base of the stack's edge on `port` (one started by `own_edge`)."""
        return f"http://127.0.0.1:{port}"

    def tokenbus(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`tokenbus ARGS` (the CLI), run as an operator would, against this stack's broker."""
        return subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from tokenbus.cli import main; sys.exit(main())",
                *args,
            ],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            KAFKA_BOOTSTRAP_SERVERS=self.bootstrap,
            TOKENBUS_TOPIC_PREFIX=self.prefix,
            TOKENBUS_EDGE_PORT=str(self.edge_port),
            TOKENBUS_RESUME_SECRET=self.resume_secret,
            TOKENBUS_EDGE_KEYS_FILE=str(self.keys_file),
            TOKENBUS_WORKER_SIM_TOKEN_RATE="200",
            TOKENBUS_LOG_LEVEL="INFO",
            # A test's edges run no batch (ADR 0075) unless it asks: a shared stack's edges
            # come and go with the modules that start them, and would take a batch along.
            TOKENBUS_EDGE_BATCH_RUNNER="false",
            PYTHONPATH=str(ROOT),
        )
        env.update(self.env_overrides)
        return env

    def start_service(self, name: str, key: str | None = None, **env: str) -> None:
        key = key or name
        full = self.env()
        full.update(self.service_env.get(name, {}))
        full.update(env)
        # Its own port, not the service's default: stacks run side by side.
        full.setdefault("TOKENBUS_METRICS_PORT", str(free_port()))
        self.health_ports[key] = int(full["TOKENBUS_METRICS_PORT"])
        if not self.counted:
            ledger.note(ledger.STACK, where=os.environ.get("PYTEST_CURRENT_TEST", self.prefix))
            self.counted = True
        if name == "worker" and (load := ledger.engine_load(full.get("TOKENBUS_WORKER_ENGINE"))):
            ledger.note(load, where=f"{self.prefix}-{key}")
        tree = self.trees.get(key, self.tree)
        full["PYTHONPATH"] = str(tree)
        with open(self.log_dir / f"{self.prefix}-{key}.log", "ab") as log:
            self.processes[key] = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}"],
                cwd=tree,
                env=full,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @contextlib.contextmanager
    def own_edge(self, key: str, **env: str) -> Iterator[int]:
        """Another edge of this stack, started under `key` on a port of its own (with `env`
        on top of the stack's), for one module: yields its port once it is ready; stopped
        and forgotten when the block ends (a module on the shared stack that kills an edge,
        reads an edge's gauges or needs an edge's settings of its own uses one)."""
        port = free_port()
        self.start_service("edge", key=key, TOKENBUS_EDGE_PORT=str(port), **env)
        try:
            wait_until(lambda: self.edge_ready(port), 60, f"{key}'s /readyz")
            yield port
        finally:
            self.stop_service(key)
            self.processes.pop(key)
            self.health_ports.pop(key, None)

    def start(self) -> Stack:
        settings = self.settings
        asyncio.run(_create(settings, self.topics))
        self.edge_port = free_port()
        for name in SERVICES:
            if name != "worker":
                self.start_service(name)
        for key, env in self.workers.items():
            self.start_service("worker", key, **env)
        wait_until(self.edge_ready, self.ready_timeout_s, "the edge's /readyz")
        return self

    def edge_ready(self, port: int | None = None) -> bool:
        self.check_alive()
        try:
            url = f"http://127.0.0.1:{port or self.edge_port}/readyz"
            with urllib.request.urlopen(url, timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def health(self, key: str, path: str) -> tuple[int, dict[str, Any]]:
        """GET `path` (/healthz, /readyz, …) of the service started under `key`: the status
        and the JSON body; (0, {}) if nothing answers."""
        port = self.edge_port if key == "edge" else self.health_ports[key]
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return int(r.status), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return int(e.code), json.loads(e.read())
        except OSError:
            return 0, {}

    def metrics(self, key: str) -> str:
        """The /metrics text of the service started under `key` (an edge's: on its metrics
        port, `health_ports[key]`)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.health_ports[key]}/metrics", timeout=10) as r:
            body: bytes = r.read()
        return body.decode()

    def edge_metrics(self, key: str = "edge") -> str:
        """The /metrics text of the edge started under `key`."""
        return self.metrics(key)

    def check_alive(self) -> None:
        for key, proc in self.processes.items():
            if proc.poll() is not None and proc.returncode not in (0, -9, -15):
                log = (self.log_dir / f"{self.prefix}-{key}.log").read_text()[-3000:]
                raise AssertionError(f"service {key} exited with {proc.returncode}:\n{log}")

    def stop_service(self, key: str, sig: int = signal.SIGTERM) -> None:
        proc = self.processes[key]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    @property
    def request_topics(self) -> tuple[str, ...]:
        """Where an edge writes a new request: `tokenbus.requests` (one the response cache may
        answer) or straight to its tier topic (ADR 0041). Ingest's forwards land there too."""
        return (self.topics.requests, *(self.topics.tier(t) for t in Tier))

    async def read_requests(self) -> list[bytes]:
        """Every record value on the topics new requests go to (`request_topics`) now."""
        return [v for topic in self.request_topics for v in await self.read_async(topic)]

    async def requested_prompts(self) -> list[str]:
        """The prompt of every request on the topics new requests go to now ("" for none)."""
        return [json.loads(v).get("prompt") or "" for v in await self.read_requests()]

    def exited(self) -> dict[str, int]:
        """The exit codes of the stack's services that are no longer running, by key."""
        return {k: code for k, p in self.processes.items() if (code := p.poll()) is not None}

    def workers_heard(self) -> set[str]:
        """The ids of the workers whose heartbeats are on the workers topic now."""
        return {Heartbeat.model_validate_json(v).worker_id for v in self.read(self.topics.workers)}

    def read(self, topic: str) -> list[bytes]:
        """Every record value on one of the stack's topics, read from the beginning now."""
        return asyncio.run(read_topic(self.settings, topic, self.topics.partitions()[topic]))

    async def read_async(self, topic: str) -> list[bytes]:
        """`read`, from a test that runs in an event loop already."""
        return await read_topic(self.settings, topic, self.topics.partitions()[topic])

    def log(self, key: str) -> Path:
        """The log file of the service started under `key`."""
        return self.log_dir / f"{self.prefix}-{key}.log"

    def dump_stacks(self) -> dict[str, list[str]]:
        """Where every task of every running service waits (tests/stack_dumps.py), by key."""
        return dump_stacks({key: (proc, self.log(key)) for key, proc in self.processes.items()})

    def stop(self) -> None:
        """Signals every service at once, then waits for all (each has 20 s to exit, then
        SIGKILL): one at a time, a stack of six took up to six shutdowns in a row."""
        running = {k: p for k, p in self.processes.items() if p.poll() is None}
        for proc in running.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in running.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        asyncio.run(_delete_all(self.settings, self.topics))


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone between poll() and here
        os.killpg(proc.pid, sig)


async def _create(settings: TokenbusSettings, topics: Topics) -> None:
    await wait_for_broker(settings, timeout_s=60)
    await create_topics(settings, topics.partitions(), configs=settings.topic_configs())


async def _delete_all(settings: TokenbusSettings, topics: Topics) -> None:
    # Services also make topics of their own under the prefix (the edge's lease log and
    # per-request result topics), so everything under it goes.
    admin = make_admin(settings)
    await admin.start()
    try:
        mine = [t for t in await admin.list_topics() if t.startswith(topics.prefix + ".")]
    finally:
        await admin.close()
    await delete_topics(settings, [*topics.partitions(), *mine])


def settles(record: Mapping[str, Any]) -> bool:
    """A hand-back's settle record: a `reset` of the attempt already running, which readers
    drop (shared/resets.py)."""
    return record.get("kind") == "reset" and record.get("reason") == SETTLE_REASON


def announces(record: Mapping[str, Any]) -> bool:
    """A `reset` result record that announces a new attempt (not a settle record)."""
    return record.get("kind") == "reset" and not settles(record)


async def read_topic(settings: TokenbusSettings, topic: str, partitions: int) -> list[bytes]:
    """Every record value on `topic` now, all partitions, oldest first per partition."""
    return [r.value or b"" for r in await read_records(settings, topic, partitions)]


async def read_records(
    settings: TokenbusSettings, topic: str, partitions: int, client_id: str = "stack-reader"
) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record on `topic` now, all partitions, oldest first per partition, read under
    `settings`' login (no group: READ only)."""
    consumer = make_consumer(settings, group_id=None, client_id=client_id)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        out: list[ConsumerRecord[bytes, bytes]] = []
        todo = {tp for tp in parts if ends[tp] > 0}
        while todo:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out.extend(records)
            todo = {tp for tp in todo if await consumer.position(tp) < ends[tp]}
        return out
    finally:
        await consumer.stop()


async def read_partition(
    settings: TokenbusSettings, tp: TopicPartition, count: int, within_s: float = 30.0
) -> list[bytes]:
    """The values on one partition from its start: `count` of them (or all that came within
    `within_s` seconds), and any more one further fetch finds (a duplicate would show there)."""
    consumer = make_consumer(settings, group_id=None, client_id="stack-reader")
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        values: list[bytes] = []
        deadline = time.monotonic() + within_s
        while len(values) < count and time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            values += [r.value or b"" for r in batch.get(tp, [])]
        batch = await consumer.getmany(tp, timeout_ms=500)
        return values + [r.value or b"" for r in batch.get(tp, [])]
    finally:
        await consumer.stop()


def settings_from_env(env: Mapping[str, str], **values: Any) -> TokenbusSettings:
    """Settings from variables given as a mapping (`TOKENBUS_*`, `KAFKA_BOOTSTRAP_SERVERS`),
    over the process's environment; `values` (field names) win."""
    names = {f"TOKENBUS_{name.upper()}": name for name in TokenbusSettings.model_fields}
    names["KAFKA_BOOTSTRAP_SERVERS"] = "KAFKA_BOOTSTRAP_SERVERS"
    given = {names[k]: v for k, v in env.items() if k in names}
    if "KAFKA_BOOTSTRAP_SERVERS" in values or "bootstrap_servers" in values:
        given.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    return TokenbusSettings(**{**given, **values})


def new_prefix() -> str:
    return "t" + uuid.uuid4().hex[:10]
