"""One request running on this worker: its stream, coalescer, writer and clock readings.

The runner keeps one `RequestState` per running request in one dict (as vLLM's
`RequestState`): a hand-back or a supersession is a flag on it, and everything its
`request.finished` line and its final record say is read from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal

import structlog

from services.worker.coalesce import Coalescer
from services.worker.engines.base import Engine, EngineDelta, EngineFinish, EngineOutput
from services.worker.replies import Fenced, ReplyFailed, ReplyWriter
from shared.messages import (
    DeltaFrames,
    DoneResult,
    ErrorCode,
    ErrorResult,
    QueuedRequest,
    Timings,
    Usage,
)

log = structlog.get_logger()

# Why a run is being stopped from outside: handed back (a drain, a fencing), or superseded
# by a later attempt of the same request that came to this worker.
Stopping = Literal["hand_back", "superseded"]


@dataclass
class ChunkGaps:
    """How evenly chunks left, on the monotonic clock, for the `request.finished` line.

    The engine's own pauses (token inter-arrival) within a chunk window are kept apart, so
    the gap that coalescing adds can be told from a slow or stalled engine.
    """

    last_chunk_at: float | None = None
    last_token_at: float | None = None
    token_gap: float = 0.0
    max_gap: float = 0.0
    max_excess: float = 0.0
    flush_lateness: float = 0.0  # how far past flush time a chunk left: loop lag, not policy
    wait_sum: float = 0.0
    chunks: int = 0

    def token(self, arrived: float) -> None:
        last_chunk, last_token = self.last_chunk_at, self.last_token_at
        since = last_token if last_chunk is None else max(last_chunk, last_token or last_chunk)
        if since is not None:
            self.token_gap = max(self.token_gap, arrived - since)
        self.last_token_at = arrived

    def chunk(self, now: float, waited: float, overdue: float) -> None:
        self.wait_sum += waited
        self.chunks += 1
        self.flush_lateness = max(self.flush_lateness, overdue)
        if self.last_chunk_at is not None:
            self.max_gap = max(self.max_gap, now - self.last_chunk_at)
            self.max_excess = max(self.max_excess, now - self.last_chunk_at - self.token_gap)
        self.last_chunk_at = now
        self.token_gap = 0.0


@dataclass
class RequestState:
    """Caller: `RequestRunner` (one per run) and the flush timer it arms on the event loop."""

    request: QueuedRequest
    batch_size: int
    formed_at: float  # when its batch was formed (the `batch_transit` stage starts there)
    writer: ReplyWriter
    coalescer: Coalescer
    model: str | None = None  # the model that answers (the worker's), in `DoneResult`
    variant: str | None = None  # the variant of it that answers (None: the baseline)
    started: float = field(default_factory=time.time)
    seq: int = 0
    generated: int = 0  # tokens the engine made so far (a failed run's usage)
    first_token_at: float | None = None
    done_at: float | None = None
    final_sent_at: float | None = None
    stopping: Stopping | None = None
    gaps: ChunkGaps = field(default_factory=ChunkGaps)
    # The text sent so far, chunk by chunk: the response cache stores it, a cascade's verifier
    # reads it (cascade.py), and a hand-back gives it to the next attempt to continue.
    chunks: list[str] = field(default_factory=list)
    keep_answer: bool = False  # read when done (a cascade's verifier, a shadow): logprobs kept
    logprobs: list[float] = field(default_factory=list)  # the answer's, where kept and given
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # Monotonic time of its start or its last output: the engine's progress (engine_health.py).
    progressed_at: float = field(default_factory=time.monotonic)
    # The engine has given its finish (or failed it): what follows (the final's write, a
    # flush waiting on a node away) is the bus's time, not the engine's.
    engine_done: bool = False
    _timer: asyncio.TimerHandle | None = None
    _ended: asyncio.Future[EngineFinish] | None = None  # push mode: the run waits on it
    _frames: DeltaFrames = field(init=False)

    def __post_init__(self) -> None:
        self._frames = DeltaFrames(self.request.request_id, self.request.attempt)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def continue_answer(self) -> None:
        """Write the text the request's earlier attempts sent (`continues`) as this attempt's
        first delta, before the engine's own: a reader that starts the answer over at each
        attempt still has it whole, and the edge shows only what extends it (ADR 0071)."""
        text = self.request.continues
        if text:
            # Its tokens were counted by the attempt that generated them.
            counted = 0 if self.request.delta_tokens else None
            self.writer.send_encoded(self._frames.encode(self.seq, text, tokens=counted))
            self.chunks.append(text)
            self.seq += 1

    def sent_text(self) -> str:
        """Everything this attempt has sent, its continued text included."""
        return "".join(self.chunks)

    def on_delta(self, out: EngineDelta) -> None:
        """One engine output: buffer it, and send the chunk if it is due."""
        now = time.time()
        self.progressed_at = time.monotonic()
        if self.first_token_at is None and out.tokens:
            self.first_token_at = now
        self.generated += out.tokens
        self.gaps.token(time.monotonic())
        chunk = self.coalescer.add(out.text, out.tokens, now, out.logprobs, out.prompt_tokens)
        if chunk is not None and self._worth_sending(chunk):
            self._publish(chunk)
        elif chunk is None and self._timer is None:
            self._arm()

    def pushed(self) -> asyncio.Future[EngineFinish]:
        """Push mode: the future of the engine's finish, which the run awaits.

        The engine calls `on_output` / `on_error` (the `OutputSink`) from its step loop;
        a chunk leaves from there, and the run wakes once, at the end. A failure of the
        run's own (`Fenced`, `ReplyFailed` from a write) ends it the same way.
        """
        self._ended = asyncio.get_running_loop().create_future()
        return self._ended

    def on_output(self, out: EngineOutput) -> None:
        ended = self._ended
        if ended is None or ended.done():
            return  # the run stopped listening (it aborts the request)
        if isinstance(out, EngineFinish):
            ended.set_result(out)
            return
        try:
            self.on_delta(out)
        except Exception as exc:  # the run's own failure, raised where the run awaits
            ended.set_exception(exc)

    def on_error(self, error: Exception) -> None:
        ended = self._ended
        if ended is not None and not ended.done():
            ended.set_exception(error)

    def flush_rest(self) -> None:
        """Send what is still buffered (the stream ended)."""
        rest = self.coalescer.take(time.time())
        if rest is not None and self._worth_sending(rest):
            self._publish(rest)

    def final(
        self, finish: EngineFinish | None, failure: ErrorResult | None
    ) -> DoneResult | ErrorResult:
        """The run's final record (`finish` is None only when `failure` is set)."""
        self.done_at = done_at = time.time()
        if failure is not None:
            return failure
        if finish is None:
            raise AssertionError("engine stream ended without a finish record")
        request = self.request
        if finish.finish_reason == "cancelled":
            # With what it used: the edge settles the tenant's charge with it (issue 37, N5).
            used = Usage(
                prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens
            )
            return ErrorResult.for_request(
                request, ErrorCode.cancelled, "request cancelled", seq=self.seq, usage=used
            )
        return DoneResult(
            request_id=request.request_id,
            attempt=request.attempt,
            seq=self.seq,
            finish_reason=finish.finish_reason,
            model=self.model,
            variant=self.variant,
            tool_calls=None if finish.tool_calls is None else list(finish.tool_calls),
            content=finish.content,
            usage=Usage(
                prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens
            ),
            timings=Timings(
                queue_ms=round((self.started - request.created_at) * 1000, 3),
                batch_size=self.batch_size,
                ttft_ms=round(((self.first_token_at or done_at) - request.created_at) * 1000, 3),
                total_ms=round((done_at - request.created_at) * 1000, 3),
            ),
        )

    def log_finished(self, final: DoneResult | ErrorResult, finish: EngineFinish | None) -> None:
        gaps = self.gaps
        log.info(
            "request.finished",
            request_id=self.request.request_id,
            attempt=self.request.attempt,
            finish_reason=final.code.value
            if isinstance(final, ErrorResult)
            else final.finish_reason,
            completion_tokens=finish.completion_tokens if finish is not None else 0,
            chunks=self.seq,
            max_chunk_gap_ms=round(gaps.max_gap * 1000, 3),
            max_chunk_gap_over_token_gap_ms=round(gaps.max_excess * 1000, 3),
            max_flush_lateness_ms=round(gaps.flush_lateness * 1000, 3),
            mean_chunk_wait_ms=round(gaps.wait_sum / gaps.chunks * 1000, 3) if gaps.chunks else 0.0,
        )

    def close(self) -> None:
        """The run returned: no more flushes; whoever waits for it to exit goes on."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.exited.set()

    def _worth_sending(self, chunk: str) -> bool:
        """A chunk just taken goes out if it has text, or logprobs (of tokens whose text
        is not whole yet): they are not lost with an empty chunk."""
        return bool(chunk) or bool(self.coalescer.last_logprobs)

    def _publish(self, text: str) -> None:
        coalescer = self.coalescer
        counted = coalescer.counts()
        # Not asked: left out, so a reader from before them stays whole.
        tokens, prompt_tokens = counted if self.request.delta_tokens else (None, None)
        self.gaps.chunk(time.monotonic(), coalescer.last_wait, coalescer.last_overdue)
        self.writer.send_encoded(
            self._frames.encode(self.seq, text, coalescer.last_logprobs, tokens, prompt_tokens)
        )
        self.chunks.append(text)
        if self.keep_answer and coalescer.last_logprobs:
            self.logprobs.extend(t.logprob for t in coalescer.last_logprobs)
        self.seq += 1

    def _arm(self) -> None:
        flush_at = self.coalescer.flush_at()
        if flush_at is None:
            return
        delay = max(0.0, flush_at - time.time())
        self._timer = asyncio.get_running_loop().call_later(delay, self._flush_due)

    def _flush_due(self) -> None:
        """Timer: the oldest buffered token is due (the engine paused); send the buffer."""
        self._timer = None
        flush_at = self.coalescer.flush_at()
        if flush_at is None:
            return
        now = time.time()
        if now < flush_at:
            self._arm()  # the buffer left meanwhile and filled again: wait for its own time
            return
        chunk = self.coalescer.take(now)
        if chunk is None or not self._worth_sending(chunk):
            return
        # A fenced or failed writer: the run sees it at its next chunk or its final record.
        with contextlib.suppress(Fenced, ReplyFailed):
            self._publish(chunk)


class RunningRequests:
    """The one map of the requests running here, by id (the engine knows requests by id).

    Caller: the runner (`start`, `end`), the drain and the fencing (`hand_back`).
    Affects: each `RequestState.stopping`, and the engine (an abort per stop).
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def ids(self) -> list[str]:
        """Ids of the requests whose run has not returned yet, sorted."""
        return sorted(self._states)

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def start(self, state: RequestState) -> None:
        self._states[state.request_id] = state

    def progress(self) -> tuple[int, float]:
        """How many requests the engine holds, and the latest start or output among them
        (monotonic; -inf with none). A run whose engine is done and that waits for its
        records to be stored is not counted: a node away held the finals of a worker's
        runs, and its watch took the engine for hung (a chaos check's 20 s black hole)."""
        states = [s for s in self._states.values() if not s.engine_done]
        return len(states), max((s.progressed_at for s in states), default=float("-inf"))

    def end(self, state: RequestState) -> None:
        """The run returned: no more flushes; whoever waits for it to exit goes on."""
        if self._states.get(state.request_id) is state:
            del self._states[state.request_id]
        state.close()

    async def stop(self, request_id: str, why: Stopping) -> bool:
        """Stop a running request without answering it; False if it is not running here."""
        state = self._states.get(request_id)
        if state is None:
            return False
        if why == "superseded" or state.stopping is None:
            state.stopping = why
        await self._engine.abort(request_id)
        return True

    async def hand_back(self, request_id: str) -> bool:
        """Stop a running request to be run again; its `run` returns "handed_back"."""
        return await self.stop(request_id, "hand_back")
