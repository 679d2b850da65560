"""The edge's request path, for any client: open, cancel and resume streams, route results.

The one seam between a client protocol (the WebSocket chat in `chat_socket.py`, the
OpenAI API in `openai/`) and Kafka. A client handler translates its protocol into a
`ChatRequest` and calls

    await gateway.submit(request, principal=who, client=me, parent=headers)

which checks the model, gives the request its id, takes the tenant's quota (`auth.py`)
and opens its stream. The client receives the stream's frames on `client.send(frame,
stream)`: `chat.accepted` first (or one `ErrorFrame` if the request was refused or could
not be queued), then deltas, resets, and one final `chat.done` / `chat.error`. It reports
each frame it wrote with `written`, cancels with `cancel_stream`, resumes with
`resume_stream`, and calls `detach` when it goes away (its streams then wait out the
disconnect grace for a resume, and are cancelled after).

Each request is one `ResultStream` in the router (`streams.py`): its framing, its client,
the partition read for it alone, its trace, its stall and grace clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Literal

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import TypeAdapter, ValidationError

from services.edge.auth import Guard
from services.edge.broker_health import BrokerUnavailable
from services.edge.broker_link import BrokerLink
from services.edge.capabilities import unhonoured
from services.edge.keys import Principal
from services.edge.metrics import EdgeMetrics
from services.edge.models import ModelDirectory
from services.edge.protocol import AcceptedFrame, ErrorFrame, ServerFrame, StreamResumeFrame
from services.edge.replay import Replayed, ReplayRefused, Replays
from services.edge.results import ResultReader
from services.edge.resume import (
    ResumeClaims,
    ResumeKeys,
    ResumeRefused,
    check_resume,
    sign,
    token_kid,
)
from services.edge.settings import EdgeSettings
from services.edge.stalls import StallGuard
from services.edge.streams import Client, ResultStream, ResumePoint, StreamRouter
from services.edge.telemetry import EdgeTelemetry, InFlight
from services.edge.topology import ResultTopology, TopicTopology, TopologyError, reply_tp
from shared.context_limits import max_tokens_over_context
from shared.kafka import encode
from shared.messages import (
    ChatRequest,
    ControlRecord,
    ErrorCode,
    ErrorResult,
    QueuedRequest,
    ReplyTo,
    RequestRecord,
    ResultRecord,
    StreamResumed,
    Tier,
    over_budget,
)
from shared.records import read
from shared.topics import Topics

log = structlog.get_logger()

_control: TypeAdapter[ControlRecord] = TypeAdapter(ControlRecord)

RESUME_TIMEOUT_S = 10.0
# What a draining edge answers a new request or resume (`overloaded`, with the retry hint).
RESTARTING = "the edge is restarting: send it to another edge"


def request_record(
    request: ChatRequest,
    *,
    request_id: str,
    tenant: str,
    reply_to: ReplyTo,
    plan: str | None = None,
) -> RequestRecord:
    """The request record of a validated request, built without validating it again;
    `plan`: its key's (`RequestRecord.plan`)."""
    fields = {name: getattr(request, name) for name in ChatRequest.model_fields}
    record = RequestRecord.model_construct(
        **fields,
        request_id=request_id,
        tenant=tenant,
        reply_to=reply_to,
        created_at=time.time(),
        plan=plan,
    )
    record.carry_estimate(request)
    return record


# Why a stream ends (`Gateway.end`): its final record was shown (or swallowed while
# detached); its request could not be queued; its client stayed away past the grace;
# it was resumed on another edge; or its resume claimed more than the log holds.
Ending = Literal["finished", "not_queued", "abandoned", "moved", "refused"]
# After a detached stream's cancel, how long the edge waits for its final (the usage its
# tenant's charge is settled with) before it lets the stream go without it.
ABANDONED_SETTLE_S = 10.0


class Gateway:
    """Every stream of this edge, and the request path that opens, routes and ends them.

    Caller: client handlers (`submit`, `cancel_stream`, `resume_stream`, `detach`,
    `written`); the result reader (`on_control`, `on_results`); the app (`housekeeping`).
    Affects: the router's streams, what the reader follows, the topology's retention.
    """

    def __init__(
        self,
        settings: EdgeSettings,
        topics: Topics,
        edge_id: str,
        *,
        link: BrokerLink,
        topology: ResultTopology,
        reader: ResultReader,
        guard: Guard,
        telemetry: EdgeTelemetry,
        metrics: EdgeMetrics,
        resume_keys: ResumeKeys,
        models: ModelDirectory,
        replays: Replays,
    ) -> None:
        self.settings = settings
        self.replays = replays  # resumes read their streams' past with readers of their own
        self.models = models  # the models live workers serve: a request naming another is refused
        self.topics = topics
        self.edge_id = edge_id
        self.link = link
        self.topology = topology
        self.reader = reader
        self.router = StreamRouter(on_end=lambda stream: self.end(stream, "finished"))
        self.guard = guard
        self.telemetry = telemetry
        self.metrics = metrics
        self.resume_keys = resume_keys
        self.limits = settings.limits()
        self.token_budget = settings.largest_token_budget  # the most one request may ask
        self.stalls = StallGuard(settings.edge_stream_stall_s)
        self.wake = asyncio.Event()  # housekeeping has an earlier deadline to look at
        self.draining = False  # SIGTERM: no new request or resume is taken (drain.py)
        link.on_reachable.append(self.on_reachable)

    # -- the client seam ------------------------------------------------------------------

    async def submit(
        self,
        request: ChatRequest,
        *,
        principal: Principal,
        client: Client,
        parent: Mapping[str, str] | None = None,
    ) -> ResultStream | None:
        """The one way in for a request, from every client: its model, its id, its quota,
        then its stream (`open_stream`). A refusal is one ErrorFrame to `client`, sent
        before anything of the request reaches Kafka.

        `request` was validated under `self.limits` (as `parse_client_frame` and the OpenAI
        translation do). `parent`: headers that may carry the caller's `traceparent`.
        """
        request_id = uuid.uuid4().hex
        if request.batch_line is not None:  # only a batch's runner names its line
            client.send(
                ErrorFrame(
                    code=ErrorCode.invalid_request,
                    message="batch_line: set by the edge that runs a batch, not by a client",
                    client_id=request.client_id,
                )
            )
            return None
        if refused := self._refused(request, request_id, parent):
            client.send(refused)
            return None
        if refused := self.guard.admit(principal, request, request_id):
            client.send(refused)
            return None
        tenant = self.guard.tenant_id(principal.tenant)
        return await self.open_stream(
            request,
            request_id=request_id,
            tenant=tenant,
            client=client,
            parent=parent,
            plan=principal.plan,
        )

    async def submit_line(
        self, request: ChatRequest, *, tenant: str, plan: str | None, client: Client
    ) -> ResultStream | None:
        """A batch's line (batch_runner.py), for the batch's `tenant` (its name): as `submit`,
        but not charged to the tenant's interactive quotas (a batch is checked as a whole
        when it is created)."""
        request_id = uuid.uuid4().hex
        if refused := self._refused(request, request_id, None):
            client.send(refused)
            return None
        return await self.open_stream(
            request,
            request_id=request_id,
            tenant=self.guard.tenant_id(tenant),
            client=client,
            plan=plan,
        )

    def _refused(
        self, request: ChatRequest, request_id: str, parent: Mapping[str, str] | None
    ) -> ErrorFrame | None:
        """Why the request is refused before anything of it reaches Kafka, whoever asks."""
        if self.draining:
            return self.link.overloaded(RESTARTING, client_id=request.client_id)
        if unknown := self.models.unknown(request, time.time()):
            _, message = unknown
            return ErrorFrame(
                code=ErrorCode.invalid_request, message=message, client_id=request.client_id
            )
        # Invalid before it is charged: a request no batch could hold or no worker run is
        # the client's error (`invalid_request`, naming the limit), never a quota's, which
        # would tell it to retry what can never succeed.
        if invalid := self._invalid(request):
            outcome, message = invalid
            flight = self.telemetry.begin(
                request_id,
                tier=(request.priority or Tier.interactive).value,
                max_tokens=request.max_tokens,
                parent=parent,
            )
            self.telemetry.end(flight, outcome=outcome)
            return ErrorFrame(
                code=ErrorCode.invalid_request, message=message, client_id=request.client_id
            )
        return None

    def _invalid(self, request: ChatRequest) -> tuple[str, str] | None:
        """(outcome, message) if no batch could ever hold the request or no worker run it."""
        prompt_tokens = request.prompt_token_bound()  # never below the real count
        if refusal := over_budget(prompt_tokens, request.effective_max_tokens, self.token_budget):
            return "over_budget", refusal
        # No live worker of its model honours a sampling field it sets.
        capabilities = self.models.capabilities(request.model, time.time())
        if refusal := unhonoured(request, capabilities):
            return "not_honoured", refusal
        # A max_tokens above its model's context, as vLLM's server refuses it.
        context = self.models.context_length(request.model, time.time())
        if refusal := max_tokens_over_context(request.max_tokens, context):
            return "over_context", refusal
        return None

    async def open_stream(
        self,
        request: ChatRequest,
        *,
        request_id: str,
        tenant: str,
        client: Client,
        parent: Mapping[str, str] | None = None,
        plan: str | None = None,
    ) -> ResultStream | None:
        """Queue a request `submit` admitted, and open its stream to `client`.

        It is not validated again.

        The client is sent `chat.accepted` and then the stream's frames, or one `overloaded`
        ErrorFrame (None returned) if the request could not be queued. `parent`: headers
        that may carry the caller's `traceparent`; `plan`: its key's plan, stamped on the
        record (routes' rules match it: shared/cascades.py).
        """
        tier = request.priority or Tier.interactive
        flight = self.telemetry.begin(
            request_id,
            tier=tier.value,
            max_tokens=request.max_tokens,
            parent=parent,
            batch=request.batch_line,
        )
        prompt_tokens = request.prompt_token_bound()  # never below the real count
        try:
            reply_to, offset = await self._reply_to(request_id)
        except (TopologyError, KafkaError, BrokerUnavailable) as exc:
            self.telemetry.end(flight, outcome="reply_to_failed")
            self.guard.release(request_id)
            log.error("request.reply_to_failed", request_id=request_id, error=repr(exc))
            client.send(
                self.link.overloaded(
                    "could not prepare the result stream, try again", client_id=request.client_id
                )
            )
            return None
        record = request_record(
            request, request_id=request_id, tenant=tenant, reply_to=reply_to, plan=plan
        )
        followed = reply_tp(reply_to) if self.topology.followed(reply_to) else None
        names_variant = request.variant is not None or self.settings.edge_name_variants
        stream = self.router.open(
            request_id, client, followed=followed, flight=flight, names_variant=names_variant
        )
        self.metrics.streams_open.set(len(self.router))
        if not await self._produce(record, tier, prompt_tokens, flight):
            self.end(stream, "not_queued")
            client.send(
                self.link.overloaded(
                    "could not queue the request, try again", client_id=request.client_id
                )
            )
            # After the answer, as it may take a while: the write may still go out.
            await self.link.withdraw(request_id)
            return None
        claims = ResumeClaims(
            tenant=tenant,
            request_id=request_id,
            topic=reply_to.topic,
            partition=reply_to.partition,
            offset=offset,
            expires_at=time.time() + self.settings.edge_resume_ttl_s,
        )
        accepted = AcceptedFrame(
            request_id=request_id,
            client_id=request.client_id,
            resume_token=sign(claims, self.resume_keys),
            tier=tier,
        )
        self.router.release(request_id, accepted)
        return stream

    async def cancel_stream(self, request_id: str, client: Client) -> None:
        """The client cancels one of its streams; answered with an ErrorFrame if it cannot.

        A stream already cancelled is a no-op: one cancel record per stream, however many
        frames ask for it.
        """
        stream = self.router.get(request_id)
        if stream is None or stream.client is not client:
            client.send(
                ErrorFrame(
                    code=ErrorCode.not_found,
                    message="chat.cancel: no such request in flight on this socket",
                    request_id=request_id,
                )
            )
            return
        if stream.cancelled:
            return
        stream.cancelled = True
        try:
            await self.link.bounded(self.link.send_cancel(request_id, "client"))
        except (KafkaError, BrokerUnavailable) as exc:
            # Buffered if the broker is away; the client is told, so it may cancel again.
            stream.cancelled = False
            log.error("cancel.produce_failed", request_id=request_id, error=repr(exc))
            client.send(
                self.link.overloaded("chat.cancel: not sent yet, try again", request_id=request_id)
            )

    async def resume_stream(
        self, frame: StreamResumeFrame, *, principal: Principal, client: Client
    ) -> None:
        """Serve a resume: replay from the token's offset, then go on live; refusals are
        answered with an ErrorFrame.

        The client handler charged the resume to the tenant's request rate; its replay holds
        one of the tenant's replay places (per partition) while it reads and is charged a
        request per 10,000 records it read (`Guard.start_replay`, `end_replay`); a stream resumed
        here holds one of the tenant's concurrency slots (`Guard.hold`) until it ends, on
        whichever edge it was opened. A resume of a stream this client already reads is a
        no-op.
        """
        request_id: str | None = None
        began = time.monotonic()
        tenant = self.guard.tenant_id(principal.tenant, token_kid(frame.resume_token))
        try:
            claims = check_resume(
                frame.resume_token,
                self.resume_keys,
                tenant=tenant,
                results_topic=self.topics.results,
                now=time.time(),
            )
            request_id = claims.request_id
            if self.draining:
                client.send(self.link.overloaded(RESTARTING, request_id=request_id))
                return
            previous = self.router.get(request_id)
            if previous is not None and previous.client is client:
                return  # already attached to this client: nothing to replay
            partition = f"{claims.topic}/{claims.partition or 0}"
            if refused := self.guard.start_replay(principal, partition):
                client.send(refused.model_copy(update={"request_id": request_id}))
                return
            scanned = 0
            try:
                if refused := self.guard.hold(principal, request_id):
                    client.send(refused.model_copy(update={"request_id": request_id}))
                    return
                try:
                    scanned = await self._resume(claims, frame, client)
                except BaseException as exc:
                    if isinstance(exc, ReplayRefused):
                        scanned = exc.scanned
                    if self.router.get(request_id) is None:
                        self.guard.release(request_id)  # nothing of it is kept here
                    raise
            finally:
                # The replay's place back, and what it read charged (issue 37, N8).
                self.guard.end_replay(principal, partition, scanned)
            log.info("stream.resumed", request_id=request_id, took_s=_since(began))
        except (ResumeRefused, ReplayRefused) as exc:
            self.metrics.resumes.labels(exc.code.value).inc()
            log.info(
                "stream.resume_refused",
                request_id=request_id,
                code=exc.code.value,
                took_s=_since(began),
            )
            client.send(ErrorFrame(code=exc.code, message=exc.message, request_id=request_id))
        except (KafkaError, BrokerUnavailable) as exc:
            log.error(
                "stream.resume_failed", request_id=request_id, error=repr(exc), took_s=_since(began)
            )
            client.send(
                self.link.overloaded(
                    "stream.resume: could not read the stream now, try again",
                    request_id=request_id,
                )
            )

    def attached(self) -> list[Client]:
        """The clients streams are delivered to now (each once)."""
        clients: dict[int, Client] = {}
        for stream in self.router:
            if stream.client is not None:
                clients.setdefault(id(stream.client), stream.client)
        return list(clients.values())

    def detach(self, client: Client) -> None:
        """A client went away: its streams wait out the grace period for a resume."""
        until = time.monotonic() + self.settings.edge_disconnect_grace_s
        for stream in self.router.detach(client):
            stream.grace_until = until
        self.wake.set()

    def written(self, frame: ServerFrame, stream: ResultStream | None) -> None:
        """A client wrote a frame of `stream` out (latency and traces are measured here)."""
        if stream is not None and stream.flight is not None:
            self.telemetry.frame_written(stream.flight, frame)

    # -- requests -------------------------------------------------------------------------

    async def _reply_to(self, request_id: str) -> tuple[ReplyTo, int]:
        """Prepare a new request's result stream; BrokerUnavailable while Kafka is away.

        Refused before anything is written while the broker is unreachable: a request
        buffered in the producer would be sent later, for a client told it failed.
        """
        if not self.link.health.reachable:
            raise BrokerUnavailable("the broker is unreachable")
        if (known := self.topology.known(request_id)) is not None:
            return known  # the edge's own partition: no Kafka call to bound (nor its turns)
        return await self.link.bounded(self.topology.open(request_id))

    async def _produce(
        self, record: RequestRecord, tier: Tier, prompt_tokens: int, flight: InFlight
    ) -> bool:
        """Write the request, with its trace context; False if it failed.

        Straight to its tier topic, as ingest would forward it, unless the response cache
        may answer it: ingest holds the cache, so a cacheable request goes through
        `tokenbus.requests` (ADR 0041). Nothing else of ingest's applies to an edge's
        request: it is validated here, its id is new, its `reply_to` is this edge's own.
        """
        queued: QueuedRequest | None = None
        if self.settings.edge_direct_to_tier and not record.cacheable:
            queued = QueuedRequest.from_record(record, tier=tier, prompt_tokens=prompt_tokens)
            topic, value = self.topics.tier(tier), encode(queued)
        else:
            topic, value = self.topics.requests, encode(record)
        sending = self.telemetry.sending(flight, topic, record, queued)
        try:
            await self.link.write_request(topic, record.request_id, value, sending.headers)
        except (KafkaError, BrokerUnavailable) as exc:
            log.error("request.produce_failed", request_id=record.request_id, error=repr(exc))
            self.telemetry.sent(flight, sending, exc)
            return False
        self.telemetry.sent(flight, sending, None)
        return True

    async def _resume(self, claims: ResumeClaims, frame: StreamResumeFrame, client: Client) -> int:
        """Replay the stream with a reader of its own (`replay.py`), then attach it live;
        the records the replay read.

        The shared reader is never rewound: the replay reads up to where that one stands,
        and the stream is attached to it in the same turn (`attach`).
        """
        tp = TopicPartition(claims.topic, claims.partition or 0)
        begin, end = await self.link.bounded(self._offsets(tp), RESUME_TIMEOUT_S)
        if claims.offset < begin:
            raise ResumeRefused(
                ErrorCode.not_found,
                "stream.resume: the stream's first records were deleted; it cannot be recovered",
            )
        if claims.offset > end:
            raise ResumeRefused(ErrorCode.not_found, "stream.resume: no such stream here")
        rid = claims.request_id
        # Tell the edge that had it (if alive) before reading, so it does not cancel it.
        await self.link.bounded(
            self.link.send_control(
                rid, encode(StreamResumed(request_id=rid, edge_id=self.edge_id))
            ),
            RESUME_TIMEOUT_S,
        )
        point = ResumePoint(frame.attempt, frame.after_seq)

        def attach(replayed: Replayed) -> None:
            # No await here: the shared reader's next records of `tp` go to this stream.
            self.metrics.replayed.inc(replayed.scanned)
            previous = self.router.get(rid)  # now: it may have ended during the replay
            self.topology.resumed(claims.topic)
            # A stream resumed on the edge that had it keeps its trace.
            flight = previous.flight if previous is not None else None
            names_variant = (
                previous.names_variant if previous is not None else self.settings.edge_name_variants
            )
            stream = self.router.resume(
                rid, client, point, followed=tp, flight=flight, names_variant=names_variant
            )
            for result in replayed.records:
                self.router.route(result)
            self.reader.join(tp, replayed.position)
            if previous is not None and previous.followed is not None:
                self.reader.unfollow(previous.followed)
            self.metrics.streams_open.set(len(self.router))
            self._caught_up(stream)

        replayed = await self.replays.read(
            tp,
            rid,
            start=claims.offset,
            end=end,
            live=lambda: self.reader.position(tp),
            attach=attach,
        )
        return replayed.scanned

    def _caught_up(self, stream: ResultStream) -> None:
        ok = self.router.caught_up(stream.request_id)
        self.metrics.resumes.labels("resumed" if ok else "ahead_of_log").inc()
        if not ok:
            self.end(stream, "refused")

    async def _offsets(self, tp: TopicPartition) -> tuple[int, int]:
        """First and end offset of `tp`; ResumeRefused(not_found) if it does not exist."""
        count = await self.link.partition_count(tp.topic)
        if count is None or tp.partition >= count:
            raise ResumeRefused(
                ErrorCode.not_found,
                "stream.resume: the stream's records are gone (retention); it cannot be recovered",
            )
        return await self.reader.offsets(tp)

    # -- what the reader hands over -------------------------------------------------------

    def wants(self, key: bytes | None) -> bool:
        """A result record is for a stream of this edge's router (keys are request ids)."""
        return key is not None and self.router.get(key.decode(errors="replace")) is not None

    def on_results(
        self, results: Sequence[tuple[ConsumerRecord[bytes, bytes], ResultRecord]]
    ) -> None:
        """Result records, in order: each stream's progress and trace, then its frames."""
        now = time.monotonic()
        self.metrics.results_read.inc(len(results))
        for record, result in results:
            stream = self.router.get(result.request_id)
            if stream is not None:
                self.stalls.seen(stream, now)
                if stream.flight is not None:
                    self.telemetry.result_record(stream.flight, record)
            self.router.route(result)

    def on_fetched(
        self,
        consumer: AIOKafkaConsumer,
        fetched: Mapping[TopicPartition, Sequence[ConsumerRecord[bytes, bytes]]],
    ) -> None:
        self.telemetry.fetched(consumer, fetched)

    def on_control(self, value: bytes) -> None:
        try:
            record = read(_control, value)
        except ValidationError:
            return  # kinds this edge does not know are for someone else
        if isinstance(record, StreamResumed) and record.edge_id != self.edge_id:
            stream = self.router.get(record.request_id)
            if stream is not None and stream.detached:
                # Picked up on another edge: no cancel from here; that edge owns it now.
                self.end(stream, "moved")

    def on_reachable(self) -> None:
        """The broker answers again: silence during the outage is no stall."""
        self.stalls.outage_over(self.router, time.monotonic())
        self.wake.set()

    def reads_topic(self, topic: str) -> bool:
        """The sweeper's exclusion: topics this edge reads, or will delete itself."""
        if isinstance(self.topology, TopicTopology) and topic in self.topology.deletions:
            return True
        return any(s.followed is not None and s.followed.topic == topic for s in self.router)

    # -- housekeeping ---------------------------------------------------------------------

    async def housekeeping(self) -> None:
        """Cancels streams detached past their grace, ends stalled ones, deletes expired
        result topics."""
        while True:
            now = time.monotonic()
            for stream in [s for s in self.router if s.grace_until is not None]:
                if stream.grace_until is not None and stream.grace_until <= now:
                    await self._cancel_abandoned(stream)
            if self.link.health.reachable:  # silence while Kafka is away is no stall
                for stream in self.stalls.due(self.router, now):
                    await self._end_stalled(stream)
            try:
                await self.topology.sweep(now)
            except KafkaError as exc:
                log.warning("result_topics.sweep_failed", error=repr(exc))
            due = (self._next_grace(), self._next_sweep(), self.stalls.next_at(self.router))
            deadlines = [d for d in due if d is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout)

    def _next_grace(self) -> float | None:
        ends = [s.grace_until for s in self.router if s.grace_until is not None]
        return min(ends) if ends else None

    def _next_sweep(self) -> float | None:
        if isinstance(self.topology, TopicTopology):
            return self.topology.deletions.next_at()
        return None

    async def _end_stalled(self, stream: ResultStream) -> None:
        """No record for this stream in `edge_stream_stall_s`: tell the client, free the slot."""
        request_id = stream.request_id
        if self.router.get(request_id) is not stream:
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
            await self.link.bounded(self.link.send_cancel(request_id, "client"))
        except (BrokerUnavailable, KafkaError) as exc:
            log.error("cancel.produce_failed", request_id=request_id, error=repr(exc))

    async def _cancel_abandoned(self, stream: ResultStream) -> None:
        """A detached stream's grace is over: cancel its request, and keep it until the
        cancelled run's final settles its tenant's charge with what the run used (issue 37,
        N5: an unset max_tokens is charged an estimate, and the answer may have run far past
        it), for `ABANDONED_SETTLE_S` at most; then let it go as it stands."""
        request_id = stream.request_id
        if self.router.get(request_id) is not stream or not stream.detached:
            return  # ended or resumed meanwhile
        if stream.abandoned:  # its final did not come in time
            stream.grace_until = None
            self.end(stream, "abandoned")
            return
        stream.abandoned = True
        stream.grace_until = time.monotonic() + ABANDONED_SETTLE_S
        try:
            await self.link.bounded(self.link.send_cancel(request_id, "disconnect"))
        except (BrokerUnavailable, KafkaError) as exc:
            # Still in the producer's buffer if the broker is away: it goes when it is back.
            # Else the request runs to its end: wasted work, not a wrong answer.
            log.error("cancel.produce_failed", request_id=request_id, error=repr(exc))
        self.metrics.disconnect_cancels.inc()
        log.info("request.cancelled_after_disconnect", request_id=request_id)

    def end(self, stream: ResultStream, why: Ending) -> None:
        """The one way a stream ends on this edge, whatever ended it (`Ending`).

        The router forgets it; the tenant's quota is given back (a finished stream's tokens
        charge settled to the real usage of its final first: a `done`'s, or a cancelled
        run's error's, with every attempt a cascade declined; an error without usage leaves
        the charge as it stands); the
        partition read for it alone is let go; and where it ended here (not moved to
        another edge, nor refused), a per-request topic starts its retention.
        """
        if self.router.get(stream.request_id) is stream:
            self.router.close(stream.request_id)
        if why == "finished" and (spent := stream.spent) is not None:
            self.guard.settle(stream.request_id, spent)
        self.guard.release(stream.request_id)
        self.metrics.streams_open.set(len(self.router))
        if stream.detached and stream.flight is not None:
            self.telemetry.end(stream.flight, outcome="abandoned")  # no client to write to
        tp = stream.followed
        if tp is None:
            return
        self.reader.unfollow(tp)
        ended_here = why in ("finished", "abandoned", "not_queued")
        if ended_here and self.topology.followed(ReplyTo(topic=tp.topic)):
            self.topology.ended(tp.topic, time.monotonic())
            self.wake.set()


def _since(began: float) -> float:
    """Seconds since `began` (monotonic), for a log line."""
    return round(time.monotonic() - began, 3)
