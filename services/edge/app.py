"""The edge process: WebSocket chat, chat page, health; one producer and one consumer."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

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
from services.edge.resume import ResumeClaims, sign
from services.edge.results import ResultReader
from services.edge.settings import EdgeSettings
from services.edge.streams import StreamRouter
from shared.kafka import encode, key_of, make_consumer, make_producer
from shared.messages import CancelRecord, ErrorCode, ReplyTo, RequestRecord, Tier
from shared.topics import Topics

log = structlog.get_logger()

STATIC = Path(__file__).parent / "static"


class Edge:
    """Everything one edge process shares across sockets."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.limits = settings.limits()
        self.router = StreamRouter()
        secret = settings.resume_secret
        if secret is None:
            log.warning("resume_secret.unset", hint="set TOKENBUS_RESUME_SECRET on every edge")
        self.secret = secret.get_secret_value().encode() if secret else secrets.token_bytes(32)
        self.reply_to = ReplyTo(topic=self.topics.results, partition=settings.edge_result_partition)
        self.producer: AIOKafkaProducer | None = None
        self.reader: ResultReader | None = None
        self.ready = False

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        s = self.settings
        self.producer = make_producer(s, client_id=f"edge-{s.edge_result_partition}")
        consumer = make_consumer(s, group_id=None, client_id=f"edge-{s.edge_result_partition}")
        await self.producer.start()
        await consumer.start()
        self.reader = ResultReader(
            consumer, TopicPartition(self.topics.results, s.edge_result_partition), self.router
        )
        try:
            await self.reader.start()
            task = asyncio.create_task(self.reader.run(), name="edge-results")
            self.ready = True
            log.info("edge.started", partition=s.edge_result_partition, port=s.edge_port)
            yield
        finally:
            self.ready = False
            if "task" in locals():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await consumer.stop()
            await self.producer.stop()

    async def healthz(self, request: Request) -> Response:
        status = 200 if self.ready else 503
        return JSONResponse({"status": "ok" if self.ready else "starting"}, status_code=status)

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def chat(self, ws: WebSocket) -> None:
        await ws.accept()
        await ChatSocket(self, ws).serve()


class ChatSocket:
    """One client connection: a reader of frames and a single writer of frames."""

    def __init__(self, edge: Edge, ws: WebSocket) -> None:
        self.edge = edge
        self.ws = ws
        self.outbox: asyncio.Queue[ServerFrame] = asyncio.Queue()
        self.tenant = _tenant(ws.headers.get("authorization", "").removeprefix("Bearer ").strip())

    def send(self, frame: ServerFrame) -> None:
        self.outbox.put_nowait(frame)

    async def serve(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._write())
                await self._read(tg)
                writer.cancel()
        except* (WebSocketDisconnect, ConnectionError):
            pass
        finally:
            self.edge.router.close_owner(self)

    async def _write(self) -> None:
        while True:
            frame = await self.outbox.get()
            await self.ws.send_text(frame.model_dump_json())

    async def _read(self, tg: asyncio.TaskGroup) -> None:
        edge = self.edge
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
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
                self.tenant = _tenant(frame.api_key)
            elif isinstance(frame, ChatRequestFrame):
                tg.create_task(self._submit(frame))
            elif isinstance(frame, ChatCancelFrame):
                tg.create_task(self._cancel(frame.request_id))
            elif isinstance(frame, StreamResumeFrame):
                self.send(
                    ErrorFrame(code=ErrorCode.not_found, message="stream.resume: no such stream")
                )

    async def _submit(self, frame: ChatRequestFrame) -> None:
        edge = self.edge
        assert edge.producer is not None and edge.reader is not None
        request_id = uuid.uuid4().hex
        fields = frame.model_dump(exclude={"type"})
        fields.update(
            request_id=request_id, tenant=self.tenant, reply_to=edge.reply_to.model_dump()
        )
        record = RequestRecord.model_validate(fields, context={"limits": edge.limits})
        claims = ResumeClaims(
            tenant=self.tenant,
            request_id=request_id,
            topic=edge.reply_to.topic,
            partition=edge.reply_to.partition,
            offset=edge.reader.position or 0,
            expires_at=time.time() + edge.settings.edge_resume_ttl_s,
        )
        edge.router.open(request_id, self.send, owner=self)
        try:
            await edge.producer.send_and_wait(
                edge.topics.requests, encode(record), key=key_of(request_id)
            )
        except Exception as exc:
            log.error("request.produce_failed", request_id=request_id, error=repr(exc))
            edge.router.close(request_id)
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
                resume_token=sign(claims, edge.secret),
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


def _tenant(api_key: str) -> str:
    # Auth is accepted, not yet enforced: the key only names the tenant, and is never logged.
    if not api_key:
        return "anonymous"
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def build_app(settings: EdgeSettings) -> Starlette:
    edge = Edge(settings)
    return Starlette(
        routes=[
            Route("/", edge.index),
            Route("/healthz", edge.healthz),
            WebSocketRoute("/v1/chat", edge.chat),
        ],
        lifespan=edge.lifespan,
    )
