"""Runs one request on the engine and streams its coalesced chunks to `reply_to`.

Every run ends in exactly one of: its final record stored (`done`, or `error` with a
stable code: `cancelled`, `invalid_request` for a prompt longer than the model's context or
a sampling field its engine does not honour, `internal` when the engine fails the request),
or no final record and the request handed back to be run again (a drain, a fenced worker,
result records that could not be stored).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Literal, cast

import structlog

from services.worker.cache_writes import CacheWriter
from services.worker.cascade import Cascade
from services.worker.coalesce import Coalescer
from services.worker.engines.base import (
    ChatTurn,
    Engine,
    EngineFinish,
    EngineOutput,
    EngineRequest,
    PushEngine,
    RequestRefused,
    engine_failure,
)
from services.worker.outbox import ResultOutbox
from services.worker.replies import Fenced, ReplyFailed, ReplyWriter
from services.worker.request_state import RequestState, RunningRequests
from services.worker.shadow import Shadows
from services.worker.telemetry import RunTrace, WorkerTelemetry
from shared.messages import DoneResult, ErrorCode, ErrorResult, QueuedRequest, Tier, Usage
from shared.prefixes import cache_salt
from shared.telemetry import carrier

log = structlog.get_logger()

# How a run ended: answered (its final record is stored), or stopped without an answer to
# be run again as the next attempt: "handed_back" (asked to stop: a drain or a fencing),
# "rerun" (its own records could not be written, or its worker was fenced meanwhile); or
# "superseded": a later attempt of the same request came to this worker (it had been
# declared dead while it ran this one), so this one stops without a word and is done; or
# "escalated": its answer failed its route's verifier and its next attempt, on the
# cascade's next model, is stored on its tier topic (cascade.py).
# A request on an engine that died is run again elsewhere, up to this attempt; past it, it
# is answered `internal`: a request that kills every engine it meets (a query of death)
# would otherwise take down each worker in turn.
RERUNS_AFTER_ENGINE_DEATHS = 2
RunOutcome = Literal["answered", "handed_back", "rerun", "superseded", "escalated", "engine_dead"]


def engine_request(
    request: QueuedRequest,
    trace_headers: Mapping[str, str] | None = None,
    *,
    continued: bool = False,
) -> EngineRequest:
    """The request as its engine takes it; `continued`: the engine continues the text the
    request's earlier attempts sent (`continues`), rather than start the answer over."""
    messages = (
        tuple(
            ChatTurn(
                m.role,
                m.content,
                None if m.tool_calls is None else tuple(m.tool_calls),
                m.tool_call_id,
            )
            for m in request.messages
        )
        if request.messages is not None
        else None
    )
    return EngineRequest(
        request_id=request.request_id,
        prompt=request.prompt_text(),
        max_tokens=request.max_tokens,  # unset: the rest of the context
        temperature=request.temperature,
        top_p=request.top_p,
        stop=tuple(request.stop),
        seed=request.seed,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=request.logit_bias,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=None if request.stop_token_ids is None else tuple(request.stop_token_ids),
        logprobs=request.logprobs,
        tools=None if request.tools is None else tuple(request.tools),
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=request.response_format,
        priority=0 if request.tier is Tier.interactive else 1,
        messages=messages,
        trace_headers=dict(trace_headers or {}),
        cache_salt=cache_salt(request.tenant),  # one tenant's prompts never hit another's
        continues=request.continues if continued else None,
    )


class RequestRunner:
    """Streams engine output for requests, one `run` call per request.

    Caller: the worker's batch loop. Affects: `runs`, where each run's state lives while
    it runs (a drain or a fencing stops runs there).
    """

    def __init__(
        self,
        engine: Engine,
        outbox: ResultOutbox,
        runs: RunningRequests,
        flush_ms: float,
        flush_tokens: int,
        flush_first: bool = True,
        *,
        telemetry: WorkerTelemetry,
        epoch_now: Callable[[], int] = lambda: 0,
        write_timeout_s: float = 10.0,
        model: str | None = None,
        variant: str | None = None,
        cache: CacheWriter | None = None,
        cascade: Cascade | None = None,
        shadows: Shadows | None = None,
    ) -> None:
        self._engine = engine
        # Pushed to from its step loop where it can (the sim engine), else its streams read.
        self._push = engine if isinstance(engine, PushEngine) else None
        self._model = model  # the model this worker serves: named in every answer
        self._variant = variant  # and the variant of it (None: the baseline)
        self._cache = cache
        self._cascade = cascade  # None: no route configured
        # Shadow validation's gold runs and scores (shadow.py); None: not written (unit tests).
        self._shadows = shadows
        self._outbox = outbox
        self._telemetry = telemetry
        self._epoch_now = epoch_now
        self._write_timeout_s = write_timeout_s
        self._flush_seconds = flush_ms / 1000.0
        self._flush_tokens = flush_tokens
        self._flush_first = flush_first
        self.runs = runs
        # Whether the engine continues an answer (`EngineRequest.continues`); if not, a
        # request's next attempt starts over and the edge shows a reset (ADR 0071).
        self._continues = bool(getattr(engine, "continues_answers", False))
        # (request_id, attempt) -> the text a run stopped to be run again had sent: its
        # next attempt continues it (`left_text`).
        self._left: dict[tuple[str, int], str] = {}

    async def run(
        self,
        request: QueuedRequest,
        batch_size: int,
        trace: RunTrace,
        *,
        formed_at: float | None = None,
        epoch: int | None = None,
        stream: AsyncIterator[EngineOutput] | None = None,
    ) -> RunOutcome:
        """Generate and publish every chunk and the final record; return once all are stored.

        `epoch`: the fence epoch the request was taken in (default: now); once the worker
        is fenced past it, the run writes nothing more and returns "rerun".
        `stream`: the request's outputs when the engine already has it (its row of a batch
        run as one call, static mode); None: the run submits it with `generate`.
        """
        rid = request.request_id
        while (older := self.runs.get(rid)) is not None:
            if older.request.attempt >= request.attempt:
                log.info("request.superseded", request_id=rid, attempt=request.attempt)
                return "superseded"
            # Ours is an older attempt, re-run elsewhere meanwhile: it makes way, unheard.
            await self.runs.stop(rid, "superseded")
            await older.exited.wait()
        writer = ReplyWriter(
            self._outbox,
            request.reply_to,
            rid,
            epoch=self._epoch_now() if epoch is None else epoch,
            epoch_now=self._epoch_now,
            within_s=self._write_timeout_s,
        )
        coalescer = Coalescer(self._flush_seconds, self._flush_tokens, self._flush_first)
        state = RequestState(
            request,
            batch_size,
            time.time() if formed_at is None else formed_at,
            writer,
            coalescer,
            model=self._model,
            variant=self._variant,
            keep_answer=(self._cascade is not None and self._cascade.watches(request))
            or (self._shadows is not None and self._shadows.keeps(request)),
        )
        self.runs.start(state)
        try:
            outcome = await self._run(state, trace, stream)
        except (Fenced, ReplyFailed) as exc:
            log.warning(
                "request.stopped_for_rerun",
                request_id=rid,
                attempt=request.attempt,
                reason=type(exc).__name__,
                error=str(exc),
            )
            outcome = "rerun"
        finally:
            self.runs.end(state)
        if outcome in ("handed_back", "rerun") and self._continues:
            self._left[(rid, request.attempt)] = state.sent_text()
        return outcome

    def continuable(self, request: QueuedRequest) -> bool:
        """Whether a run of `request` can go on from text sent before: where the engine can,
        and the answer is free text (a response format's grammar and a tool parser read the
        answer from its start: such a request starts over). A drain hands such runs back at
        once: their next attempt continues them elsewhere."""
        return self._continues and request.response_format is None and request.tools is None

    def _continued(self, request: QueuedRequest) -> bool:
        """Whether this run continues the text its request's earlier attempts sent."""
        return request.continues is not None and self.continuable(request)

    def left_text(self, request: QueuedRequest) -> str | None:
        """What a run of `request` handed back (or stopped for a rerun) had sent, once: its
        next attempt continues it (`QueuedRequest.next_attempt`); None if none is kept."""
        return self._left.pop((request.request_id, request.attempt), None)

    async def _run(
        self, state: RequestState, trace: RunTrace, stream: AsyncIterator[EngineOutput] | None
    ) -> RunOutcome:
        request = state.request
        finish: EngineFinish | None = None
        failure: ErrorResult | None = None
        # Static mode's rows (`stream` given) were submitted as they came: they start over.
        continued = stream is None and self._continued(request)
        try:
            if continued:
                state.continue_answer()
            try:
                finish = await self._stream(state, trace, stream, continued)
            finally:
                state.engine_done = True
        except (Fenced, ReplyFailed):
            raise  # closing the stream has aborted the request in the engine
        except RequestRefused as exc:  # too long a prompt, a sampling field not honoured
            failure = ErrorResult.for_request(
                request, ErrorCode.invalid_request, str(exc), seq=state.seq
            )
        except Exception as exc:
            why = engine_failure(self._engine)
            if why is not None and request.attempt < RERUNS_AFTER_ENGINE_DEATHS:
                # The engine died, not this request: the worker exits (engine_health.py) and
                # the request, left unanswered, runs elsewhere as after a kill -9.
                log.warning("request.engine_dead", request_id=request.request_id, why=why)
                return "engine_dead"
            # The engine failed this request (not the worker): answer it, serve the next.
            log.exception("request.engine_failed", request_id=request.request_id)
            message = f"the engine failed this request ({type(exc).__name__})"
            # With the tokens it made: the edge settles the tenant's charge with them (issue
            # 37, N5); the prompt, which the engine never reported, is not charged.
            used = Usage(prompt_tokens=0, completion_tokens=state.generated)
            failure = ErrorResult.for_request(
                request, ErrorCode.internal, message, seq=state.seq, usage=used
            )
        if state.stopping == "superseded":
            log.info("request.superseded", request_id=request.request_id, attempt=request.attempt)
            return "superseded"
        if failure is None and state.stopping == "hand_back":
            return await self._stop_for_hand_back(state)
        if failure is None:
            state.flush_rest()
        # A route's answer that fails its verifier, or that the engine failed, is not sent:
        # the next model answers.
        if self._cascade and (
            up := await self._cascade.decide(state, finish)
            if failure is None
            else self._cascade.failed(state, failure)
        ):
            await self._cascade.escalate(state, up, trace)
            return "escalated"
        final = state.final(finish, failure)
        state.final_sent_at = time.time()
        # The final record carries the request's trace context on to the edge.
        state.writer.send(final, headers=self._telemetry.final_headers(trace, state.final_sent_at))
        await state.writer.flush()
        if self._cache is not None and isinstance(final, DoneResult):
            # Only now: a complete answer whose every record is stored.
            self._cache.store(request, state.chunks, final)
        if self._shadows is not None and isinstance(final, DoneResult):
            await self._shadows.answered(request, state.chunks, final)  # gold run, or score
        self._telemetry.answered(trace, state, final)
        state.log_finished(final, finish)
        return "answered"

    async def _stream(
        self,
        state: RequestState,
        trace: RunTrace,
        given: AsyncIterator[EngineOutput] | None,
        continued: bool,
    ) -> EngineFinish:
        """Feed the engine's outputs to the state until the finish record; `continued`: the
        engine continues the text the request's earlier attempts sent."""
        if given is None and self._push is not None:
            return await self._pushed(self._push, state, trace, continued)
        # The engine (vLLM) gets the request's trace context, so its spans join the trace.
        generated = (
            given
            if given is not None
            else self._engine.generate(
                engine_request(state.request, carrier(trace.context), continued=continued)
            )
        )
        stream = cast(AsyncGenerator[EngineOutput], generated)
        async with contextlib.aclosing(stream):
            async for out in stream:
                if isinstance(out, EngineFinish):
                    return out
                state.on_delta(out)
        raise AssertionError("engine stream ended without a finish record")

    @staticmethod
    async def _pushed(
        engine: PushEngine, state: RequestState, trace: RunTrace, continued: bool
    ) -> EngineFinish:
        """As `_stream`, the engine pushing each step's outputs to the state: no wakeup per
        token; a run that stops listening before the finish aborts its request."""
        ended = state.pushed()
        engine.submit(
            engine_request(state.request, carrier(trace.context), continued=continued), state
        )
        try:
            return await ended
        finally:
            if not ended.done() or ended.cancelled() or ended.exception() is not None:
                await engine.abort(state.request_id)

    @staticmethod
    async def _stop_for_hand_back(state: RequestState) -> RunOutcome:
        # No final record: the next attempt's first record resets the client's stream.
        with contextlib.suppress(ReplyFailed, Fenced):
            state.writer.check()  # a fenced run has nothing to wait for
            await state.writer.flush()  # bounded; the next attempt supersedes them anyway
        log.info("request.stopped_for_hand_back", request_id=state.request_id, chunks=state.seq)
        return "handed_back"
