"""`tokenbus up`: broker, topics and the four services on one machine, in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from pydantic import Field

from deploy.kafka import launcher
from shared.kafka import wait_for_broker
from shared.settings import TokenbusSettings
from tokenbus.topics import ensure_topics

if TYPE_CHECKING:
    from tokenbus.cli import Subcommands

# Started in this order; stopped all at once.
SERVICES = ("ingest", "scheduler", "worker", "edge")
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.2


class UpSettings(TokenbusSettings):
    """Where the edge listens; `--host`/`--port` override the environment."""

    edge_host: str = Field(default="127.0.0.1", description="Edge bind address.")
    edge_port: int = Field(default=8000, ge=1, le=65535, description="Edge HTTP/WebSocket port.")


class UpError(Exception):
    """Start-up failed or a service died; the message names what and why."""


class Deployment:
    """The processes `up` owns: the services, and the broker if it started it."""

    def __init__(self, settings: UpSettings, broker: launcher.Cluster) -> None:
        self.settings = settings
        self.broker = broker
        self.owns_broker = False
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    async def run(self) -> int:
        """Run until SIGINT/SIGTERM (exit 0) or until something fails (exit 1)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            # Not raced against `stop`: a broker half-started by a cancelled thread could
            # not be stopped. A signal meanwhile takes effect once it is up.
            if "bootstrap_servers" not in self.settings.model_fields_set:
                _pid, self.owns_broker = await asyncio.to_thread(launcher.start, self.broker)
                self.settings = self.settings.model_copy(
                    update={"bootstrap_servers": self.broker.bootstrap_servers}
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
            if self.owns_broker:
                await asyncio.to_thread(launcher.stop, self.broker)
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    async def _serve(self) -> int:
        try:
            await wait_for_broker(self.settings)
        except TimeoutError as exc:
            raise UpError(str(exc)) from exc
        await ensure_topics(self.settings)
        began = time.monotonic()
        self._spawn_services()
        await self._until_healthy(began + READY_TIMEOUT_S)
        host, port = self.settings.edge_host, self.settings.edge_port
        print(
            f"tokenbus up: ready in {time.monotonic() - began:.1f} s "
            f"(Kafka at {self.settings.bootstrap_servers})\n"
            f"  chat page  http://{host}:{port}/\n"
            f"  WebSocket  ws://{host}:{port}/v1/chat\n"
            "Ctrl-C stops everything.",
            flush=True,
        )
        while True:
            self._raise_if_a_child_exited()
            await asyncio.sleep(POLL_S)

    def _spawn_services(self) -> None:
        env = dict(os.environ)
        env["KAFKA_BOOTSTRAP_SERVERS"] = self.settings.bootstrap_servers
        env["TOKENBUS_EDGE_HOST"] = self.settings.edge_host
        env["TOKENBUS_EDGE_PORT"] = str(self.settings.edge_port)
        # Locally there is rarely a GPU: the simulator unless the user chose an engine.
        env.setdefault("TOKENBUS_WORKER_ENGINE", "sim")
        env.setdefault("TOKENBUS_TRACE_DIR", os.path.abspath(".tokenbus/traces"))  # tokenbus trace
        # One resume key for every edge this deployment runs, unless the operator set one.
        env.setdefault("TOKENBUS_RESUME_SECRET", secrets.token_urlsafe(32))
        for name in SERVICES:
            # Own process group: Ctrl-C reaches only `up`, which stops the services in
            # order, and killing the group also ends anything a service spawned (vLLM's
            # engine core runs in a child process).
            self.children[name] = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}"], env=env, start_new_session=True
            )
            print(f"tokenbus up: started {name} (pid {self.children[name].pid})", flush=True)

    async def _until_healthy(self, deadline: float) -> None:
        url = f"http://{self.settings.edge_host}:{self.settings.edge_port}/healthz"
        while True:
            # Checked first: ready means the edge answers *and* no service has died.
            self._raise_if_a_child_exited()
            if await asyncio.to_thread(_answers_200, url):
                return
            if time.monotonic() > deadline:
                raise UpError(f"{url} did not answer 200 within {READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(POLL_S)

    def _raise_if_a_child_exited(self) -> None:
        for name, child in self.children.items():
            code = child.poll()
            if code is not None:
                raise UpError(f"service {name} (pid {child.pid}) exited with code {code}")

    async def _stop_children(self) -> None:
        """SIGTERM every service's process group, SIGKILL what is left after a timeout."""
        for child in self.children.values():
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(c.poll() is None for c in self.children.values()):
            if time.monotonic() > deadline:
                stuck = [n for n, c in self.children.items() if c.poll() is None]
                print(f"tokenbus up: killing {', '.join(stuck)} after {STOP_TIMEOUT_S:.0f} s")
                break
            await asyncio.sleep(0.05)
        for child in self.children.values():
            # Also after a clean exit: whatever the service left in its group goes too.
            _signal_group(child, signal.SIGKILL)
            child.wait()


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
    parser.set_defaults(handler=_up)


def _up(args: argparse.Namespace) -> int:
    overrides = {"edge_host": args.host, "edge_port": args.port}
    settings = UpSettings(**{k: v for k, v in overrides.items() if v is not None})
    return asyncio.run(Deployment(settings, launcher.Cluster.resolve(args.kafka_port)).run())
