"""The direct baseline: the worker's engine in-process behind `/v1/chat`, no Kafka in between.

It speaks the edge's protocol (the same frame models) and coalesces tokens as the worker
does, so the difference to a pipeline run is what Kafka and the services' hops cost.
Run with `python -m bench.direct`; TOKENBUS_WORKER_* settings choose the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from pydantic import Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.edge.protocol import (
    AcceptedFrame,
    ChatCancelFrame,
    ChatRequestFrame,
    DeltaFrame,
    DoneFrame,
    ErrorFrame,
    ProtocolError,
    ServerFrame,
    StreamResumeFrame,
    parse_client_frame,
)
from services.worker.coalesce import Coalescer, with_flushes
from services.worker.engines.base import Engine, EngineFinish, EngineRequest
from services.worker.engines.factory import build_engine
from services.worker.settings import WorkerSettings
from shared.messages import ErrorCode, Tier, Timings, Usage
from shared.process import UVICORN_LOOP


class DirectSettings(WorkerSettings):
    """The worker's settings (engine, profile, flush) plus where the baseline listens."""

    bench_direct_host: str = Field(default="127.0.0.1")
    bench_direct_port: int = Field(default=8100, ge=0, le=65535)
    bench_direct_max_frame_bytes: int = Field(default=1 << 20, ge=1024)


class DirectServer:
    def __init__(self, settings: DirectSettings) -> None:
        self.settings = settings
        self.engine: Engine = build_engine(settings)
        self.limits = settings.limits()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.engine.start()
        try:
            yield
        finally:
            await self.engine.stop()

    async def healthz(self, request: Request) -> Response:
        cap = self.engine.capacity()
        return JSONResponse({"status": "ok", "running": cap.running, "queued": cap.queued})

    async def chat(self, ws: WebSocket) -> None:
        await ws.accept()
        await DirectSocket(self, ws).serve()


class DirectSocket:
    """One client connection: requests run as tasks, one writer sends every frame."""

    def __init__(self, server: DirectServer, ws: WebSocket) -> None:
        self.server = server
        self.ws = ws
        self.outbox: asyncio.Queue[ServerFrame] = asyncio.Queue()
        self.running: set[str] = set()

    async def serve(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._write())
                await self._read(tg)
                writer.cancel()
        except* (WebSocketDisconnect, ConnectionError):
            pass
        finally:
            for request_id in self.running:  # a gone client frees its engine slots
                await self.server.engine.abort(request_id)

    async def _write(self) -> None:
        while True:
            frame = await self.outbox.get()
            await self.ws.send_text(frame.model_dump_json())

    async def _read(self, tg: asyncio.TaskGroup) -> None:
        s = self.server.settings
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text") or message.get("bytes") or b""
            try:
                frame = parse_client_frame(data, self.server.limits, s.bench_direct_max_frame_bytes)
            except ProtocolError as exc:
                self.outbox.put_nowait(
                    ErrorFrame(
                        code=ErrorCode.invalid_request, message=exc.message, client_id=exc.client_id
                    )
                )
                continue
            if isinstance(frame, ChatRequestFrame):
                tg.create_task(self._run(frame))
            elif isinstance(frame, ChatCancelFrame):
                if frame.request_id in self.running:
                    await self.server.engine.abort(frame.request_id)
            elif isinstance(frame, StreamResumeFrame):
                self.outbox.put_nowait(
                    ErrorFrame(code=ErrorCode.not_found, message="stream.resume: no such stream")
                )

    async def _run(self, frame: ChatRequestFrame) -> None:
        received = time.time()
        request_id = uuid.uuid4().hex
        tier = frame.priority or Tier.interactive
        self.outbox.put_nowait(
            AcceptedFrame(
                request_id=request_id, client_id=frame.client_id, resume_token="direct", tier=tier
            )
        )
        engine, s = self.server.engine, self.server.settings
        request = EngineRequest(
            request_id=request_id,
            prompt=frame.prompt_text(),
            max_tokens=frame.effective_max_tokens,
            temperature=frame.temperature,
            top_p=frame.top_p,
            stop=tuple(frame.stop),
            priority=0 if tier is Tier.interactive else 1,
        )
        coalescer = Coalescer(
            s.worker_flush_ms / 1000.0, s.worker_flush_tokens, s.worker_flush_first
        )
        seq = 0
        first_token_at: float | None = None
        batch_size = 1
        finish: EngineFinish | None = None

        def publish(text: str) -> None:
            nonlocal seq
            self.outbox.put_nowait(DeltaFrame(request_id=request_id, seq=seq, text=text))
            seq += 1

        self.running.add(request_id)
        stream = with_flushes(engine.generate(request), coalescer)
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if out is None:
                        if chunk := coalescer.take():
                            publish(chunk)
                    elif isinstance(out, EngineFinish):
                        finish = out
                        break
                    else:
                        if first_token_at is None and out.tokens:
                            first_token_at = time.time()
                            # The continuous batch this sequence decodes in.
                            batch_size = max(1, engine.capacity().running)
                        if chunk := coalescer.add(out.text, out.tokens, time.time()):
                            publish(chunk)
        finally:
            self.running.discard(request_id)
        if rest := coalescer.take():
            publish(rest)
        done_at = time.time()
        if finish is None or finish.finish_reason == "cancelled":
            self.outbox.put_nowait(
                ErrorFrame(
                    code=ErrorCode.cancelled, message="request cancelled", request_id=request_id
                )
            )
            return
        self.outbox.put_nowait(
            DoneFrame(
                request_id=request_id,
                finish_reason=finish.finish_reason,
                usage=Usage(
                    prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens
                ),
                timings=Timings(
                    queue_ms=0.0,  # the engine is started at once: no queue before it
                    batch_size=batch_size,
                    ttft_ms=round(((first_token_at or done_at) - received) * 1000, 3),
                    total_ms=round((done_at - received) * 1000, 3),
                ),
            )
        )


def build_app(settings: DirectSettings) -> Starlette:
    server = DirectServer(settings)
    return Starlette(
        routes=[
            Route("/healthz", server.healthz),
            Route("/readyz", server.healthz),
            WebSocketRoute("/v1/chat", server.chat),
        ],
        lifespan=server.lifespan,
    )


def main() -> None:
    settings = DirectSettings()
    uvicorn.run(
        build_app(settings),
        host=settings.bench_direct_host,
        port=settings.bench_direct_port,
        ws_max_size=settings.bench_direct_max_frame_bytes * 4,
        log_level="warning",
        lifespan="on",
        loop=UVICORN_LOOP,
    )


if __name__ == "__main__":
    main()
