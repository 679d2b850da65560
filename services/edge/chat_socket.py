"""One WebSocket chat connection: reads client frames, writes server frames in order.

A client of the gateway (`gateway.py`): it admits requests (`auth.py`) and hands them to
`Gateway.submit`; every frame of its streams comes back through `send`.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.edge.auth import POLICY_VIOLATION, Close, SocketAuth, Upgrade
from services.edge.budget import ByteBudget
from services.edge.gateway import Gateway
from services.edge.metrics import EdgeMetrics
from services.edge.outbox import frame_weight
from services.edge.protocol import (
    AuthFrame,
    ChatCancelFrame,
    ChatRequestFrame,
    ErrorFrame,
    ProtocolError,
    ServerFrame,
    StreamResumeFrame,
    parse_client_frame,
)
from services.edge.streams import ResultStream
from services.edge.ws_protocol import WIDEN
from shared.messages import ErrorCode

log = structlog.get_logger()

# WebSocket close code 1013 "try again later": the client read too slowly; it may resume.
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_TIMEOUT_S = 5.0
# RFC 6455 close code 1009 "message too big": a frame above the limit before the key.
CLOSE_MESSAGE_TOO_BIG = 1009
# RFC 6455 close code 1012 "service restart": the edge drains; resume on another edge.
SERVICE_RESTART = 1012


class ChatSocket:
    """One client connection: a reader of frames and a single writer of frames."""

    def __init__(
        self,
        gateway: Gateway,
        metrics: EdgeMetrics,
        ws: WebSocket,
        upgrade: Upgrade,
        budget: ByteBudget | None = None,
    ) -> None:
        self.gateway = gateway
        self.metrics = metrics
        self.ws = ws
        settings = gateway.settings
        self.limits = gateway.limits
        self.max_frame_bytes = settings.edge_max_frame_bytes
        self.max_unauthenticated_frame_bytes = settings.edge_max_unauthenticated_frame_bytes
        # Bounded in frames and in weight (outbox.py), and within the edge's budget for all
        # clients: a client that stops reading must not grow the edge's memory.
        self.outbox: asyncio.Queue[tuple[ServerFrame, ResultStream | None, int]] = asyncio.Queue(
            settings.edge_outbox_frames
        )
        self.max_outbox_bytes = settings.edge_outbox_bytes
        self.queued_bytes = 0
        self.budget = budget or ByteBudget(settings.edge_outbox_budget_bytes)
        self._closed = False  # served: nothing more is queued
        self._too_slow = asyncio.Event()
        self._revoked = asyncio.Event()  # its key was revoked: closed at once (1008)
        self._restarting = asyncio.Event()  # the edge drains: closed 1012, to resume elsewhere
        # Who the socket speaks for; nothing but `auth` is read before that is known.
        self.auth = SocketAuth(
            gateway.guard, upgrade, time.monotonic(), on_revoked=self._revoked.set
        )

    @property
    def tenant(self) -> str:
        return self.auth.tenant

    def send(self, frame: ServerFrame, stream: ResultStream | None = None) -> None:
        """Queue a frame for the writer. Never waits: the edge's one result reader calls it."""
        if self._too_slow.is_set() or self._closed:
            return  # its streams are detached; the client resumes them
        weight = frame_weight(frame)
        if self.queued_bytes + weight > self.max_outbox_bytes or not self.budget.take(weight):
            self._fall_behind()
            return
        try:
            self.outbox.put_nowait((frame, stream, weight))
        except asyncio.QueueFull:
            self.budget.give(weight)
            self._fall_behind()
            return
        self.queued_bytes += weight

    def drain(self) -> None:
        """The edge is restarting (drain.py): the socket closes 1012 (service restart) and its
        streams wait out the disconnect grace for a resume on another edge."""
        self._restarting.set()

    def _fall_behind(self) -> None:
        """The client reads slower than its streams arrive: let go of it, keep its streams.

        They wait out the disconnect grace for a resume, as after a dropped socket; the
        socket is closed with 1013 (try again later).
        """
        self._too_slow.set()
        self.gateway.detach(self)
        self.metrics.slow_client_closes.inc()
        log.warning(
            "socket.too_slow",
            queued=self.outbox.qsize(),
            queued_bytes=self.queued_bytes,
            budget_held=self.budget.held,
            tenant=self.tenant,
        )

    def _widen(self) -> None:
        """The socket has its key: its frames may be as large as an authenticated socket's
        (the listener's protocol read one small message at a time before: ws_protocol.py)."""
        extension = self.ws.scope.get("extensions", {}).get(WIDEN)
        if extension is not None:
            extension["widen"](self.auth.widened_as)

    async def serve(self) -> None:
        try:
            if self.auth.presented:
                # Keyed in its upgrade request: its first frame may be large (the key is
                # checked at once in `_read`, before anything is read).
                self._widen()
            await self.ws.accept()  # in the `try`: the socket's places are given back
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._write())
                reader = tg.create_task(self._read(tg))
                too_slow = tg.create_task(self._too_slow.wait())
                revoked = tg.create_task(self._revoked.wait())
                restarting = tg.create_task(self._restarting.wait())
                await asyncio.wait(
                    {reader, too_slow, revoked, restarting}, return_when=asyncio.FIRST_COMPLETED
                )
                for task in (writer, reader, too_slow, revoked, restarting):
                    task.cancel()
            if self._revoked.is_set():
                await self.ws.close(POLICY_VIOLATION, "the socket's API key was revoked")
            elif self._too_slow.is_set():
                await self._close_too_slow()
            elif self._restarting.is_set():
                self.gateway.detach(self)  # before the close: nothing more is queued
                await self._close_bounded(SERVICE_RESTART, "the edge is restarting; resume")
            elif (close := reader.result()) is not None:
                await self.ws.close(close.code, close.reason)
        except* (WebSocketDisconnect, ConnectionError):
            pass
        finally:
            # Not a cancel: the client may resume, here or on another edge, within the grace.
            self.gateway.detach(self)
            self.auth.end()
            self._release_outbox()

    def _release_outbox(self) -> None:
        """What is still queued is never written: its weight goes back to the budget."""
        self._closed = True
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.budget.give(self.queued_bytes)
        self.queued_bytes = 0

    async def _close_too_slow(self) -> None:
        await self._close_bounded(CLOSE_TRY_AGAIN_LATER, "reading too slowly; resume the streams")

    async def _close_bounded(self, code: int, reason: str) -> None:
        # The close frame queues behind what the client has not read: bounded, then given up
        # (the server's close timeout drops the connection).
        try:
            await asyncio.wait_for(self.ws.close(code, reason), CLOSE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:
            log.info("socket.close_unsent", error=repr(exc))

    async def _write(self) -> None:
        outbox, ws, written = self.outbox, self.ws, self.gateway.written
        while True:
            # Wake once per batch: a fetch of results queues many frames at once.
            batch = [await outbox.get()]
            while not outbox.empty():
                batch.append(outbox.get_nowait())
            for frame, stream, weight in batch:
                self.queued_bytes -= weight
                self.budget.give(weight)
                await ws.send_text(frame.model_dump_json())
                written(frame, stream)

    async def _read(self, tg: asyncio.TaskGroup) -> Close | None:
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
                if self.auth.authenticated:
                    self._widen()
                continue
            try:
                frame = parse_client_frame(data, self.limits, self.max_frame_bytes)
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
                if denied := self.auth.charge("chat.cancel"):
                    self.send(denied.model_copy(update={"request_id": frame.request_id}))
                else:
                    tg.create_task(self.gateway.cancel_stream(frame.request_id, self))
            elif isinstance(frame, StreamResumeFrame):
                if denied := self.auth.charge("stream.resume"):
                    self.send(denied)
                else:
                    principal = self.auth.principal
                    assert principal is not None  # authenticated above
                    tg.create_task(
                        self.gateway.resume_stream(frame, principal=principal, client=self)
                    )

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
        # Nothing big is parsed for a client not known yet: one such frame closes the socket.
        size = len(data.encode()) if isinstance(data, str) else len(data)
        if size > self.max_unauthenticated_frame_bytes:
            log.info("auth.frame_too_big", size=size)
            return Close(CLOSE_MESSAGE_TOO_BIG, "frame too big before authentication")
        try:
            frame = parse_client_frame(data, self.limits, self.max_frame_bytes)
        except ProtocolError as exc:
            reply, close = self.auth.before_key(exc)
        else:
            reply, close = self.auth.before_key(frame)
        if reply is not None:
            self.send(reply)
        return close

    async def _submit(self, frame: ChatRequestFrame) -> None:
        principal = self.auth.principal
        assert principal is not None  # the socket reads no request before its key
        await self.gateway.submit(
            frame,
            principal=principal,
            client=self,
            parent=self.ws.headers,  # a client's own `traceparent` on the upgrade request
        )
