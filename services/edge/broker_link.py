"""The edge's link to Kafka: its one producer, and what it knows of the broker's health.

Every Kafka call made for a client is bounded (`bounded`), and how it went keeps `health`
current. After a failed write the producer may be broken beyond what aiokafka notices (an
expired batch leaves its sequence numbers out of order), so the link stays unreachable until
the probe has renewed the producer and every partition of the requests topic has a leader.

A failed call says the broker is away only when no other call landed meanwhile: with one
node of several away, the calls that its partitions' leaders do not answer fail while the
rest land, and the edge stays up. A new request goes to a partition whose leader answers,
and one already written to a leader that went away waits for the new leader (or the node's
return) up to `produce_wait_s`, as long as other calls keep landing (ADR 0049).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, TypeVar

import structlog
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import create_conn
from aiokafka.errors import KafkaError
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.structs import RecordMetadata, TopicPartition

from services.edge.broker_health import BrokerHealth, BrokerUnavailable
from services.edge.leaders import Leaders, keyed_partition
from services.edge.metrics import EdgeMetrics
from services.edge.protocol import ErrorFrame
from services.edge.topology import UNKNOWN_TOPIC
from shared.kafka import Headers, encode, key_of
from shared.messages import CancelRecord, ErrorCode, Tier
from shared.producers import RenewingProducer
from shared.topics import Topics

log = structlog.get_logger()
T = TypeVar("T")
R = TypeVar("R")

PROBE_INTERVAL_S = 1.0
# How long the broker nodes are given to answer a metadata request when writes stall.
PROBE_TIMEOUT_S = 1.5
# A probe whose asks all timed out while this edge's own loop ran this late says nothing of
# the broker: the answers may sit unread in the sockets (chaos seed 294815970: a loop busy
# with 700 resumes in 15 s timed out on all three nodes, and 38 new requests were refused).
LOOP_TICK_S = 0.05
BUSY_LOOP_LAG_S = 0.5


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
        produce_wait_s: float | None = None,
        security: Mapping[str, Any] | None = None,
    ) -> None:
        self.producer = producer
        self.admin = admin
        self.topics = topics
        self.produce_timeout_s = produce_timeout_s
        # How long a written request may wait for its partition's leader while the rest of
        # the cluster answers (a node away: an election, or its return).
        self.produce_wait_s = max(produce_timeout_s, produce_wait_s or produce_timeout_s)
        self.leaders = Leaders(avoid_s=self.produce_wait_s)
        self._security = dict(security or {})  # `shared.kafka.client_security`, for probes
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
        self._judging: asyncio.Task[None] | None = None  # a failure being judged (`sent`)
        self._asking: asyncio.Task[bool] | None = None  # a round of `cluster_answers`

    async def bounded(self, call: Awaitable[T], timeout_s: float | None = None) -> T:
        """One Kafka call on a client's behalf, bounded; keeps `health` current.

        Raises BrokerUnavailable on a timeout or a retriable Kafka error (a record may still
        be in the producer's buffer and be sent once the broker is back).
        """
        timeout = self.produce_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(call, timeout)
        except TimeoutError as exc:
            self.sent(exc, started)
            raise BrokerUnavailable(f"no answer from Kafka in {timeout:.1f} s") from exc
        except KafkaError as exc:
            self.sent(exc, started)
            raise BrokerUnavailable(repr(exc)) from exc
        self.sent(None)
        return result

    def sent(self, error: BaseException | None, started: float | None = None) -> None:
        """How a bounded Kafka call begun at `started` went (None: it succeeded).

        A failure while other calls landed is one leader away, not the broker: health is
        kept. Otherwise the broker nodes are asked (`cluster_answers`); if none answers,
        the edge stays unreachable until the probe has renewed the producer: one write
        that went through says nothing of the other partitions. `started` unknown: the
        produce timeout before now.
        """
        now = time.monotonic()
        if error is None:
            self.leaders.landed(None, now)
            self._seen(not self._stale)
            return
        since = now - self.produce_timeout_s if started is None else started
        if self.health.reachable and self.leaders.answered_since(since):
            log.info("broker.call_failed_leader_away", edge_id=self._edge_id, error=repr(error))
            return
        if self._judging is None or self._judging.done():
            self._judging = asyncio.get_running_loop().create_task(self._judge(since))

    async def _judge(self, since: float) -> None:
        """A call failed with nothing else landing since `since`: unreachable unless a node
        answers now (a node away stalls every acks=all write until the controller fences it)."""
        if self.health.reachable and await self.cluster_answers():
            log.info("broker.calls_stalled_cluster_answers", edge_id=self._edge_id)
            return
        if self.leaders.answered_since(since):
            return  # a call landed meanwhile
        self._stale = True
        self._seen(False)

    async def cluster_answers(self) -> bool:
        """Whether some broker node answers a metadata request within PROBE_TIMEOUT_S;
        callers at the same time share one round of asks. An answer counts as a landing."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.get_running_loop().create_task(self._ask_nodes())
        return await asyncio.shield(self._asking)

    async def _ask_nodes(self) -> bool:
        brokers = self.producer.client.cluster.brokers()
        asks = [asyncio.create_task(self._ask(b.host, b.port)) for b in brokers]
        lag = _LagWatch()
        errors: list[str] = []
        try:
            for ask in asyncio.as_completed(asks, timeout=PROBE_TIMEOUT_S):
                try:
                    await ask
                except (KafkaError, OSError) as exc:
                    errors.append(repr(exc))
                    continue
                self.leaders.landed(None, time.monotonic())
                return True
        except TimeoutError:
            errors.append(f"no answer in {PROBE_TIMEOUT_S:g} s")
        finally:
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        worst = lag.stop()
        if worst >= BUSY_LOOP_LAG_S:
            # Undecided, so not "away": the write goes on waiting, within produce_wait_s.
            log.warning(
                "broker.probe_undecided_loop_busy",
                edge_id=self._edge_id,
                loop_lag_s=round(worst, 3),
                errors=errors,
            )
            return True
        log.info("broker.no_node_answers", edge_id=self._edge_id, nodes=len(asks), errors=errors)
        return False

    async def _ask(self, host: str, port: int) -> None:
        """One metadata request to one node, on a connection of its own: the producer's
        are held behind writes waiting for a fenced follower's ack (a broker answers a
        connection's requests in order), and its client connects one node at a time, so a
        node that accepts and never answers would hold every other ask up."""
        conn = await create_conn(
            host,
            port,
            client_id=f"{self._edge_id}-probe",
            request_timeout_ms=int(PROBE_TIMEOUT_S * 1000),
            **self._security,
        )
        try:
            await conn.send(MetadataRequest(None))
        finally:
            conn.close()

    def overloaded(
        self, message: str, *, request_id: str | None = None, client_id: str | None = None
    ) -> ErrorFrame:
        """The `overloaded` answer, with when to retry: the broker is unreachable, or a write
        did not land in the edge's bounds while it answered (a leader away too long)."""
        return ErrorFrame(
            code=ErrorCode.overloaded,
            message=message,
            request_id=request_id,
            client_id=client_id,
            retry_after_ms=self.retry_after_ms,
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

    async def write_request(
        self, topic: str, request_id: str, value: bytes, headers: Headers
    ) -> RecordMetadata:
        """Write a new request to `tokenbus.requests` or its tier topic (ADR 0041), bounded.

        To a partition whose leader answers. Raises BrokerUnavailable if it did not land in
        the produce timeout while nothing else landed either (the broker is away), or in
        `produce_wait_s` (its leader stayed away); the record may still be in the
        producer's buffer then (`withdraw`).
        """
        key = key_of(request_id)
        partition, leader = self._place(topic, key)
        started = time.monotonic()
        try:
            # Buffered first (a partition whose batches do not drain holds this up too),
            # then delivered: one patience for both.
            buffering = asyncio.ensure_future(
                self.producer.send(topic, value, key=key, partition=partition, headers=headers)
            )
            delivery = await self._patiently(buffering, leader, started)
            result = await self._patiently(delivery, leader, started)
        except TimeoutError as exc:
            self.sent(exc, started)
            waited = time.monotonic() - started
            raise BrokerUnavailable(f"no answer from Kafka in {waited:.1f} s") from exc
        except KafkaError as exc:
            self.sent(exc, started)
            raise BrokerUnavailable(repr(exc)) from exc
        self.leaders.landed(leader, time.monotonic())
        self.sent(None)
        return result

    def _place(self, topic: str, key: bytes) -> tuple[int | None, int | None]:
        """The partition for a new request (None: the producer's keyed choice) and the node
        that leads it now, as far as the producer's metadata knows."""
        cluster = self.producer.client.cluster
        partitions = cluster.partitions_for_topic(topic)
        if not partitions:
            return None, None  # no metadata yet: the send fetches it
        leaders: dict[int, int | None] = {
            p: cluster.leader_for_partition(TopicPartition(topic, p)) for p in partitions
        }
        chosen = self.leaders.choose(key, leaders, time.monotonic())
        keyed = sorted(partitions)[keyed_partition(key, len(partitions))]
        if chosen is not None and chosen != keyed:
            self._metrics.requests_moved.inc()
        return chosen, leaders[keyed if chosen is None else chosen]

    async def _patiently(self, pending: asyncio.Future[R], leader: int | None, started: float) -> R:
        """`pending`'s result (a write begun at `started` to a partition `leader` leads):
        within the produce timeout, or later while other calls land or some broker node
        answers (its leader is away, or every acks=all write waits for the controller to
        fence a node that is), up to `produce_wait_s`. Raises TimeoutError past those bounds,
        `pending` cancelled (a record handed to the producer is given up, not undone)."""
        timeout = self.produce_timeout_s - (time.monotonic() - started)
        done, _ = await asyncio.wait({pending}, timeout=max(0.0, timeout))
        if not done and self.leaders.waited(leader, time.monotonic()):
            log.warning("broker.leader_avoided", edge_id=self._edge_id, node=leader)
        deadline = started + self.produce_wait_s
        while not done:
            now = time.monotonic()
            answers = self.leaders.answered_since(now - PROBE_INTERVAL_S)
            if not answers and now < deadline and self.health.reachable:
                answers = await self.cluster_answers()
            if now >= deadline or not answers or not self.health.reachable:
                pending.cancel()
                raise TimeoutError
            done, _ = await asyncio.wait({pending}, timeout=min(0.25, deadline - now))
        return pending.result()

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


class _LagWatch:
    """How late, at worst, this loop woke from short sleeps, from now until `stop`."""

    def __init__(self) -> None:
        self._worst = 0.0
        self._began = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            self._began = time.monotonic()
            await asyncio.sleep(LOOP_TICK_S)
            self._worst = max(self._worst, time.monotonic() - self._began - LOOP_TICK_S)

    def stop(self) -> float:
        self._task.cancel()
        # The sleep under way counts too: a loop held up until now never ended it.
        return max(self._worst, time.monotonic() - self._began - LOOP_TICK_S)
