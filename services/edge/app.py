"""The edge process: WebSocket chat, chat page, health; one producer, one consumer.

A wiring of its parts: Kafka clients and the broker link (`broker_link.py`), the result
reader (`results.py`), the result topology (`topology.py`), the request path every client
uses (`gateway.py`), the WebSocket client (`chat_socket.py`), and background loops. Its
/metrics is not on the public app: `__main__.py` serves it on the metrics port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from services.edge.auth import Guard
from services.edge.broker_link import BrokerLink
from services.edge.chat_socket import ChatSocket
from services.edge.gateway import Gateway
from services.edge.lease_keeper import LeaseKeeper, LeaseLost, TopicNotReady, ensure_lease_topic
from services.edge.metrics import EdgeMetrics
from services.edge.openai.edge_streams import EdgeStreams
from services.edge.openai.models import ModelDirectory
from services.edge.openai.request_ids import RequestIds
from services.edge.openai.routes import OpenAIApi
from services.edge.page import SecurityHeaders
from services.edge.replay import REPLAY_FETCH_WAIT_MS, Replays
from services.edge.results import ResultReader
from services.edge.settings import EdgeSettings
from services.edge.sweeper import TopicSweeper
from services.edge.telemetry import EdgeTelemetry
from services.edge.topology import PartitionTopology, ResultTopology, TopicTopology, reply_tp
from shared.health import Readiness, health_routes
from shared.kafka import LONG_POLL_MS, client_security, make_admin, make_consumer, make_producer
from shared.messages import ReplyTo
from shared.metrics import EdgeRequestMetrics
from shared.process import for_life
from shared.producers import RenewingProducer
from shared.retry import retrying
from shared.topics import Topics

log = structlog.get_logger()

STATIC = Path(__file__).parent / "static"

# A failed background loop is restarted after 0.5 s, doubling up to 10 s.
RESTART_MIN_S = 0.5
RESTART_MAX_S = 10.0


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
        # The OpenAI-compatible API (services/edge/openai/): the models workers advertise.
        self.openai = EdgeStreams(
            self.guard,
            lambda: self.gateway,
            settings.limits(),
            ModelDirectory(settings.edge_models_stale_s),
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        s = self.settings
        producer = RenewingProducer(lambda: make_producer(s, client_id=self.edge_id))
        admin = make_admin(s, client_id=self.edge_id)
        # Partition topology: the reader's partitions rarely change (a resume of another
        # edge's stream), so its fetch is a long poll, which returns as soon as a result or
        # control record arrives; a change of partitions waits out the one in flight (up
        # to LONG_POLL_MS). Idle, this cut the edge from 4.2 to 1.0 % of a core and the
        # broker from 24.7 to 9.1 % (ADR 0041). Topic topology follows a new topic per
        # request, whose first tokens must not wait on a long poll: the short default.
        consumer = make_consumer(
            s,
            group_id=None,
            client_id=self.edge_id,
            fetch_max_wait_ms=LONG_POLL_MS if s.edge_result_topology == "partition" else None,
        )
        keeper: LeaseKeeper | None = None
        tasks: list[asyncio.Task[None]] = []
        await producer.start()
        await admin.start()
        await consumer.start()
        try:
            link = BrokerLink(
                producer,
                admin,
                self.topics,
                produce_timeout_s=s.edge_produce_timeout_s,
                produce_wait_s=s.edge_produce_wait_s,
                security=client_security(s),
                retry_after_ms=s.edge_retry_after_ms,
                metrics=self.metrics,
                edge_id=self.edge_id,
            )
            reader = ResultReader(
                consumer,
                TopicPartition(self.topics.control, 0),
                side={TopicPartition(self.topics.workers, 0): self.openai.heartbeat},
            )
            topology: ResultTopology
            if s.edge_result_topology == "partition":
                keeper = LeaseKeeper(
                    s,
                    self.topics.result_leases,
                    self.edge_id,
                    lambda: producer,
                    s.edge_lease_ttl_s,
                    on_send=link.sent,
                )
                partition = await self._lease_partition(link, keeper)
                reply_to = ReplyTo(topic=self.topics.results, partition=partition)
                topology = PartitionTopology(reply_to, reader)
                await reader.start(reply_tp(reply_to), self._models_since())
                tasks.append(asyncio.create_task(self._keep_lease(keeper), name="edge-lease"))
            else:
                retention_s = s.edge_result_topic_retention_s
                topology = TopicTopology(self.topics, admin, reader, retention_s, self.metrics)
                await reader.start(None, self._models_since())
            gateway = Gateway(
                s,
                self.topics,
                self.edge_id,
                link=link,
                topology=topology,
                reader=reader,
                guard=self.guard,
                telemetry=self.telemetry,
                metrics=self.metrics,
                resume_keys=self.resume_keys,
                models=self.openai.models,
                replays=Replays(
                    lambda: make_consumer(
                        s,
                        group_id=None,
                        client_id=f"{self.edge_id}-replay",
                        fetch_max_wait_ms=REPLAY_FETCH_WAIT_MS,
                    ),
                    timeout_s=s.edge_resume_timeout_s,
                    max_records=s.edge_resume_max_records,
                    concurrency=s.edge_resume_replays,
                ),
            )
            sweeper = TopicSweeper(
                admin,
                s,
                self.topics,
                gateway.reads_topic,
                self.metrics,
                s.edge_result_topic_orphan_after_s,
                s.edge_result_topic_sweep_interval_s,
            )
            # Each keeps its state outside the coroutine, so a failed one is restarted.
            loops: dict[str, Callable[[], Awaitable[None]]] = {
                "edge-results": lambda: reader.run(gateway),
                "edge-housekeeping": gateway.housekeeping,
                "edge-broker-probe": link.probe,
                "edge-sweeper": sweeper.run,
                "edge-revocations": self.guard.watch_revocations,
            }
            for name, loop in loops.items():
                tasks.append(asyncio.create_task(self._supervised(name, loop), name=name))
            self.gateway = gateway
            log.info(
                "edge.started",
                edge_id=self.edge_id,
                topology=s.edge_result_topology,
                partition=keeper.partition if keeper else None,
                port=s.edge_port,
            )
            yield
        finally:
            self.gateway = None
            for task in tasks:
                task.cancel()
            # Failures were logged when they happened (`_supervised`); shut down regardless.
            await asyncio.gather(*tasks, return_exceptions=True)
            if keeper is not None:
                await keeper.release()
            await consumer.stop()
            await admin.close()
            await producer.stop()

    def _models_since(self) -> float:
        """Heartbeats are read from this long ago, so `/v1/models` knows live workers at once."""
        return time.time() - self.settings.edge_models_stale_s

    async def _supervised(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop for the edge's life; restart it with backoff if it fails.

        A dead loop would leave the edge accepting requests it cannot serve, and killing
        the process would close every socket: the failure is logged and the loop resumes
        from the state it keeps outside itself (positions, deadlines).

        Every loop runs until the edge stops, so a loop that returns, or that ends cancelled
        while the edge is not cancelling it (a stray `CancelledError` from inside, as in ADR
        0039's wedge), has failed too: it is logged and restarted, never ended in silence.
        """
        backoff = RESTART_MIN_S
        while True:
            started = time.monotonic()
            try:
                await for_life(name, loop())  # a return or an inner cancel raises LoopEnded
            except Exception as exc:
                if time.monotonic() - started > RESTART_MAX_S:
                    backoff = RESTART_MIN_S  # it ran fine for a while: a new failure
                log.exception("edge.task_failed", task=name, error=repr(exc), restart_in_s=backoff)
            self.metrics.task_restarts.labels(name).inc()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_MAX_S)

    async def _lease_partition(self, link: BrokerLink, keeper: LeaseKeeper) -> int:
        """Lease a results partition; waits out a cluster that cannot answer yet.

        A broker node away, or a results topic not yet in a fresh or restarted broker's
        metadata, is retried with backoff and logged (`write.retry`, what=lease_partition),
        never an exit: an edge that exited here crash-looped until the node was back
        (docs/reliability.md, finding 4).
        """
        return await retrying(
            lambda: self._try_lease_partition(link, keeper),
            within_s=None,
            what="lease_partition",
            retry_on=(KafkaError, TimeoutError, TopicNotReady),
        )

    async def _try_lease_partition(self, link: BrokerLink, keeper: LeaseKeeper) -> int:
        s = self.settings
        await ensure_lease_topic(link.admin, self.topics.result_leases, s.edge_lease_ttl_s)
        partitions = await link.partition_count(self.topics.results)
        if partitions is None:
            raise TopicNotReady(f"{self.topics.results} is not in the cluster's metadata yet")
        wanted = s.edge_result_partition
        if wanted is not None and wanted >= partitions:
            raise RuntimeError(f"edge_result_partition={wanted}, but the topic has {partitions}")
        return await keeper.acquire(partitions, wanted, timeout_s=2.5 * s.edge_lease_ttl_s)

    async def _keep_lease(self, keeper: LeaseKeeper) -> None:
        try:
            await keeper.keep()
        except LeaseLost as exc:
            # Another edge may own the partition now: serving from it would share it.
            # Only the log says so (another edge's claim won), never a missed renewal.
            log.error("lease.lost", error=str(exc), action="shutting down")
            self.gateway = None
            os.kill(os.getpid(), signal.SIGTERM)

    # -- HTTP -------------------------------------------------------------------------------

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): result partition leased and read, broker reachable."""
        gateway = self.gateway
        if gateway is None:
            return Readiness.not_ready("starting")
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
        await ChatSocket(gateway, self.metrics, ws, upgrade).serve()


def build_app(edge: Edge) -> Starlette:
    """The public app: what clients and load balancers reach; no /metrics (docs/security.md)."""
    settings = edge.settings
    openai = OpenAIApi(
        edge.openai,
        settings.edge_max_frame_bytes,
        settings.edge_outbox_frames,
        keepalive_s=settings.edge_sse_keepalive_s,
    )
    return Starlette(
        routes=[
            Route("/", edge.index),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),  # the page's files
            *health_routes(edge.readiness),
            WebSocketRoute("/v1/chat", edge.chat),
            Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
            Route("/v1/completions", openai.completions, methods=["POST"]),
            Route("/v1/models", openai.models),
            Route("/v1/models/{model:path}", openai.model),  # ids may hold `/` (org/name)
        ],
        middleware=[
            Middleware(SecurityHeaders),  # the chat page's CSP (page.py)
            Middleware(RequestIds),  # `X-Request-Id` on every `/v1/` answer
        ],
        lifespan=edge.lifespan,
    )
