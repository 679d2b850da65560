"""The edge's link to Kafka: its one producer, and what it knows of the broker's health.

Every Kafka call made for a client is bounded (`bounded`), and how it went keeps `health`
current. After a failed write the producer may be broken beyond what aiokafka notices (an
expired batch leaves its sequence numbers out of order), so the link stays unreachable until
the probe has renewed the producer and every partition of the requests topic has a leader.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import structlog
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from services.edge.broker_health import BrokerHealth, BrokerUnavailable
from services.edge.metrics import EdgeMetrics
from services.edge.protocol import ErrorFrame
from services.edge.topology import UNKNOWN_TOPIC
from shared.kafka import Headers, encode, key_of
from shared.messages import CancelRecord, ErrorCode, Tier
from shared.producers import RenewingProducer
from shared.topics import Topics

log = structlog.get_logger()
T = TypeVar("T")

PROBE_INTERVAL_S = 1.0


class BrokerLink:
    """Owns the edge's producer and broker health.

    Caller: the gateway and the clients (`bounded`, `send_*`, `overloaded`); `probe` runs
    for the edge's life. Affects: `health`, the producer's renewal.
    """

    def __init__(
        self,
        producer: RenewingProducer,
        admin: AIOKafkaAdminClient,
        topics: Topics,
        *,
        produce_timeout_s: float,
        retry_after_ms: int,
        metrics: EdgeMetrics,
        edge_id: str,
    ) -> None:
        self.producer = producer
        self.admin = admin
        self.topics = topics
        self.produce_timeout_s = produce_timeout_s
        self.retry_after_ms = retry_after_ms
        self.health = BrokerHealth(retry_after_ms=retry_after_ms)
        self._metrics = metrics
        self._edge_id = edge_id
        # Told when the broker answers again after an outage (the gateway's stall clocks).
        self.on_reachable: list[Callable[[], None]] = []
        self._stale = False  # a write failed: renew the producer before trusting it again
        self._down = asyncio.Event()  # set when `health` turns unreachable
        # Requests whose write timed out and whose cancel could not be buffered either:
        # cancelled once the broker answers again (`probe`).
        self._unwithdrawn: set[str] = set()

    async def bounded(self, call: Awaitable[T], timeout_s: float | None = None) -> T:
        """One Kafka call on a client's behalf, bounded; keeps `health` current.

        Raises BrokerUnavailable on a timeout or a retriable Kafka error (a record may still
        be in the producer's buffer and be sent once the broker is back).
        """
        timeout = self.produce_timeout_s if timeout_s is None else timeout_s
        try:
            result = await asyncio.wait_for(call, timeout)
        except TimeoutError as exc:
            self.sent(exc)
            raise BrokerUnavailable(f"no answer from Kafka in {timeout:.1f} s") from exc
        except KafkaError as exc:
            self.sent(exc)
            raise BrokerUnavailable(repr(exc)) from exc
        self.sent(None)
        return result

    def sent(self, error: BaseException | None) -> None:
        """How a bounded Kafka call went (None: it succeeded).

        After a failure the edge stays unreachable until the probe has renewed the
        producer: one write that went through says nothing of the other partitions.
        """
        if error is not None:
            self._stale = True
        self._seen(error is None and not self._stale)

    def overloaded(
        self, message: str, *, request_id: str | None = None, client_id: str | None = None
    ) -> ErrorFrame:
        """The `overloaded` answer; names when to retry while the broker is unreachable."""
        retry = None if self.health.reachable else self.retry_after_ms
        return ErrorFrame(
            code=ErrorCode.overloaded,
            message=message,
            request_id=request_id,
            client_id=client_id,
            retry_after_ms=retry,
        )

    def _seen(self, ok: bool) -> None:
        now = time.monotonic()
        if ok and self.health.succeeded(now):
            log.info("broker.reachable", edge_id=self._edge_id)
            for listener in self.on_reachable:
                listener()
        elif not ok and self.health.failed(now):
            log.warning("broker.unreachable", edge_id=self._edge_id)
            self._down.set()
        self._metrics.broker_reachable.set(1 if self.health.reachable else 0)

    async def probe(self) -> None:
        """While the broker is unreachable, ask it every second whether requests can go."""
        timeout = self.produce_timeout_s
        while True:
            await self._down.wait()
            while not self.health.reachable:
                await asyncio.sleep(PROBE_INTERVAL_S)
                try:
                    if self._stale:
                        await asyncio.wait_for(self.producer.renew(), timeout)
                        self._stale = False
                    writable = await asyncio.wait_for(self._requests_writable(), timeout)
                except (KafkaError, TimeoutError, OSError) as exc:
                    log.debug("broker.probe_failed", error=repr(exc))
                    continue
                if writable:
                    self._seen(True)
            self._down.clear()
            for request_id in sorted(self._unwithdrawn):
                await self.withdraw(request_id)

    async def _requests_writable(self) -> bool:
        """Every partition of the topics new requests go to has a leader (a restarted broker
        elects): the requests topic and the tier topics."""
        described = await self.admin.describe_topics(
            [self.topics.requests, *(self.topics.tier(t) for t in Tier)]
        )
        partitions = [p for e in described if e["error_code"] == 0 for p in e["partitions"]]
        return bool(partitions) and all(p["leader"] >= 0 for p in partitions)

    async def partition_count(self, topic: str) -> int | None:
        described = await self.admin.describe_topics([topic])
        for entry in described:
            if entry["topic"] == topic and entry["error_code"] != UNKNOWN_TOPIC:
                return len(entry["partitions"])
        return None

    async def send_request(
        self, topic: str, request_id: str, value: bytes, headers: Headers
    ) -> RecordMetadata:
        """A new request, to `tokenbus.requests` or straight to its tier topic (ADR 0041)."""
        return await self.producer.send_and_wait(
            topic, value, key=key_of(request_id), headers=headers
        )

    async def send_control(self, request_id: str, value: bytes) -> RecordMetadata:
        return await self.producer.send_and_wait(self.topics.control, value, key=key_of(request_id))

    async def send_cancel(
        self, request_id: str, reason: Literal["client", "disconnect", "deadline"]
    ) -> None:
        await self.send_control(
            request_id, encode(CancelRecord(request_id=request_id, reason=reason))
        )

    async def withdraw(self, request_id: str) -> None:
        """Cancel a request whose write timed out: it may still go out when the broker is back.

        The cancel is queued behind it in the producer and not waited for, so the worker
        (which remembers early cancels) drops the request instead of running it for a client
        that was told it failed.
        """
        record = encode(CancelRecord(request_id=request_id, reason="client"))
        try:
            # `send` returns once the record is buffered; the delivery is not waited for.
            delivery = await asyncio.wait_for(
                self.producer.send(self.topics.control, record, key=key_of(request_id)),
                self.produce_timeout_s,
            )
        except (KafkaError, TimeoutError) as exc:
            log.warning("request.withdraw_deferred", request_id=request_id, error=repr(exc))
            self._unwithdrawn.add(request_id)
            return
        self._unwithdrawn.discard(request_id)
        delivery.add_done_callback(_log_withdraw_failure(request_id))


def _log_withdraw_failure(request_id: str) -> Callable[[asyncio.Future[RecordMetadata]], None]:
    def done(delivery: asyncio.Future[RecordMetadata]) -> None:
        if not delivery.cancelled() and delivery.exception() is not None:
            log.error(
                "request.withdraw_failed", request_id=request_id, error=repr(delivery.exception())
            )

    return done
