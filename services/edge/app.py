"""The edge process: WebSocket chat, chat page, health, metrics; one producer, one consumer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.edge.auth import Close, Guard, SocketAuth, Upgrade
from services.edge.deadlines import Deadlines
from services.edge.lease_keeper import LeaseKeeper, LeaseLost, ensure_lease_topic
from services.edge.metrics import EdgeMetrics
from services.edge.protocol import (
    AcceptedFrame,
    AuthFrame,
    ChatCancelFrame,
    ChatRequestFrame,
    ErrorFrame,
    ProtocolError,
    ServerFrame,
    StreamResumeFrame,
    parse_client_frame,
)
from services.edge.results import ResultReader
from services.edge.resume import ResumeClaims, ResumeRefused, check_resume, sign
from services.edge.settings import EdgeSettings
from services.edge.streams import ResultStream, ResumePoint, StreamRouter
from services.edge.telemetry import EdgeTelemetry
from services.edge.topology import (
    UNKNOWN_TOPIC,
    PartitionTopology,
    ResultTopology,
    TopicTopology,
    TopologyError,
    reply_tp,
)
from shared.kafka import encode, key_of, make_admin, make_consumer, make_producer
from shared.messages import (
    CancelRecord,
    ControlRecord,
    ErrorCode,
    ReplyTo,
    RequestRecord,
    StreamResumed,
    Tier,
)
from shared.metrics import EdgeRequestMetrics
from shared.topics import Topics

log = structlog.get_logger()

STATIC = Path(__file__).parent / "static"
_control: TypeAdapter[ControlRecord] = TypeAdapter(ControlRecord)


class Edge:
    """Everything one edge process shares across sockets."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.limits = settings.limits()
        self.edge_id = f"edge-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.metrics = EdgeMetrics()
        # Request traces and latency metrics, on the same registry as the edge's own metrics.
        self.telemetry = EdgeTelemetry(
            metrics=EdgeRequestMetrics.build(self.metrics.registry),
            results_topic=self.topics.results,
        )
        self.router = StreamRouter(on_end=self._stream_ended)
        self.resume_keys = settings.resume_keys()
        # Keys, origins, quotas (auth.py); tenant ids are keyed by the resume keys.
        self.guard = Guard(settings, self.resume_keys)
        # request_id -> partition read for it alone (per-request topic, resumed stream)
        self.followed: dict[str, TopicPartition] = {}
        self.grace: Deadlines[str] = Deadlines()
        self._wake = asyncio.Event()
        self.producer: AIOKafkaProducer | None = None
        self.reader: ResultReader | None = None
        self.topology: ResultTopology | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self.ready = False

    # -- lifecycle --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        s = self.settings
        self.producer = make_producer(s, client_id=self.edge_id)
        self._admin = make_admin(s, client_id=self.edge_id)
        consumer = make_consumer(s, group_id=None, client_id=self.edge_id)
        keeper: LeaseKeeper | None = None
        tasks: list[asyncio.Task[None]] = []
        await self.producer.start()
        await self._admin.start()
        await consumer.start()
        try:
            self.reader = ResultReader(
                consumer,
                self.router,
                TopicPartition(self.topics.control, 0),
                self._on_control,
                on_result=self.telemetry.result_record,
            )
            if s.edge_result_topology == "partition":
                keeper = LeaseKeeper(
                    s, self.topics.result_leases, self.edge_id, self.producer, s.edge_lease_ttl_s
                )
                partition = await self._lease_partition(keeper)
                reply_to = ReplyTo(topic=self.topics.results, partition=partition)
                self.topology = PartitionTopology(reply_to, self.reader)
                await self.reader.start(reply_tp(reply_to))
                tasks.append(asyncio.create_task(self._keep_lease(keeper), name="edge-lease"))
            else:
                self.topology = TopicTopology(
                    self.topics,
                    self._admin,
                    self.reader,
                    s.edge_result_topic_retention_s,
                    self.metrics,
                )
                await self.reader.start(None)
            tasks.append(asyncio.create_task(self.reader.run(), name="edge-results"))
            tasks.append(asyncio.create_task(self._housekeeping(), name="edge-housekeeping"))
            for task in tasks:
                task.add_done_callback(self._fail_fast)
            self.ready = True
            log.info(
                "edge.started",
                edge_id=self.edge_id,
                topology=s.edge_result_topology,
                partition=keeper.partition if keeper else None,
                port=s.edge_port,
            )
            yield
        finally:
            self.ready = False
            for task in tasks:
                task.cancel()
            # Failures were logged when they happened (`_fail_fast`); shut down regardless.
            await asyncio.gather(*tasks, return_exceptions=True)
            if keeper is not None:
                await keeper.release()
            await consumer.stop()
            await self._admin.close()
            await self.producer.stop()

    def _fail_fast(self, task: asyncio.Task[None]) -> None:
        """A background task died: without it the edge would accept requests it cannot serve."""
        if task.cancelled() or task.exception() is None:
            return  # shutdown, or the task ended the process itself (lease lost)
        log.error("edge.task_failed", task=task.get_name(), error=repr(task.exception()))
        self.ready = False
        os.kill(os.getpid(), signal.SIGTERM)

    async def _lease_partition(self, keeper: LeaseKeeper) -> int:
        s = self.settings
        assert self._admin is not None
        await ensure_lease_topic(self._admin, self.topics.result_leases, s.edge_lease_ttl_s)
        partitions = await self._partition_count(self.topics.results)
        if partitions is None:
            raise RuntimeError(f"{self.topics.results} does not exist: create the topics first")
        wanted = s.edge_result_partition
        if wanted is not None and wanted >= partitions:
            raise RuntimeError(f"edge_result_partition={wanted}, but the topic has {partitions}")
        return await keeper.acquire(partitions, wanted, timeout_s=2.5 * s.edge_lease_ttl_s)

    async def _keep_lease(self, keeper: LeaseKeeper) -> None:
        try:
            await keeper.keep()
        except LeaseLost as exc:
            # Another edge may own the partition now: serving from it would share it.
            log.error("lease.lost", error=str(exc), action="shutting down")
            self.ready = False
            os.kill(os.getpid(), signal.SIGTERM)

    async def _partition_count(self, topic: str) -> int | None:
        assert self._admin is not None
        described = await self._admin.describe_topics([topic])
        for entry in described:
            if entry["topic"] == topic and entry["error_code"] != UNKNOWN_TOPIC:
                return len(entry["partitions"])
        return None

    async def _housekeeping(self) -> None:
        """Cancels requests of sockets gone past their grace; deletes expired result topics."""
        assert self.topology is not None
        while True:
            now = time.monotonic()
            for request_id in self.grace.pop_due(now):
                await self._cancel_abandoned(request_id)
            try:
                await self.topology.sweep(now)
            except KafkaError as exc:
                log.warning("result_topics.sweep_failed", error=repr(exc))
            deadlines = [d for d in (self.grace.next_at(), self._next_sweep()) if d is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _next_sweep(self) -> float | None:
        if isinstance(self.topology, TopicTopology):
            return self.topology.deletions.next_at()
        return None

    # -- streams ----------------------------------------------------------------------------

    def _stream_ended(self, stream: ResultStream) -> None:
        """A stream's final record was shown (or swallowed while detached): let go of it."""
        self.grace.cancel(stream.request_id)
        self._let_go(stream.request_id, ended=True)

    def _let_go(self, request_id: str, *, ended: bool) -> None:
        """Stop reading what was read for this request alone.

        `ended`: the stream finished here, so a per-request topic starts its retention.
        Otherwise another edge serves it now and decides.
        """
        assert self.reader is not None
        assert self.topology is not None
        self.guard.release(request_id)
        tp = self.followed.pop(request_id, None)
        self.metrics.streams_open.set(len(self.router))
        if tp is None:
            return
        self.reader.unfollow(tp)
        if ended and self.topology.followed(ReplyTo(topic=tp.topic)):
            self.topology.ended(tp.topic, time.monotonic())
            self._wake.set()

    def detach(self, owner: object) -> None:
        """A socket closed: its streams wait out the grace period for a resume."""
        now = time.monotonic()
        for request_id in self.router.detach_owner(owner):
            self.grace.set(request_id, now + self.settings.edge_disconnect_grace_s)
        self._wake.set()

    async def _cancel_abandoned(self, request_id: str) -> None:
        stream = self.router.get(request_id)
        if stream is None or not stream.detached:
            return  # ended or resumed meanwhile
        assert self.producer is not None
        try:
            await self.producer.send_and_wait(
                self.topics.control,
                encode(CancelRecord(request_id=request_id, reason="disconnect")),
                key=key_of(request_id),
            )
        except KafkaError as exc:
            # The request then runs to its end: wasted work, not a wrong answer.
            log.error("cancel.produce_failed", request_id=request_id, error=repr(exc))
        self.metrics.disconnect_cancels.inc()
        log.info("request.cancelled_after_disconnect", request_id=request_id)
        self.router.close(request_id)
        self._let_go(request_id, ended=True)

    def _on_control(self, value: bytes) -> None:
        try:
            record = _control.validate_json(value)
        except ValidationError:
            return  # kinds this edge does not know are for someone else
        if isinstance(record, StreamResumed) and record.edge_id != self.edge_id:
            stream = self.router.get(record.request_id)
            if stream is not None and stream.detached:
                # Picked up on another edge: no cancel from here; that edge owns it now.
                self.grace.cancel(record.request_id)
                self.router.close(record.request_id)
                self._let_go(record.request_id, ended=False)

    # -- requests ---------------------------------------------------------------------------

    async def open_request(self, request_id: str) -> tuple[ReplyTo, int]:
        assert self.topology is not None
        reply_to, offset = await self.topology.open(request_id)
        if self.topology.followed(reply_to):
            self.followed[request_id] = reply_tp(reply_to)
        return reply_to, offset

    async def resume(
        self, claims: ResumeClaims, frame: StreamResumeFrame, owner: ChatSocket
    ) -> None:
        """Serve a checked resume: replay from the token's offset, then go on live."""
        assert self.reader is not None
        assert self.producer is not None
        assert self.topology is not None
        tp = TopicPartition(claims.topic, claims.partition or 0)
        begin, end = await self._offsets(tp)
        if claims.offset < begin:
            raise ResumeRefused(
                ErrorCode.not_found,
                "stream.resume: the stream's first records were deleted; it cannot be recovered",
            )
        if claims.offset > end:
            raise ResumeRefused(ErrorCode.not_found, "stream.resume: no such stream here")
        rid = claims.request_id
        # Tell the edge that had it (if alive) before reading, so it does not cancel it.
        await self.producer.send_and_wait(
            self.topics.control,
            encode(StreamResumed(request_id=rid, edge_id=self.edge_id)),
            key=key_of(rid),
        )
        self.grace.cancel(rid)
        previous = self.followed.pop(rid, None)
        self.topology.resumed(claims.topic)
        point = ResumePoint(frame.attempt, frame.after_seq)
        stream = self.router.resume(rid, owner.send, owner, point)
        self.followed[rid] = tp
        self.reader.follow(tp, claims.offset, end, lambda: self._caught_up(stream))
        if previous is not None:
            self.reader.unfollow(previous)
        self.metrics.streams_open.set(len(self.router))

    def _caught_up(self, stream: ResultStream) -> None:
        if self.router.get(stream.request_id) is not stream:
            return  # resumed again, or closed, meanwhile: that one decides
        ok = self.router.caught_up(stream.request_id)
        self.metrics.resumes.labels("resumed" if ok else "ahead_of_log").inc()
        if not ok:
            self._let_go(stream.request_id, ended=False)

    async def _offsets(self, tp: TopicPartition) -> tuple[int, int]:
        """First and end offset of `tp`; ResumeRefused(not_found) if it does not exist."""
        assert self.reader is not None
        count = await self._partition_count(tp.topic)
        if count is None or tp.partition >= count:
            raise ResumeRefused(
                ErrorCode.not_found,
                "stream.resume: the stream's records are gone (retention); it cannot be recovered",
            )
        return await self.reader.offsets(tp)

    # -- HTTP -------------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        status = 200 if self.ready else 503
        return JSONResponse({"status": "ok" if self.ready else "starting"}, status_code=status)

    async def metrics_page(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def chat(self, ws: WebSocket) -> None:
        upgrade = self.guard.upgrade(ws.headers.get("origin"), ws.headers.getlist("authorization"))
        if (refused := upgrade.refused) is not None:
            # An HTTP answer instead of a socket: no frame is ever read or sent.
            log.info("socket.refused", reason=refused.reason, origin=ws.headers.get("origin"))
            await ws.send_denial_response(PlainTextResponse(refused.text, refused.status))
            return
        await ChatSocket(self, ws, upgrade).serve()


class ChatSocket:
    """One client connection: a reader of frames and a single writer of frames."""

    def __init__(self, edge: Edge, ws: WebSocket, upgrade: Upgrade) -> None:
        self.edge = edge
        self.ws = ws
        self.outbox: asyncio.Queue[ServerFrame] = asyncio.Queue()
        # Who the socket speaks for; nothing but `auth` is read before that is known.
        self.auth = SocketAuth(edge.guard, upgrade, time.monotonic())

    @property
    def tenant(self) -> str:
        return self.auth.tenant

    def send(self, frame: ServerFrame) -> None:
        self.outbox.put_nowait(frame)

    async def serve(self) -> None:
        try:
            await self.ws.accept()  # in the `try`: the socket's places are given back
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._write())
                close = await self._read(tg)
                writer.cancel()
            if close is not None:
                await self.ws.close(close.code, close.reason)
        except* (WebSocketDisconnect, ConnectionError):
            pass
        finally:
            # Not a cancel: the client may resume, here or on another edge, within the grace.
            self.edge.detach(self)
            self.auth.end()

    async def _write(self) -> None:
        while True:
            frame = await self.outbox.get()
            await self.ws.send_text(frame.model_dump_json())
            self.edge.telemetry.frame_written(frame)

    async def _read(self, tg: asyncio.TaskGroup) -> Close | None:
        edge = self.edge
        if refused := self.auth.start():
            return refused
        while True:
            message = await self._receive()
            if message is None:
                return self.auth.timed_out()
            if message["type"] == "websocket.disconnect":
                return None
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            if not self.auth.authenticated:
                if refused := self._before_key(data):
                    return refused
                continue
            try:
                frame = parse_client_frame(data, edge.limits, edge.settings.edge_max_frame_bytes)
            except ProtocolError as exc:
                self.send(
                    ErrorFrame(
                        code=ErrorCode.invalid_request, message=exc.message, client_id=exc.client_id
                    )
                )
                continue
            if isinstance(frame, AuthFrame):
                if refused_auth := self.auth.again(frame):
                    self.send(refused_auth)
            elif isinstance(frame, ChatRequestFrame):
                tg.create_task(self._submit(frame))
            elif isinstance(frame, ChatCancelFrame):
                tg.create_task(self._cancel(frame.request_id))
            elif isinstance(frame, StreamResumeFrame):
                tg.create_task(self._resume(frame))

    # -- auth hooks: the decisions are SocketAuth's (auth.py) -------------------------------

    async def _receive(self) -> Message | None:
        """The next message; None if the socket is still without a key at its deadline."""
        if self.auth.authenticated:
            return await self.ws.receive()
        try:
            async with asyncio.timeout_at(self.auth.deadline):
                return await self.ws.receive()
        except TimeoutError:
            return None

    def _before_key(self, data: str | bytes) -> Close | None:
        edge = self.edge
        try:
            frame = parse_client_frame(data, edge.limits, edge.settings.edge_max_frame_bytes)
        except ProtocolError as exc:
            reply, close = self.auth.before_key(exc)
        else:
            reply, close = self.auth.before_key(frame)
        if reply is not None:
            self.send(reply)
        return close

    async def _submit(self, frame: ChatRequestFrame) -> None:
        edge = self.edge
        assert edge.producer is not None
        request_id = uuid.uuid4().hex
        if refused := self.auth.admit(frame, request_id):
            self.send(refused)  # before anything of it reaches Kafka
            return
        edge.telemetry.begin(
            request_id,
            tier=(frame.priority or Tier.interactive).value,
            max_tokens=frame.max_tokens,
            parent=self.ws.headers,  # a client's own `traceparent` on the upgrade request
        )
        try:
            reply_to, offset = await edge.open_request(request_id)
        except (TopologyError, KafkaError) as exc:
            edge.telemetry.end(request_id, outcome="reply_to_failed")
            edge.guard.release(request_id)
            log.error("request.reply_to_failed", request_id=request_id, error=repr(exc))
            self.send(
                ErrorFrame(
                    code=ErrorCode.overloaded,
                    message="could not prepare the result stream, try again",
                    client_id=frame.client_id,
                )
            )
            return
        fields = frame.model_dump(exclude={"type"})
        fields.update(request_id=request_id, tenant=self.tenant, reply_to=reply_to.model_dump())
        record = RequestRecord.model_validate(fields, context={"limits": edge.limits})
        claims = ResumeClaims(
            tenant=self.tenant,
            request_id=request_id,
            topic=reply_to.topic,
            partition=reply_to.partition,
            offset=offset,
            expires_at=time.time() + edge.settings.edge_resume_ttl_s,
        )
        edge.router.open(request_id, self.send, owner=self)
        edge.metrics.streams_open.set(len(edge.router))
        try:
            await edge.telemetry.publish(edge.producer, edge.topics.requests, record)
        except KafkaError as exc:
            log.error("request.produce_failed", request_id=request_id, error=repr(exc))
            edge.router.close(request_id)
            edge._let_go(request_id, ended=True)
            self.send(
                ErrorFrame(
                    code=ErrorCode.overloaded,
                    message="could not queue the request, try again",
                    client_id=frame.client_id,
                )
            )
            return
        edge.router.release(
            request_id,
            AcceptedFrame(
                request_id=request_id,
                client_id=frame.client_id,
                resume_token=sign(claims, edge.resume_keys),
                tier=frame.priority or Tier.interactive,
            ),
        )

    async def _cancel(self, request_id: str) -> None:
        edge = self.edge
        stream = edge.router.get(request_id)
        if stream is None or stream.owner is not self:
            self.send(
                ErrorFrame(
                    code=ErrorCode.not_found,
                    message="chat.cancel: no such request in flight on this socket",
                    request_id=request_id,
                )
            )
            return
        assert edge.producer is not None
        await edge.producer.send_and_wait(
            edge.topics.control, encode(CancelRecord(request_id=request_id)), key=key_of(request_id)
        )

    async def _resume(self, frame: StreamResumeFrame) -> None:
        edge = self.edge
        request_id: str | None = None
        try:
            claims = check_resume(
                frame.resume_token,
                edge.resume_keys,
                tenant=self.auth.tenant_for_token(frame.resume_token),
                results_topic=edge.topics.results,
                now=time.time(),
            )
            request_id = claims.request_id
            await edge.resume(claims, frame, self)
        except ResumeRefused as exc:
            edge.metrics.resumes.labels(exc.code.value).inc()
            log.info("stream.resume_refused", request_id=request_id, code=exc.code.value)
            self.send(ErrorFrame(code=exc.code, message=exc.message, request_id=request_id))
        except KafkaError as exc:
            log.error("stream.resume_failed", request_id=request_id, error=repr(exc))
            self.send(
                ErrorFrame(
                    code=ErrorCode.overloaded,
                    message="stream.resume: could not read the stream now, try again",
                    request_id=request_id,
                )
            )


def build_app(settings: EdgeSettings) -> Starlette:
    edge = Edge(settings)
    return Starlette(
        routes=[
            Route("/", edge.index),
            Route("/healthz", edge.healthz),
            Route("/metrics", edge.metrics_page),
            WebSocketRoute("/v1/chat", edge.chat),
        ],
        lifespan=edge.lifespan,
    )
