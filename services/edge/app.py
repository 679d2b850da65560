"""The edge process: WebSocket chat, chat page, health; its Kafka side is `runtime.py`.

What lives for the process (keys, metrics, telemetry, the OpenAI API's model directory),
the gateway once `runtime.running` has built it, and the routes: the WebSocket client
(`chat_socket.py`) and the OpenAI API (`openai/`). Its /metrics is not on the public app:
`__main__.py` serves it on the metrics port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from services.edge.auth import Guard
from services.edge.batch_job import BatchParts
from services.edge.batch_runner import BatchRunner
from services.edge.budget import ByteBudget
from services.edge.chat_socket import ChatSocket
from services.edge.drain import drain
from services.edge.gateway import Gateway
from services.edge.metrics import EdgeMetrics
from services.edge.models import ModelDirectory
from services.edge.openai.batches import BatchesApi
from services.edge.openai.edge_streams import EdgeStreams
from services.edge.openai.files import FilesApi
from services.edge.openai.request_ids import RequestIds
from services.edge.openai.routes import OpenAIApi
from services.edge.openai.server_surface import server_routes
from services.edge.page import SecurityHeaders
from services.edge.runtime import running
from services.edge.settings import EdgeSettings
from services.edge.telemetry import EdgeTelemetry
from shared.batch_jobs import BatchJobs
from shared.files import FileStore
from shared.health import Readiness, health_routes
from shared.metrics import EdgeRequestMetrics
from shared.topics import Topics

log = structlog.get_logger()

STATIC = Path(__file__).parent / "static"


class Edge:
    """The process: what lives for its whole life, and the gateway once Kafka is reached."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.edge_id = f"edge-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.metrics = EdgeMetrics()
        # Request traces and latency metrics, on the same registry as the edge's own metrics.
        self.telemetry = EdgeTelemetry(
            metrics=EdgeRequestMetrics.build(self.metrics.registry),
            results_topic=self.topics.results,
            trust_traceparent=settings.edge_trust_traceparent,
        )
        self.resume_keys = settings.resume_keys()
        # Keys, origins, quotas (auth.py); tenant ids are keyed by the resume keys.
        self.guard = Guard(settings, self.resume_keys)
        self.gateway: Gateway | None = None  # None until the lifespan reached Kafka
        self.files: FileStore | None = None  # the uploaded files (ADR 0074), as the gateway
        self.batches: BatchJobs | None = None  # the batches (ADR 0075), as the gateway
        # The weight of frames queued for all clients, WebSockets and HTTP (outbox.py).
        self.outbox_budget = ByteBudget(settings.edge_outbox_budget_bytes)
        # The OpenAI-compatible API (services/edge/openai/): the models workers advertise.
        self.openai = EdgeStreams(
            self.guard,
            lambda: self.gateway,
            settings.limits(),
            ModelDirectory(
                settings.edge_models_stale_s,
                pooled=frozenset(settings.served_models),
                routes=settings.routes,
            ),
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with running(self, on_lease_lost=self._lease_lost) as gateway:
            producer = gateway.link.producer
            files = FileStore(self.settings, self.topics, producer)
            batches = BatchJobs(self.settings, self.topics, producer)
            runner = None
            if self.settings.edge_batch_runner:
                parts = BatchParts(
                    self.settings,
                    self.topics,
                    gateway,
                    files,
                    producer,
                    self.settings.limits(),
                    asyncio.Semaphore(self.settings.edge_batch_window),
                    self.settings.edge_batch_progress_s,
                    self.metrics,
                )
                runner = asyncio.create_task(
                    BatchRunner(parts, self.edge_id).run(), name="batch-runner"
                )
            self.gateway, self.files, self.batches = gateway, files, batches
            try:
                yield
            finally:
                self.gateway = self.files = self.batches = None
                if runner is not None:
                    runner.cancel()
                    await asyncio.gather(runner, return_exceptions=True)
                await batches.stop()
                await files.stop()

    def start_drain(self) -> asyncio.Task[int] | None:
        """SIGTERM's first step (drain.py): None where the edge stops at once (starting, or
        its lease lost)."""
        gateway = self.gateway
        if gateway is None:
            return None
        return asyncio.create_task(drain(gateway, self.settings.edge_drain_s), name="edge-drain")

    def _lease_lost(self) -> None:
        """Another edge may own our results partition: stop serving, and exit."""
        self.gateway = None
        os.kill(os.getpid(), signal.SIGTERM)

    # -- HTTP -------------------------------------------------------------------------------

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): result partition leased and read, broker reachable."""
        gateway = self.gateway
        if gateway is None:
            return Readiness.not_ready("starting")
        if gateway.draining:
            return Readiness.not_ready("draining")
        if not gateway.link.health.reachable:
            return Readiness.not_ready("kafka unreachable")
        return Readiness(ready=True, reason="ok")

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def chat(self, ws: WebSocket) -> None:
        gateway = self.gateway
        if gateway is None:  # stopping
            await ws.send_denial_response(PlainTextResponse("the edge is not ready", 503))
            return
        upgrade = self.guard.upgrade(ws.headers.get("origin"), ws.headers.getlist("authorization"))
        if (refused := upgrade.refused) is not None:
            # An HTTP answer instead of a socket: no frame is ever read or sent.
            log.info("socket.refused", reason=refused.reason, origin=ws.headers.get("origin"))
            await ws.send_denial_response(PlainTextResponse(refused.text, refused.status))
            return
        await ChatSocket(gateway, self.metrics, ws, upgrade, self.outbox_budget).serve()


def build_app(edge: Edge) -> Starlette:
    """The public app: what clients and load balancers reach; no /metrics (docs/security.md)."""
    settings = edge.settings
    openai = OpenAIApi(
        edge.openai,
        settings.edge_max_frame_bytes,
        settings.edge_outbox_frames,
        keepalive_s=settings.edge_sse_keepalive_s,
        body_timeout_s=settings.edge_body_timeout_s,
        body_budget_bytes=settings.edge_body_budget_bytes,
        max_outbox_bytes=settings.edge_outbox_bytes,
        outbox_budget=edge.outbox_budget,
    )
    files = FilesApi(
        edge.openai,
        lambda: edge.files,
        max_bytes=settings.edge_file_max_bytes,
        uploads=settings.edge_file_uploads,
        upload_s=settings.edge_file_upload_s,
    )
    batches = BatchesApi(edge.openai, lambda: edge.batches, lambda: edge.files)
    return Starlette(
        routes=[
            Route("/", edge.index),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),  # the page's files
            *health_routes(edge.readiness),
            *server_routes(edge.readiness),  # vLLM's /health, /ping, /version
            WebSocketRoute("/v1/chat", edge.chat),
            Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
            Route("/v1/completions", openai.completions, methods=["POST"]),
            Route("/v1/models", openai.models),
            Route("/v1/models/{model:path}", openai.model),  # ids may hold `/` (org/name)
            Route("/v1/files", files.upload, methods=["POST"]),
            Route("/v1/files", files.list, methods=["GET"]),
            Route("/v1/files/{file_id}", files.retrieve, methods=["GET"]),
            Route("/v1/files/{file_id}", files.delete, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", files.content, methods=["GET"]),
            Route("/v1/batches", batches.create, methods=["POST"]),
            Route("/v1/batches", batches.list, methods=["GET"]),
            Route("/v1/batches/{batch_id}", batches.retrieve, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", batches.cancel, methods=["POST"]),
        ],
        middleware=[
            Middleware(SecurityHeaders),  # the chat page's CSP (page.py)
            Middleware(RequestIds),  # `X-Request-Id` on every `/v1/` answer
        ],
        lifespan=edge.lifespan,
    )
