"""The edge process: WebSocket chat, chat page, health, metrics; one producer, one consumer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Literal, TypeVar

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.edge.auth import Close, Guard, SocketAuth, Upgrade
from services.edge.broker_health import BrokerHealth, BrokerUnavailable
from services.edge.deadlines import Deadlines
from services.edge.lease_keeper import LeaseKeeper, LeaseLost, ensure_lease_topic
from services.edge.metrics import EdgeMetrics
from services.edge.producer import EdgeProducer
from services.edge.protocol import (
    AcceptedFrame,
    AuthFrame,
    ChatCancelFrame,
    ChatRequestFrame,
    ErrorFrame,
    ProtocolError,
    ServerFrame,
    StreamResumeFrame,
    parse_client_frame,
)
from services.edge.results import ResultReader
from services.edge.resume import ResumeClaims, ResumeRefused, check_resume, sign
from services.edge.settings import EdgeSettings
from services.edge.stalls import StallGuard
from services.edge.streams import ResultStream, ResumePoint, StreamRouter
from services.edge.sweeper import TopicSweeper
from services.edge.telemetry import EdgeTelemetry
from services.edge.topology import (
    UNKNOWN_TOPIC,
    PartitionTopology,
    ResultTopology,
    TopicTopology,
    TopologyError,
    reply_tp,
)
from shared.health import Readiness, health_routes
from shared.kafka import encode, key_of, make_admin, make_consumer, make_producer
from shared.messages import (
    CancelRecord,
    ControlRecord,
    ErrorCode,
    ErrorResult,
    ReplyTo,
    RequestRecord,
    StreamResumed,
    Tier,
)
from shared.metrics import EdgeRequestMetrics
from shared.topics import Topics

log = structlog.get_logger()

STATIC = Path(__file__).parent / "static"
_control: TypeAdapter[ControlRecord] = TypeAdapter(ControlRecord)
T = TypeVar("T")

# A failed background loop is restarted after 0.5 s, doubling up to 10 s.
RESTART_MIN_S = 0.5
RESTART_MAX_S = 10.0
PROBE_INTERVAL_S = 1.0
# WebSocket close code 1013 "try again later": the client read too slowly; it may resume.
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_TIMEOUT_S = 5.0
RESUME_TIMEOUT_S = 10.0


class Edge:
    """Everything one edge process shares across sockets."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.limits = settings.limits()
        self.edge_id = f"edge-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.metrics = EdgeMetrics()
        # Request traces and latency metrics, on the same registry as the edge's own metrics.
        self.telemetry = EdgeTelemetry(
            metrics=EdgeRequestMetrics.build(self.metrics.registry),
            results_topic=self.topics.results,
        )
        self.router = StreamRouter(on_end=self._stream_ended)
        self.resume_keys = settings.resume_keys()
        # Keys, origins, quotas (auth.py); tenant ids are keyed by the resume keys.
        self.guard = Guard(settings, self.resume_keys)
        # request_id -> partition read for it alone (per-request topic, resumed stream)
        self.followed: dict[str, TopicPartition] = {}
        self.grace: Deadlines[str] = Deadlines()
        self._wake = asyncio.Event()
        self.health = BrokerHealth(retry_after_ms=settings.edge_retry_after_ms)
        self._broker_down = asyncio.Event()  # set when `health` turns unreachable
        # Requests whose write timed out and whose cancel could not be buffered either:
        # cancelled once the broker answers again (`_probe_broker`).
        self._unwithdrawn: set[str] = set()
        self.stalls = StallGuard(settings.edge_stream_stall_s)
        self._producers: EdgeProducer | None = None
        self.reader: ResultReader | None = None
        self.topology: ResultTopology | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self.ready = False

    # -- lifecycle --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        s = self.settings
        self._producers = EdgeProducer(lambda: make_producer(s, client_id=self.edge_id))
        self._admin = make_admin(s, client_id=self.edge_id)
        consumer = make_consumer(s, group_id=None, client_id=self.edge_id)
        keeper: LeaseKeeper | None = None
        tasks: list[asyncio.Task[None]] = []
        await self._producers.start()
        await self._admin.start()
        await consumer.start()
        try:
            self.reader = ResultReader(
                consumer,
                self.router,
                TopicPartition(self.topics.control, 0),
                self._on_control,
                on_result=self._result_seen,
            )
            if s.edge_result_topology == "partition":
                keeper = LeaseKeeper(
                    s,
                    self.topics.result_leases,
                    self.edge_id,
                    lambda: self.producer,
                    s.edge_lease_ttl_s,
                    on_send=self._sent,
                )
                partition = await self._lease_partition(keeper)
                reply_to = ReplyTo(topic=self.topics.results, partition=partition)
                self.topology = PartitionTopology(reply_to, self.reader)
                await self.reader.start(reply_tp(reply_to))
                tasks.append(asyncio.create_task(self._keep_lease(keeper), name="edge-lease"))
            else:
                self.topology = TopicTopology(
                    self.topics,
                    self._admin,
                    self.reader,
                    s.edge_result_topic_retention_s,
                    self.metrics,
                )
                await self.reader.start(None)
            sweeper = TopicSweeper(
                self._admin,
                s,
                self.topics,
                self._reads_topic,
                self.metrics,
                s.edge_result_topic_orphan_after_s,
                s.edge_result_topic_sweep_interval_s,
            )
            # Each keeps its state outside the coroutine, so a failed one is restarted.
            loops: dict[str, Callable[[], Awaitable[None]]] = {
                "edge-results": self.reader.run,
                "edge-housekeeping": self._housekeeping,
                "edge-broker-probe": self._probe_broker,
                "edge-sweeper": sweeper.run,
            }
            for name, loop in loops.items():
                tasks.append(asyncio.create_task(self._supervised(name, loop), name=name))
            self.ready = True
            log.info(
                "edge.started",
                edge_id=self.edge_id,
                topology=s.edge_result_topology,
                partition=keeper.partition if keeper else None,
                port=s.edge_port,
            )
            yield
        finally:
            self.ready = False
            for task in tasks:
                task.cancel()
            # Failures were logged when they happened (`_supervised`); shut down regardless.
            await asyncio.gather(*tasks, return_exceptions=True)
            if keeper is not None:
                await keeper.release()
            await consumer.stop()
            await self._admin.close()
            await self._producers.stop()

    async def _supervised(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop for the edge's life; restart it with backoff if it fails.

        A dead loop would leave the edge accepting requests it cannot serve, and killing
        the process would close every socket: the failure is logged and the loop resumes
        from the state it keeps outside itself (positions, deadlines).
        """
        backoff = RESTART_MIN_S
        while True:
            started = time.monotonic()
            try:
                await loop()
                return
            except Exception as exc:
                if time.monotonic() - started > RESTART_MAX_S:
                    backoff = RESTART_MIN_S  # it ran fine for a while: a new failure
                log.exception("edge.task_failed", task=name, error=repr(exc), restart_in_s=backoff)
                self.metrics.task_restarts.labels(name).inc()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_MAX_S)

    @property
    def producer(self) -> AIOKafkaProducer:
        """The producer to send with now (a new one after an outage, see `producer.py`)."""
        assert self._producers is not None, "started in lifespan"
        return self._producers.current

    # -- broker health ----------------------------------------------------------------------

    async def bounded(self, call: Awaitable[T], timeout_s: float | None = None) -> T:
        """One Kafka call on a client's behalf, bounded; keeps `health` current.

        Raises BrokerUnavailable on a timeout or a retriable Kafka error (a record may still
        be in the producer's buffer and be sent once the broker is back).
        """
        timeout = self.settings.edge_produce_timeout_s if timeout_s is None else timeout_s
        try:
            result = await asyncio.wait_for(call, timeout)
        except TimeoutError as exc:
            self._sent(exc)
            raise BrokerUnavailable(f"no answer from Kafka in {timeout:.1f} s") from exc
        except KafkaError as exc:
            self._sent(exc)
            raise BrokerUnavailable(repr(exc)) from exc
        self._sent(None)
        return result

    def _sent(self, error: BaseException | None) -> None:
        """How a bounded Kafka call went (None: it succeeded).

        After a failure the edge stays unreachable until the probe has replaced the
        producer: one write that went through says nothing of the other partitions.
        """
        assert self._producers is not None
        if error is not None:
            self._producers.failed()
        self._broker_seen(error is None and not self._producers.stale)

    def overloaded(
        self, message: str, *, request_id: str | None = None, client_id: str | None = None
    ) -> ErrorFrame:
        """The `overloaded` answer; names when to retry while the broker is unreachable."""
        retry = None if self.health.reachable else self.settings.edge_retry_after_ms
        return ErrorFrame(
            code=ErrorCode.overloaded,
            message=message,
            request_id=request_id,
            client_id=client_id,
            retry_after_ms=retry,
        )

    def _broker_seen(self, ok: bool) -> None:
        now = time.monotonic()
        if ok and self.health.succeeded(now):
            log.info("broker.reachable", edge_id=self.edge_id)
            self.stalls.outage_over(self.router.request_ids(), now)
            self._wake.set()
        elif not ok and self.health.failed(now):
            log.warning("broker.unreachable", edge_id=self.edge_id)
            self._broker_down.set()
        self.metrics.broker_reachable.set(1 if self.health.reachable else 0)

    async def _probe_broker(self) -> None:
        """While the broker is unreachable, ask it every second whether requests can go."""
        timeout = self.settings.edge_produce_timeout_s
        while True:
            await self._broker_down.wait()
            while not self.health.reachable:
                await asyncio.sleep(PROBE_INTERVAL_S)
                try:
                    assert self._producers is not None
                    if self._producers.stale:
                        await self._producers.replace(timeout)
                    writable = await asyncio.wait_for(self._requests_writable(), timeout)
                except (KafkaError, TimeoutError, OSError) as exc:
                    log.debug("broker.probe_failed", error=repr(exc))
                    continue
                if writable:
                    self._broker_seen(True)
            self._broker_down.clear()
            for request_id in sorted(self._unwithdrawn):
                await self.withdraw(request_id)

    async def _requests_writable(self) -> bool:
        """Every partition of the requests topic has a leader (a restarted broker elects)."""
        assert self._admin is not None
        described = await self._admin.describe_topics([self.topics.requests])
        partitions = [p for e in described if e["error_code"] == 0 for p in e["partitions"]]
        return bool(partitions) and all(p["leader"] >= 0 for p in partitions)

    def _reads_topic(self, topic: str) -> bool:
        """The sweeper's exclusion: topics this edge reads, or will delete itself."""
        if isinstance(self.topology, TopicTopology) and topic in self.topology.deletions:
            return True
        return any(tp.topic == topic for tp in self.followed.values())

    async def _lease_partition(self, keeper: LeaseKeeper) -> int:
        s = self.settings
        assert self._admin is not None
        await ensure_lease_topic(self._admin, self.topics.result_leases, s.edge_lease_ttl_s)
        partitions = await self._partition_count(self.topics.results)
        if partitions is None:
            raise RuntimeError(f"{self.topics.results} does not exist: create the topics first")
        wanted = s.edge_result_partition
        if wanted is not None and wanted >= partitions:
            raise RuntimeError(f"edge_result_partition={wanted}, but the topic has {partitions}")
        return await keeper.acquire(partitions, wanted, timeout_s=2.5 * s.edge_lease_ttl_s)

    async def _keep_lease(self, keeper: LeaseKeeper) -> None:
        try:
            await keeper.keep()
        except LeaseLost as exc:
            # Another edge may own the partition now: serving from it would share it.
            # Only the log says so (another edge's claim won), never a missed renewal.
            log.error("lease.lost", error=str(exc), action="shutting down")
            self.ready = False
            os.kill(os.getpid(), signal.SIGTERM)

    async def _partition_count(self, topic: str) -> int | None:
        assert self._admin is not None
        described = await self._admin.describe_topics([topic])
        for entry in described:
            if entry["topic"] == topic and entry["error_code"] != UNKNOWN_TOPIC:
                return len(entry["partitions"])
        return None

    async def _housekeeping(self) -> None:
        """Cancels requests of sockets gone past their grace; deletes expired result topics."""
        assert self.topology is not None
        while True:
            now = time.monotonic()
            for request_id in self.grace.pop_due(now):
                await self._cancel_abandoned(request_id)
            if self.health.reachable:  # silence while Kafka is away is no stall
                for request_id in self.stalls.due(now):
                    await self._end_stalled(request_id)
            try:
                await self.topology.sweep(now)
            except KafkaError as exc:
                log.warning("result_topics.sweep_failed", error=repr(exc))
            due = (self.grace.next_at(), self._next_sweep(), self.stalls.next_at())
            deadlines = [d for d in due if d is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _result_seen(
        self, consumer: AIOKafkaConsumer, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]
    ) -> None:
        """Each valid result record, before it is routed: telemetry, and stream progress."""
        self.telemetry.result_record(consumer, tp, record)
        request_id = (record.key or b"").decode(errors="replace")
        if self.router.get(request_id) is not None:
            self.stalls.seen(request_id, time.monotonic())

    async def _end_stalled(self, request_id: str) -> None:
        """No record for this stream in `edge_stream_stall_s`: tell the client, free the slot."""
        stream = self.router.get(request_id)
        if stream is None:
            return
        self.metrics.stalled_streams.inc()
        log.warning("stream.stalled", request_id=request_id, stall_s=self.stalls.stall_s)
        # As the stream's next record, so the framing rules (and the end) apply as usual.
        self.router.route(
            ErrorResult(
                request_id=request_id,
                attempt=stream.attempt,
                seq=stream.next_seq,
                code=ErrorCode.internal,
                message=(
                    f"stream: no result for {self.stalls.stall_s:.0f} s (lost in a Kafka"
                    " outage?); send the request again"
                ),
            )
        )
        try:
            await self.bounded(self.send_cancel(request_id, "client"))
        except (BrokerUnavailable, KafkaError) as exc:
            log.error("cancel.produce_failed", request_id=request_id, error=repr(exc))

    def _next_sweep(self) -> float | None:
        if isinstance(self.topology, TopicTopology):
            return self.topology.deletions.next_at()
        return None

    # -- streams ----------------------------------------------------------------------------

    def _stream_ended(self, stream: ResultStream) -> None:
        """A stream's final record was shown (or swallowed while detached): let go of it."""
        self.grace.cancel(stream.request_id)
        self._let_go(stream.request_id, ended=True)

    def _let_go(self, request_id: str, *, ended: bool) -> None:
        """Stop reading what was read for this request alone.

        `ended`: the stream finished here, so a per-request topic starts its retention.
        Otherwise another edge serves it now and decides.
        """
        assert self.reader is not None
        assert self.topology is not None
        self.guard.release(request_id)
        self.stalls.forget(request_id)
        tp = self.followed.pop(request_id, None)
        self.metrics.streams_open.set(len(self.router))
        if tp is None:
            return
        self.reader.unfollow(tp)
        if ended and self.topology.followed(ReplyTo(topic=tp.topic)):
            self.topology.ended(tp.topic, time.monotonic())
            self._wake.set()

    def detach(self, owner: object) -> None:
        """A socket closed: its streams wait out the grace period for a resume."""
        now = time.monotonic()
        for request_id in self.router.detach_owner(owner):
            self.grace.set(request_id, now + self.settings.edge_disconnect_grace_s)
        self._wake.set()

    async def _cancel_abandoned(self, request_id: str) -> None:
        stream = self.router.get(request_id)
        if stream is None or not stream.detached:
            return  # ended or resumed meanwhile
        try:
            await self.bounded(self.send_cancel(request_id, "disconnect"))
        except (BrokerUnavailable, KafkaError) as exc:
            # Still in the producer's buffer if the broker is away: it goes when it is back.
            # Else the request runs to its end: wasted work, not a wrong answer.
            log.error("cancel.produce_failed", request_id=request_id, error=repr(exc))
        self.metrics.disconnect_cancels.inc()
        log.info("request.cancelled_after_disconnect", request_id=request_id)
        self.router.close(request_id)
        self._let_go(request_id, ended=True)

    async def send_cancel(
        self, request_id: str, reason: Literal["client", "disconnect", "deadline"]
    ) -> None:
        assert self.producer is not None
        await self.producer.send_and_wait(
            self.topics.control,
            encode(CancelRecord(request_id=request_id, reason=reason)),
            key=key_of(request_id),
        )

    async def withdraw(self, request_id: str) -> None:
        """Cancel a request whose write timed out: it may still go out when the broker is back.

        The cancel is queued behind it in the producer and not waited for, so the worker
        (which remembers early cancels) drops the request instead of running it for a client
        that was told it failed.
        """
        assert self.producer is not None
        record = encode(CancelRecord(request_id=request_id, reason="client"))
        try:
            # `send` returns once the record is buffered; the delivery is not waited for.
            delivery = await asyncio.wait_for(
                self.producer.send(self.topics.control, record, key=key_of(request_id)),
                self.settings.edge_produce_timeout_s,
            )
        except (KafkaError, TimeoutError) as exc:
            log.warning("request.withdraw_deferred", request_id=request_id, error=repr(exc))
            self._unwithdrawn.add(request_id)
            return
        self._unwithdrawn.discard(request_id)
        delivery.add_done_callback(_log_withdraw_failure(request_id))

    def _on_control(self, value: bytes) -> None:
        try:
            record = _control.validate_json(value)
        except ValidationError:
            return  # kinds this edge does not know are for someone else
        if isinstance(record, StreamResumed) and record.edge_id != self.edge_id:
            stream = self.router.get(record.request_id)
            if stream is not None and stream.detached:
                # Picked up on another edge: no cancel from here; that edge owns it now.
                self.grace.cancel(record.request_id)
                self.router.close(record.request_id)
                self._let_go(record.request_id, ended=False)

    # -- requests ---------------------------------------------------------------------------

    async def open_request(self, request_id: str) -> tuple[ReplyTo, int]:
        """Prepare a new request's result stream; BrokerUnavailable while Kafka is away.

        Refused before anything is written while the broker is unreachable: a request
        buffered in the producer would be sent later, for a client told it failed.
        """
        assert self.topology is not None
        if not self.health.reachable:
            raise BrokerUnavailable("the broker is unreachable")
        reply_to, offset = await self.bounded(self.topology.open(request_id))
        if self.topology.followed(reply_to):
            self.followed[request_id] = reply_tp(reply_to)
        return reply_to, offset

    async def resume(
        self, claims: ResumeClaims, frame: StreamResumeFrame, owner: ChatSocket
    ) -> None:
        """Serve a checked resume: replay from the token's offset, then go on live."""
        assert self.reader is not None
        assert self.producer is not None
        assert self.topology is not None
        tp = TopicPartition(claims.topic, claims.partition or 0)
        begin, end = await self._offsets(tp)
        if claims.offset < begin:
            raise ResumeRefused(
                ErrorCode.not_found,
                "stream.resume: the stream's first records were deleted; it cannot be recovered",
            )
        if claims.offset > end:
            raise ResumeRefused(ErrorCode.not_found, "stream.resume: no such stream here")
        rid = claims.request_id
        # Tell the edge that had it (if alive) before reading, so it does not cancel it.
        await self.producer.send_and_wait(
            self.topics.control,
            encode(StreamResumed(request_id=rid, edge_id=self.edge_id)),
            key=key_of(rid),
        )
        self.grace.cancel(rid)
        previous = self.followed.pop(rid, None)
        self.topology.resumed(claims.topic)
        point = ResumePoint(frame.attempt, frame.after_seq)
        stream = self.router.resume(rid, owner.send, owner, point)
        self.followed[rid] = tp
        self.reader.follow(tp, claims.offset, end, lambda: self._caught_up(stream))
        if previous is not None:
            self.reader.unfollow(previous)
        self.metrics.streams_open.set(len(self.router))

    def _caught_up(self, stream: ResultStream) -> None:
        if self.router.get(stream.request_id) is not stream:
            return  # resumed again, or closed, meanwhile: that one decides
        ok = self.router.caught_up(stream.request_id)
        self.metrics.resumes.labels("resumed" if ok else "ahead_of_log").inc()
        if not ok:
            self._let_go(stream.request_id, ended=False)

    async def _offsets(self, tp: TopicPartition) -> tuple[int, int]:
        """First and end offset of `tp`; ResumeRefused(not_found) if it does not exist."""
        assert self.reader is not None
        count = await self._partition_count(tp.topic)
        if count is None or tp.partition >= count:
            raise ResumeRefused(
                ErrorCode.not_found,
                "stream.resume: the stream's records are gone (retention); it cannot be recovered",
            )
        return await self.reader.offsets(tp)

    # -- HTTP -------------------------------------------------------------------------------

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): result partition leased and read, broker reachable."""
        reason = "ok" if self.ready and self.health.reachable else "kafka unreachable"
        return Readiness(ready=reason == "ok", reason=reason if self.ready else "starting")

    async def metrics_page(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def chat(self, ws: WebSocket) -> None:
        upgrade = self.guard.upgrade(ws.headers.get("origin"), ws.headers.getlist("authorization"))
        if (refused := upgrade.refused) is not None:
            # An HTTP answer instead of a socket: no frame is ever read or sent.
            log.info("socket.refused", reason=refused.reason, origin=ws.headers.get("origin"))
            await ws.send_denial_response(PlainTextResponse(refused.text, refused.status))
            return
        await ChatSocket(self, ws, upgrade).serve()


class ChatSocket:
    """One client connection: a reader of frames and a single writer of frames."""

    def __init__(self, edge: Edge, ws: WebSocket, upgrade: Upgrade) -> None:
        self.edge = edge
        self.ws = ws
        # Bounded: a client that stops reading must not grow the edge's memory.
        self.outbox: asyncio.Queue[ServerFrame] = asyncio.Queue(edge.settings.edge_outbox_frames)
        self._too_slow = asyncio.Event()
        # Who the socket speaks for; nothing but `auth` is read before that is known.
        self.auth = SocketAuth(edge.guard, upgrade, time.monotonic())

    @property
    def tenant(self) -> str:
        return self.auth.tenant

    def send(self, frame: ServerFrame) -> None:
        """Queue a frame for the writer. Never waits: the edge's one result reader calls it."""
        if self._too_slow.is_set():
            return  # its streams are detached; the client resumes them
        try:
            self.outbox.put_nowait(frame)
        except asyncio.QueueFull:
            self._fall_behind()

    def _fall_behind(self) -> None:
        """The client reads slower than its streams arrive: let go of it, keep its streams.

        They wait out the disconnect grace for a resume, as after a dropped socket; the
        socket is closed with 1013 (try again later).
        """
        self._too_slow.set()
        self.edge.detach(self)
        self.edge.metrics.slow_client_closes.inc()
        log.warning("socket.too_slow", queued=self.outbox.qsize(), tenant=self.tenant)

    async def serve(self) -> None:
        try:
            await self.ws.accept()  # in the `try`: the socket's places are given back
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._write())
                reader = tg.create_task(self._read(tg))
                too_slow = tg.create_task(self._too_slow.wait())
                await asyncio.wait({reader, too_slow}, return_when=asyncio.FIRST_COMPLETED)
                for task in (writer, reader, too_slow):
                    task.cancel()
            if self._too_slow.is_set():
                await self._close_too_slow()
            elif (close := reader.result()) is not None:
                await self.ws.close(close.code, close.reason)
        except* (WebSocketDisconnect, ConnectionError):
            pass
        finally:
            # Not a cancel: the client may resume, here or on another edge, within the grace.
            self.edge.detach(self)
            self.auth.end()

    async def _close_too_slow(self) -> None:
        # The close frame queues behind what the client has not read: bounded, then given up
        # (the server's close timeout drops the connection).
        try:
            await asyncio.wait_for(
                self.ws.close(CLOSE_TRY_AGAIN_LATER, "reading too slowly; resume the streams"),
                CLOSE_TIMEOUT_S,
            )
        except (TimeoutError, RuntimeError) as exc:
            log.info("socket.close_unsent", error=repr(exc))

    async def _write(self) -> None:
        while True:
            frame = await self.outbox.get()
            await self.ws.send_text(frame.model_dump_json())
            self.edge.telemetry.frame_written(frame)

    async def _read(self, tg: asyncio.TaskGroup) -> Close | None:
        edge = self.edge
        if refused := self.auth.start():
            return refused
        while True:
            message = await self._receive()
            if message is None:
                return self.auth.timed_out()
            if message["type"] == "websocket.disconnect":
                return None
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            if not self.auth.authenticated:
                if refused := self._before_key(data):
                    return refused
                continue
            try:
                frame = parse_client_frame(data, edge.limits, edge.settings.edge_max_frame_bytes)
            except ProtocolError as exc:
                self.send(
                    ErrorFrame(
                        code=ErrorCode.invalid_request, message=exc.message, client_id=exc.client_id
                    )
                )
                continue
            if isinstance(frame, AuthFrame):
                if refused_auth := self.auth.again(frame):
                    self.send(refused_auth)
            elif isinstance(frame, ChatRequestFrame):
                tg.create_task(self._submit(frame))
            elif isinstance(frame, ChatCancelFrame):
                tg.create_task(self._cancel(frame.request_id))
            elif isinstance(frame, StreamResumeFrame):
                tg.create_task(self._resume(frame))

    # -- auth hooks: the decisions are SocketAuth's (auth.py) -------------------------------

    async def _receive(self) -> Message | None:
        """The next message; None if the socket is still without a key at its deadline."""
        if self.auth.authenticated:
            return await self.ws.receive()
        try:
            async with asyncio.timeout_at(self.auth.deadline):
                return await self.ws.receive()
        except TimeoutError:
            return None

    def _before_key(self, data: str | bytes) -> Close | None:
        edge = self.edge
        try:
            frame = parse_client_frame(data, edge.limits, edge.settings.edge_max_frame_bytes)
        except ProtocolError as exc:
            reply, close = self.auth.before_key(exc)
        else:
            reply, close = self.auth.before_key(frame)
        if reply is not None:
            self.send(reply)
        return close

    async def _submit(self, frame: ChatRequestFrame) -> None:
        edge = self.edge
        assert edge.producer is not None
        request_id = uuid.uuid4().hex
        if refused := self.auth.admit(frame, request_id):
            self.send(refused)  # before anything of it reaches Kafka
            return
        edge.telemetry.begin(
            request_id,
            tier=(frame.priority or Tier.interactive).value,
            max_tokens=frame.max_tokens,
            parent=self.ws.headers,  # a client's own `traceparent` on the upgrade request
        )
        try:
            reply_to, offset = await edge.open_request(request_id)
        except (TopologyError, KafkaError, BrokerUnavailable) as exc:
            edge.telemetry.end(request_id, outcome="reply_to_failed")
            edge.guard.release(request_id)
            log.error("request.reply_to_failed", request_id=request_id, error=repr(exc))
            self.send(
                edge.overloaded(
                    "could not prepare the result stream, try again", client_id=frame.client_id
                )
            )
            return
        fields = frame.model_dump(exclude={"type"})
        fields.update(request_id=request_id, tenant=self.tenant, reply_to=reply_to.model_dump())
        record = RequestRecord.model_validate(fields, context={"limits": edge.limits})
        claims = ResumeClaims(
            tenant=self.tenant,
            request_id=request_id,
            topic=reply_to.topic,
            partition=reply_to.partition,
            offset=offset,
            expires_at=time.time() + edge.settings.edge_resume_ttl_s,
        )
        edge.router.open(request_id, self.send, owner=self)
        edge.metrics.streams_open.set(len(edge.router))
        try:
            await edge.bounded(edge.telemetry.publish(edge.producer, edge.topics.requests, record))
        except (KafkaError, BrokerUnavailable) as exc:
            log.error("request.produce_failed", request_id=request_id, error=repr(exc))
            edge.telemetry.end(request_id, outcome="produce_failed")
            edge.router.close(request_id)
            edge._let_go(request_id, ended=True)
            self.send(
                edge.overloaded("could not queue the request, try again", client_id=frame.client_id)
            )
            if isinstance(exc, BrokerUnavailable):  # after the answer: it may take a while
                await edge.withdraw(request_id)
            return
        edge.router.release(
            request_id,
            AcceptedFrame(
                request_id=request_id,
                client_id=frame.client_id,
                resume_token=sign(claims, edge.resume_keys),
                tier=frame.priority or Tier.interactive,
            ),
        )

    async def _cancel(self, request_id: str) -> None:
        edge = self.edge
        stream = edge.router.get(request_id)
        if stream is None or stream.owner is not self:
            self.send(
                ErrorFrame(
                    code=ErrorCode.not_found,
                    message="chat.cancel: no such request in flight on this socket",
                    request_id=request_id,
                )
            )
            return
        try:
            await edge.bounded(edge.send_cancel(request_id, "client"))
        except (KafkaError, BrokerUnavailable) as exc:
            # Buffered if the broker is away; the client is told, so it may cancel again.
            log.error("cancel.produce_failed", request_id=request_id, error=repr(exc))
            self.send(
                edge.overloaded("chat.cancel: not sent yet, try again", request_id=request_id)
            )

    async def _resume(self, frame: StreamResumeFrame) -> None:
        edge = self.edge
        request_id: str | None = None
        try:
            claims = check_resume(
                frame.resume_token,
                edge.resume_keys,
                tenant=self.auth.tenant_for_token(frame.resume_token),
                results_topic=edge.topics.results,
                now=time.time(),
            )
            request_id = claims.request_id
            # A few Kafka round trips; none changes state before the last one.
            await edge.bounded(edge.resume(claims, frame, self), RESUME_TIMEOUT_S)
        except ResumeRefused as exc:
            edge.metrics.resumes.labels(exc.code.value).inc()
            log.info("stream.resume_refused", request_id=request_id, code=exc.code.value)
            self.send(ErrorFrame(code=exc.code, message=exc.message, request_id=request_id))
        except (KafkaError, BrokerUnavailable) as exc:
            log.error("stream.resume_failed", request_id=request_id, error=repr(exc))
            self.send(
                edge.overloaded(
                    "stream.resume: could not read the stream now, try again",
                    request_id=request_id,
                )
            )


def _log_withdraw_failure(request_id: str) -> Callable[[asyncio.Future[object]], None]:
    def done(delivery: asyncio.Future[object]) -> None:
        if not delivery.cancelled() and delivery.exception() is not None:
            log.error(
                "request.withdraw_failed", request_id=request_id, error=repr(delivery.exception())
            )

    return done


def build_app(settings: EdgeSettings) -> Starlette:
    edge = Edge(settings)
    return Starlette(
        routes=[
            Route("/", edge.index),
            *health_routes(edge.readiness),
            Route("/metrics", edge.metrics_page),
            WebSocketRoute("/v1/chat", edge.chat),
        ],
        lifespan=edge.lifespan,
    )
