"""Runs one request on the engine and streams its coalesced chunks to `reply_to`.

Every run ends in exactly one of: its final record stored (`done`, or `error` with a
stable code: `cancelled`, `invalid_request` for a prompt longer than the model's context,
`internal` when the engine fails the request), or no final record and the request handed
back to be run again (a drain, a fenced worker, result records that could not be stored).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Literal

import structlog
from aiokafka import AIOKafkaProducer

from services.worker.coalesce import Coalescer, with_flushes
from services.worker.engines.base import (
    ChatTurn,
    Engine,
    EngineFinish,
    EngineRequest,
    PromptTooLong,
)
from services.worker.replies import Fenced, ReplyFailed, ReplyWriter
from services.worker.telemetry import final_record_headers, observe_answered
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

log = structlog.get_logger()

# How a run ended: answered (its final record is stored), or stopped without an answer to
# be run again as the next attempt: "handed_back" (asked to stop: a drain or a fencing),
# "rerun" (its own records could not be written, or its worker was fenced meanwhile); or
# "superseded": a later attempt of the same request came to this worker (it had been
# declared dead while it ran this one), so this one stops without a word and is done.
RunOutcome = Literal["answered", "handed_back", "rerun", "superseded"]


def engine_request(
    request: QueuedRequest, trace_headers: Mapping[str, str] | None = None
) -> EngineRequest:
    messages = (
        tuple(ChatTurn(m.role, m.content) for m in request.messages)
        if request.messages is not None
        else None
    )
    return EngineRequest(
        request_id=request.request_id,
        prompt=request.prompt_text(),
        max_tokens=request.effective_max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=tuple(request.stop),
        seed=request.seed,
        priority=0 if request.tier is Tier.interactive else 1,
        messages=messages,
        trace_headers=dict(trace_headers or {}),
    )


class RequestRunner:
    """Streams engine output for requests, one `run` call per request."""

    def __init__(
        self,
        engine: Engine,
        producer: AIOKafkaProducer,
        flush_ms: float,
        flush_tokens: int,
        flush_first: bool = True,
        *,
        epoch_now: Callable[[], int] = lambda: 0,
        write_timeout_s: float = 10.0,
    ) -> None:
        self._engine = engine
        self._producer = producer
        self._epoch_now = epoch_now
        self._write_timeout_s = write_timeout_s
        self._flush_seconds = flush_ms / 1000.0
        self._flush_tokens = flush_tokens
        self._flush_first = flush_first
        # request_id -> attempt of the run under way (the engine knows requests by id)
        self._running: dict[str, int] = {}
        self._handing_back: set[str] = set()
        self._superseded: set[str] = set()
        self._exited: dict[str, asyncio.Event] = {}

    @property
    def running(self) -> frozenset[str]:
        """Request ids whose `run` has not returned yet."""
        return frozenset(self._running)

    async def hand_back(self, request_id: str) -> bool:
        """Stop a running request without answering it; its `run` returns "handed_back"."""
        if request_id not in self._running:
            return False
        self._handing_back.add(request_id)
        await self._engine.abort(request_id)
        return True

    async def run(
        self,
        request: QueuedRequest,
        batch_size: int,
        trace_headers: Mapping[str, str] | None = None,
        *,
        epoch: int | None = None,
    ) -> RunOutcome:
        """Generate and publish every chunk and the final record; return once all are stored.

        `epoch`: the fence epoch the request was taken in (default: now); once the worker
        is fenced past it, the run writes nothing more and returns "rerun".
        """
        rid = request.request_id
        while (older := self._running.get(rid)) is not None:
            if older >= request.attempt:
                log.info("request.superseded", request_id=rid, attempt=request.attempt)
                return "superseded"
            # Ours is an older attempt, re-run elsewhere meanwhile: it makes way, unheard.
            self._superseded.add(rid)
            await self._engine.abort(rid)
            await self._exited[rid].wait()
        self._running[rid] = request.attempt
        self._exited[rid] = exited = asyncio.Event()
        writer = ReplyWriter(
            self._producer,
            request.reply_to,
            epoch=self._epoch_now() if epoch is None else epoch,
            epoch_now=self._epoch_now,
            within_s=self._write_timeout_s,
        )
        try:
            return await self._run(request, batch_size, trace_headers, writer)
        except (Fenced, ReplyFailed) as exc:
            log.warning(
                "request.stopped_for_rerun",
                request_id=rid,
                attempt=request.attempt,
                reason=type(exc).__name__,
                error=str(exc),
            )
            return "rerun"
        finally:
            del self._running[rid]
            self._handing_back.discard(rid)
            self._superseded.discard(rid)
            del self._exited[rid]
            exited.set()

    async def _run(
        self,
        request: QueuedRequest,
        batch_size: int,
        trace_headers: Mapping[str, str] | None,
        writer: ReplyWriter,
    ) -> RunOutcome:
        started = time.time()
        coalescer = Coalescer(self._flush_seconds, self._flush_tokens, self._flush_first)
        seq = 0
        first_token_at: float | None = None
        last_chunk_at: float | None = None
        max_gap = 0.0
        # The engine's own pauses (token inter-arrival) within a chunk window, so the gap
        # that coalescing adds can be told apart from a slow or stalled engine.
        last_token_at: float | None = None
        token_gap = 0.0
        max_excess = 0.0
        flush_lateness = 0.0  # how far past flush time a chunk left: event-loop lag, not policy
        waits: list[float] = []

        async def publish(text: str) -> None:
            nonlocal seq, last_chunk_at, max_gap, token_gap, max_excess, flush_lateness
            waits.append(coalescer.last_wait)
            flush_lateness = max(flush_lateness, coalescer.last_overdue)
            now = time.monotonic()
            if last_chunk_at is not None:
                max_gap = max(max_gap, now - last_chunk_at)
                max_excess = max(max_excess, now - last_chunk_at - token_gap)
            last_chunk_at = now
            token_gap = 0.0
            await writer.send(
                DeltaResult(
                    request_id=request.request_id, attempt=request.attempt, seq=seq, text=text
                )
            )
            seq += 1

        finish: EngineFinish | None = None
        failure: ErrorResult | None = None
        stream = with_flushes(
            self._engine.generate(engine_request(request, trace_headers)), coalescer
        )
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    now = time.time()
                    if out is None:  # the oldest buffered token is due
                        chunk = coalescer.take(now)
                        if chunk:
                            await publish(chunk)
                        continue
                    if isinstance(out, EngineFinish):
                        finish = out
                        break
                    if first_token_at is None and out.tokens:
                        first_token_at = now
                    arrived = time.monotonic()
                    since = (
                        last_token_at
                        if last_chunk_at is None
                        else max(last_chunk_at, last_token_at or last_chunk_at)
                    )
                    if since is not None:
                        token_gap = max(token_gap, arrived - since)
                    last_token_at = arrived
                    chunk = coalescer.add(out.text, out.tokens, now)
                    if chunk:
                        await publish(chunk)
        except (Fenced, ReplyFailed):
            raise  # closing the stream above has aborted the request in the engine
        except PromptTooLong as exc:
            failure = self._error(request, seq, ErrorCode.invalid_request, str(exc))
        except Exception as exc:
            # The engine failed this request (not the worker): answer it, serve the next.
            log.exception("request.engine_failed", request_id=request.request_id)
            message = f"the engine failed this request ({type(exc).__name__})"
            failure = self._error(request, seq, ErrorCode.internal, message)
        if request.request_id in self._superseded:
            log.info("request.superseded", request_id=request.request_id, attempt=request.attempt)
            return "superseded"
        if failure is None and request.request_id in self._handing_back:
            # No final record: the next attempt's first record resets the client's stream.
            with contextlib.suppress(ReplyFailed, Fenced):
                writer.check()  # a fenced run has nothing to wait for
                await writer.flush()  # bounded; the next attempt supersedes them anyway
            log.info("request.stopped_for_hand_back", request_id=request.request_id, chunks=seq)
            return "handed_back"
        if failure is None:
            assert finish is not None, "engine stream ended without a finish record"
            rest = coalescer.take(time.time())
            if rest:
                await publish(rest)
        done_at = time.time()
        final: DoneResult | ErrorResult
        if failure is not None:
            final = failure
        elif finish is None:
            raise AssertionError("engine stream ended without a finish record")
        elif finish.finish_reason == "cancelled":
            final = ErrorResult(
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
        # The final record carries the request's trace context on to the edge.
        await writer.send(final, headers=final_record_headers())
        await writer.flush()
        observe_answered(
            request, started=started, first_token_at=first_token_at, done_at=done_at, final=final
        )
        log.info(
            "request.finished",
            request_id=request.request_id,
            attempt=request.attempt,
            finish_reason=final.code.value
            if isinstance(final, ErrorResult)
            else final.finish_reason,
            completion_tokens=finish.completion_tokens if finish is not None else 0,
            chunks=seq,
            max_chunk_gap_ms=round(max_gap * 1000, 3),
            max_chunk_gap_over_token_gap_ms=round(max_excess * 1000, 3),
            max_flush_lateness_ms=round(flush_lateness * 1000, 3),
            mean_chunk_wait_ms=round(sum(waits) / len(waits) * 1000, 3) if waits else 0.0,
        )
        return "answered"

    @staticmethod
    def _error(request: QueuedRequest, seq: int, code: ErrorCode, message: str) -> ErrorResult:
        return ErrorResult(
            request_id=request.request_id,
            attempt=request.attempt,
            seq=seq,
            code=code,
            message=message,
        )
