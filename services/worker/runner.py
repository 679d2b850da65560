"""Runs one request on the engine and streams its coalesced chunks to `reply_to`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from services.worker.coalesce import Coalescer
from services.worker.engines.base import Engine, EngineFinish, EngineOutput, EngineRequest
from shared.messages import (
    DeltaResult,
    DoneResult,
    ErrorCode,
    ErrorResult,
    QueuedRequest,
    Tier,
    Timings,
    Usage,
)
from shared.results import send_result

log = structlog.get_logger()


def engine_request(request: QueuedRequest) -> EngineRequest:
    return EngineRequest(
        request_id=request.request_id,
        prompt=request.prompt_text(),
        max_tokens=request.effective_max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=tuple(request.stop),
        priority=0 if request.tier is Tier.interactive else 1,
    )


class RequestRunner:
    """Streams engine output for requests, one `run` call per request."""

    def __init__(
        self, engine: Engine, producer: AIOKafkaProducer, flush_ms: float, flush_tokens: int
    ) -> None:
        self._engine = engine
        self._producer = producer
        self._flush_seconds = flush_ms / 1000.0
        self._flush_tokens = flush_tokens

    async def run(self, request: QueuedRequest, batch_size: int) -> None:
        """Generate and publish every chunk and the final record; return once all are stored."""
        started = time.time()
        coalescer = Coalescer(self._flush_seconds, self._flush_tokens)
        seq = 0
        first_token_at: float | None = None
        last: asyncio.Future[RecordMetadata] | None = None

        async def publish(text: str) -> None:
            nonlocal seq, last
            last = await send_result(
                self._producer,
                request.reply_to,
                DeltaResult(request_id=request.request_id, attempt=request.attempt, seq=seq, text=text),
            )
            seq += 1

        finish: EngineFinish | None = None
        stream = _with_deadlines(self._engine.generate(engine_request(request)), coalescer)
        async with contextlib.aclosing(stream):
            async for out in stream:
                now = time.time()
                if out is None:  # the oldest buffered token is due
                    chunk = coalescer.take()
                    if chunk:
                        await publish(chunk)
                    continue
                if isinstance(out, EngineFinish):
                    finish = out
                    break
                if first_token_at is None and out.tokens:
                    first_token_at = now
                chunk = coalescer.add(out.text, out.tokens, now)
                if chunk:
                    await publish(chunk)
        rest = coalescer.take()
        if rest:
            await publish(rest)
        assert finish is not None, "engine stream ended without a finish record"
        done_at = time.time()
        if finish.finish_reason == "cancelled":
            final: DoneResult | ErrorResult = ErrorResult(
                request_id=request.request_id,
                attempt=request.attempt,
                seq=seq,
                code=ErrorCode.cancelled,
                message="request cancelled",
            )
        else:
            final = DoneResult(
                request_id=request.request_id,
                attempt=request.attempt,
                seq=seq,
                finish_reason=finish.finish_reason,
                usage=Usage(
                    prompt_tokens=finish.prompt_tokens,
                    completion_tokens=finish.completion_tokens,
                ),
                timings=Timings(
                    queue_ms=round((started - request.created_at) * 1000, 3),
                    batch_size=batch_size,
                    ttft_ms=round(((first_token_at or done_at) - request.created_at) * 1000, 3),
                    total_ms=round((done_at - request.created_at) * 1000, 3),
                ),
            )
        last = await send_result(self._producer, request.reply_to, final)
        await last
        log.info(
            "request.finished",
            request_id=request.request_id,
            finish_reason=finish.finish_reason,
            completion_tokens=finish.completion_tokens,
            chunks=seq,
        )


async def _with_deadlines(
    outputs: AsyncIterator[EngineOutput], coalescer: Coalescer
) -> AsyncIterator[EngineOutput | None]:
    """Yield engine outputs, and None whenever the coalescer's flush time passes first."""
    pending: asyncio.Task[EngineOutput] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(outputs))
            flush_at = coalescer.flush_at()
            timeout = None if flush_at is None else max(0.0, flush_at - time.time())
            done, _ = await asyncio.wait({pending}, timeout=timeout)
            if not done:
                yield None
                continue
            try:
                out = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield out
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        await outputs.aclose()  # type: ignore[attr-defined]
