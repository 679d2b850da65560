"""Bounded retries with exponential backoff, for Kafka writes that must outlive a broker blip."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

log = structlog.get_logger()

T = TypeVar("T")

FIRST_BACKOFF_S = 0.1
LONGEST_BACKOFF_S = 2.0


class Backoff:
    """A doubling wait between tries, capped: `next()` gives the next, `reset()` starts over.

    The one backoff of the services: each loop that retries owns one.
    """

    def __init__(self, first_s: float = FIRST_BACKOFF_S, longest_s: float = LONGEST_BACKOFF_S):
        if not 0 < first_s <= longest_s:
            raise ValueError(f"need 0 < first_s <= longest_s, got {first_s}, {longest_s}")
        self.first_s = first_s
        self.longest_s = longest_s
        self._wait = 0.0

    def next(self) -> float:
        self._wait = self.first_s if self._wait == 0 else min(self.longest_s, self._wait * 2)
        return self._wait

    def reset(self) -> None:
        self._wait = 0.0


async def retrying(
    attempt: Callable[[], Awaitable[T]],
    *,
    within_s: float | None,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    backoff: Backoff | None = None,
    attempt_s: float | None = None,
    **context: object,
) -> T:
    """Run `attempt` until it succeeds, backing off between tries.

    `within_s`: give up once this long has passed and re-raise the last error (None: never
    give up, for writes that must not be lost and have no other way out). `backoff`: the
    waits between tries (the default `Backoff()` when None). `attempt_s`: each try is cut
    after this long and counts as failed (a read that waits for an end it may never reach
    is then started over, against fresh end offsets). Every failed try is logged with
    `what` and `context`.
    """
    deadline = None if within_s is None else time.monotonic() + within_s
    backoff = backoff or Backoff()
    retry_on = (*retry_on, TimeoutError) if attempt_s is not None else retry_on
    tries = 0
    while True:
        tries += 1
        try:
            async with asyncio.timeout(attempt_s):
                return await attempt()
        except retry_on as exc:
            wait = backoff.next()
            left = None if deadline is None else deadline - time.monotonic()
            gives_up = left is not None and left <= wait
            log.warning(
                "write.retry" if not gives_up else "write.gave_up",
                what=what,
                tries=tries,
                error=repr(exc),
                **context,
            )
            if gives_up:
                raise
            await asyncio.sleep(wait)
