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


def backoffs(
    first: float = FIRST_BACKOFF_S, longest: float = LONGEST_BACKOFF_S
) -> Callable[[], float]:
    """A doubling backoff: each call returns the next wait, capped at `longest`."""
    wait = first / 2

    def next_wait() -> float:
        nonlocal wait
        wait = min(longest, wait * 2)
        return wait

    return next_wait


async def retrying(
    attempt: Callable[[], Awaitable[T]],
    *,
    within_s: float | None,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    **context: object,
) -> T:
    """Run `attempt` until it succeeds, backing off between tries.

    `within_s`: give up once this long has passed and re-raise the last error (None: never
    give up, for writes that must not be lost and have no other way out). Every failed try
    is logged with `what` and `context`.
    """
    deadline = None if within_s is None else time.monotonic() + within_s
    next_wait = backoffs()
    tries = 0
    while True:
        tries += 1
        try:
            return await attempt()
        except retry_on as exc:
            wait = next_wait()
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
