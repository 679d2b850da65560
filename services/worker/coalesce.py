"""Token coalescing: buffer a request's deltas and flush every `flush_ms` or `flush_tokens`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from services.worker.engines.base import EngineOutput
from shared.messages import TokenLogprob


@dataclass
class Coalescer:
    """Pure buffer for one request's stream; the caller supplies the clock."""

    flush_seconds: float
    flush_tokens: int
    # The first token leaves at once: time to first token is what a reader feels, and it
    # costs one extra record per request.
    first_at_once: bool = False
    _sent_any: bool = False
    _parts: list[str] = field(default_factory=list)
    _logprobs: list[TokenLogprob] | None = None  # None: no buffered delta carried any
    _tokens: int = 0
    # What `counts` reports next: generated tokens since its last call, and the prompt's
    # (the engine's first output says it) if it came since.
    _uncounted: int = 0
    _prompt_tokens: int | None = None
    _since: float | None = None
    _last_token: float | None = None
    _step: float | None = None  # the engine's latest gap between tokens
    last_wait: float = 0.0  # how long the oldest token of the last chunk taken had waited
    last_overdue: float = 0.0  # how far past its flush time the last chunk left (loop lag)
    # The logprobs of the last chunk taken: its deltas' in order, or None if none had any.
    last_logprobs: list[TokenLogprob] | None = None

    def add(
        self,
        text: str,
        tokens: int,
        now: float,
        logprobs: Sequence[TokenLogprob] | None = None,
        prompt_tokens: int | None = None,
    ) -> str | None:
        """Buffer a delta; return the chunk to send if the buffer is now due.

        A chunk's logprobs (`last_logprobs` once taken) are its deltas', concatenated in
        order. A chunk taken may be "" and still carry logprobs (a token whose text is not
        whole yet): the caller sends it if it has either.

        A chunk also leaves when the next token, expected one engine step from now, would
        find it overdue: sent on a token's arrival instead of by a timer that fires late, the
        gap between chunks stays within `flush_ms` plus one step.
        """
        if self._last_token is not None:
            self._step = now - self._last_token
        self._last_token = now
        if self._since is None:
            self._since = now
        self._parts.append(text)
        self._tokens += tokens
        self._uncounted += tokens
        if prompt_tokens is not None:
            self._prompt_tokens = prompt_tokens
        if logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs)
        age = now - self._since
        first = self.first_at_once and not self._sent_any and bool(text)
        next_late = self._step is not None and age + self._step > self.flush_seconds
        if first or self._tokens >= self.flush_tokens or age >= self.flush_seconds or next_late:
            return self.take(now)
        return None

    def flush_at(self) -> float | None:
        """When the oldest buffered token must leave, or None if the buffer is empty."""
        return None if self._since is None else self._since + self.flush_seconds

    def take(self, now: float | None = None) -> str | None:
        """Empty the buffer; None if nothing was buffered. `now` records the oldest's wait."""
        if self._since is None:
            return None
        self.last_wait = 0.0 if now is None else max(0.0, now - self._since)
        self.last_overdue = max(0.0, self.last_wait - self.flush_seconds)
        text = "".join(self._parts)
        self._sent_any = self._sent_any or bool(text)
        self.last_logprobs, self._logprobs = self._logprobs, None
        self._parts.clear()
        self._tokens = 0
        self._since = None
        return text

    def counts(self) -> tuple[int, int | None]:
        """For the chunk being sent: the generated tokens since the last call, and the
        prompt's if they came since. A chunk taken but not sent (no text, no logprobs) leaves
        its counts to the next one sent."""
        counted = self._uncounted, self._prompt_tokens
        self._uncounted, self._prompt_tokens = 0, None
        return counted


async def with_flushes(
    outputs: AsyncIterator[EngineOutput], coalescer: Coalescer
) -> AsyncGenerator[EngineOutput | None]:
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
