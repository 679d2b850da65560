"""The edge's one producer, replaced by a new one after a broker outage.

aiokafka's idempotent producer does not recover once a batch failed or expired (a broker
stopped for longer than the request timeout): every later batch of that partition is
refused with `OutOfOrderSequenceNumber`, and no retry helps; only a new producer, with a
new producer id, writes again. A bounded write that gave up cannot tell whether it left
the producer in that state, so after any failed write the edge starts a new producer
before it writes again (cheap: one connection).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

log = structlog.get_logger()


class EdgeProducer:
    """Owns the edge's producer.

    Caller: senders take `current` for each send and report a failed one to `failed`;
    the edge's broker probe calls `replace` while `stale`.
    Affects: `current`, `stale`.
    """

    def __init__(self, factory: Callable[[], AIOKafkaProducer]) -> None:
        self._factory = factory
        self.current = factory()
        self.stale = False

    async def start(self) -> None:
        await self.current.start()

    def failed(self) -> None:
        self.stale = True

    async def replace(self, timeout_s: float) -> None:
        """Start a new producer, then let go of the old one (what it still holds may be lost:
        it belongs to writes that were already reported failed)."""
        new = self._factory()
        try:
            await asyncio.wait_for(new.start(), timeout_s)
        except (KafkaError, TimeoutError, OSError):
            with contextlib.suppress(KafkaError, TimeoutError, OSError):
                await asyncio.wait_for(new.stop(), timeout_s)
            raise
        old, self.current, self.stale = self.current, new, False
        log.info("producer.replaced")
        try:
            await asyncio.wait_for(old.stop(), timeout_s)
        except (KafkaError, TimeoutError) as exc:
            log.warning("producer.stop_failed", error=repr(exc))

    async def stop(self) -> None:
        await self.current.stop()
