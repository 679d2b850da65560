"""`/healthz` (the process answers) and `/readyz` (Kafka answers, partitions assigned).

One implementation for every service: each runs `with_health`, which serves them with
`/metrics` on `TOKENBUS_METRICS_PORT` in the service's own event loop, so a blocked loop fails
`/healthz` too. The edge also mounts `health_routes` on its public app (load balancers probe
it there); its `/metrics` is only on the metrics port. Each service passes its readiness
check, a coroutine returning a `Readiness`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Protocol

import structlog
import uvicorn
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

log = structlog.get_logger()

# Where /metrics, /healthz and /readyz are served when TOKENBUS_METRICS_PORT is unset:
# distinct per service, so `tokenbus up` runs all of them on one machine.
DEFAULT_PORTS = {"edge": 9100, "ingest": 9101, "scheduler": 9102, "worker": 9103}
# Longest a readiness probe waits for the broker's answer to a metadata request.
PROBE_TIMEOUT_S = 2.0


class Readiness(BaseModel):
    """What `/readyz` answers (200 when `ready`, else 503)."""

    ready: bool
    reason: str = Field(description="`ok`, or why the service takes no work now.")
    partitions: list[str] = Field(
        default_factory=list, description="The partitions this process reads, `topic-N`."
    )

    @classmethod
    def not_ready(cls, reason: str) -> Readiness:
        return cls(ready=False, reason=reason)


ReadinessCheck = Callable[[], Awaitable[Readiness]]


class Ready(Protocol):
    """What answers a service's `/readyz` once it is built."""

    async def readiness(self) -> Readiness: ...


class Starting:
    """A service's `/readyz` from its first moment: `starting` until `built` hands over the
    runtime that answers it, then that runtime's answer. The one way every service wires
    its readiness to what it builds (the edge's is its lifespan's gateway)."""

    def __init__(self) -> None:
        self._runtime: Ready | None = None

    def built(self, runtime: Ready) -> None:
        self._runtime = runtime

    async def readiness(self) -> Readiness:
        runtime = self._runtime
        return Readiness.not_ready("starting") if runtime is None else await runtime.readiness()


async def consumer_readiness(
    consumers: Sequence[AIOKafkaConsumer | None], timeout_s: float = PROBE_TIMEOUT_S
) -> Readiness:
    """Ready when every consumer (None: not built yet) has partitions assigned and the
    broker answers a metadata request within `timeout_s`.

    A group member left without partitions (more members than partitions) is not ready:
    it takes no work, which is what a readiness probe is asked.
    """
    built = [c for c in consumers if c is not None]
    if not built or len(built) < len(consumers):
        return Readiness.not_ready("starting")
    partitions = sorted(f"{tp.topic}-{tp.partition}" for c in built for tp in c.assignment())
    if not partitions:
        return Readiness.not_ready("no partitions assigned")
    try:
        # A real round trip (aiokafka's `topics()` fetches fresh metadata): an outage shows
        # here at once, not only when the group's session times out.
        await asyncio.wait_for(built[0].topics(), timeout_s)
    except (KafkaError, TimeoutError, OSError) as exc:
        return Readiness(
            ready=False, reason=f"kafka unreachable: {type(exc).__name__}", partitions=partitions
        )
    return Readiness(ready=True, reason="ok", partitions=partitions)


def health_routes(check: ReadinessCheck) -> list[Route]:
    """`/healthz` and `/readyz`, for any Starlette app."""

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(request: Request) -> Response:
        readiness = await check()
        body = {"status": "ready" if readiness.ready else "not_ready", **readiness.model_dump()}
        return JSONResponse(body, status_code=200 if readiness.ready else 503)

    return [Route("/healthz", healthz), Route("/readyz", readyz)]


def health_app(check: ReadinessCheck, registry: CollectorRegistry = REGISTRY) -> Starlette:
    """`/healthz`, `/readyz` and `/metrics` of a service without an HTTP app of its own."""

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[*health_routes(check), Route("/metrics", metrics)])


class _InLoopServer(uvicorn.Server):
    """uvicorn beside a service's main coroutine: the service owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def health_port(service: str, configured: int | None) -> int:
    """The port `service` serves health on: the configured one, else its default; 0 = off."""
    return DEFAULT_PORTS[service] if configured is None else configured


async def with_health(
    main: Awaitable[None],
    *,
    service: str,
    port: int,
    host: str,
    check: ReadinessCheck,
    registry: CollectorRegistry = REGISTRY,
) -> None:
    """Run `main` with the health and metrics server beside it; stop the server after it.

    A port already in use (two services of one kind on one machine, each left at its
    default) is logged and the service runs without the server: its work matters more.
    """
    if port == 0:
        await main
        return
    try:
        sock = socket.create_server((host, port))
    except OSError as exc:
        log.error("health.unavailable", port=port, host=host, error=repr(exc))
        await main
        return
    config = uvicorn.Config(
        health_app(check, registry),
        lifespan="off",
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    server = _InLoopServer(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name=f"{service}-health")
    log.info("health.serving", port=port, host=host, paths="/healthz /readyz /metrics")
    try:
        await main
    finally:
        server.should_exit = True
        await serving
        sock.close()
