"""Graceful shutdown: stop taking batches, hand back what another worker can continue, let
the rest finish within the drain window, hand back what is left."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from aiokafka import AIOKafkaProducer

from shared.kafka import encode, key_of
from shared.messages import QueuedRequest
from shared.results import WRITE_ERRORS
from shared.retry import retrying
from shared.topics import Topics

log = structlog.get_logger()


async def hand_back(
    producer: AIOKafkaProducer, topics: Topics, request: QueuedRequest, sent: str | None = None
) -> None:
    """Put the request back on its tier topic, keyed by request_id; return once stored.

    `sent`: the text its run sent, which the next attempt continues (None: what this
    attempt was given to continue, if anything). Retried with backoff for as long as it
    takes (a broker outage): it is the request's only way on, and the worker keeps it held
    (in its heartbeats) until then.
    """
    again = request.next_attempt(sent)

    async def write() -> None:
        await producer.send_and_wait(
            topics.tier(request.tier), encode(again), key=key_of(request.request_id)
        )

    await retrying(
        write,
        within_s=None,
        what="hand_back",
        retry_on=WRITE_ERRORS,
        request_id=request.request_id,
    )
    log.info("request.handed_back", request_id=request.request_id, attempt=again.attempt)


class Drain:
    """The shutdown sequence of one worker; `requested` is set by the first SIGTERM."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.requested = asyncio.Event()
        self.now = asyncio.Event()  # a second SIGTERM: skip the rest of the drain window

    def signal(self) -> None:
        if self.requested.is_set():
            self.now.set()
        self.requested.set()

    async def run(
        self,
        batches: set[asyncio.Task[None]],
        running: Callable[[], frozenset[str]],
        stop_request: Callable[[str], Awaitable[bool]],
        at_once: Callable[[str], bool] = lambda _: False,
    ) -> None:
        """Stop the running requests `at_once` says to (their next attempt continues them
        elsewhere: ADR 0071), wait up to the drain timeout for `batches`, then stop what
        still runs, then wait."""
        now = sorted(r for r in running() if at_once(r))
        log.info("drain.started", batches=len(batches), running=len(running()), at_once=len(now))
        for request_id in now:
            await stop_request(request_id)
        if batches:
            waiter = asyncio.ensure_future(asyncio.wait(set(batches)))
            skip = asyncio.ensure_future(self.now.wait())
            await asyncio.wait(
                {waiter, skip}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            waiter.cancel()
            skip.cancel()
        unfinished = sorted(running())
        for request_id in unfinished:
            await stop_request(request_id)
        if batches:
            # Each batch now hands its stopped requests back and commits its offset.
            await asyncio.wait(set(batches))
        log.info("drain.finished", handed_back=len(now) + len(unfinished))
