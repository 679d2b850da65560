"""The edge's side of the OpenAI API (`routes.Streams`): keys, quotas, and its stream path."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, cast

import structlog
from aiokafka.errors import KafkaError
from starlette.datastructures import Headers

from services.edge.auth import AmbiguousCredentials, key_from_headers
from services.edge.broker_health import BrokerUnavailable
from services.edge.keys import Principal
from services.edge.openai.errors import HttpError, http_error
from services.edge.openai.models import ModelDirectory
from services.edge.openai.routes import HttpClient
from services.edge.openai.sse import EventId
from services.edge.protocol import (
    AcceptedFrame,
    ChatRequestFrame,
    ErrorFrame,
    ServerFrame,
    StreamResumeFrame,
)
from services.edge.resume import (
    ResumeClaims,
    ResumeRefused,
    check_resume,
    sign,
    token_kid,
)
from services.edge.topology import TopologyError
from shared.messages import ChatRequest, ErrorCode, Heartbeat, RequestLimits, Tier

if TYPE_CHECKING:
    from services.edge.app import ChatSocket, Edge

log = structlog.get_logger()

RESUME_TIMEOUT_S = 10.0


def authenticate(edge: Edge, headers: Headers) -> Principal | HttpError:
    """The principal of a request's `Authorization: Bearer <key>`, as the WebSocket's."""
    try:
        key = key_from_headers(headers.getlist("authorization"), browser="origin" in headers)
    except AmbiguousCredentials as exc:
        return http_error(ErrorCode.unauthorized, f"unusable credentials: {exc}")
    if key is None:
        return http_error(
            ErrorCode.unauthorized, "no API key: send it as `Authorization: Bearer <key>`"
        )
    principal = edge.guard.keys.lookup(key)
    if principal is None:
        log.info("auth.refused", reason="unknown_key", via="http")
        return http_error(ErrorCode.unauthorized, "unknown or revoked API key")
    return principal


class EdgeStreams:
    """`routes.Streams` on one edge: the same admission and stream path as a socket's."""

    def __init__(self, edge: Edge, models: ModelDirectory) -> None:
        self._edge = edge
        self._models = models

    @property
    def limits(self) -> RequestLimits:
        return self._edge.limits

    def authenticate(self, headers: Headers) -> Principal | HttpError:
        return authenticate(self._edge, headers)

    def served_models(self) -> dict[str, int]:
        return self._models.served(time.time())

    def heartbeat(self, value: bytes) -> None:
        """One record of the workers topic (the edge's reader calls it)."""
        try:
            beat = Heartbeat.model_validate_json(value)
        except ValueError as exc:
            log.warning("heartbeat.invalid", error=str(exc)[:200])
            return
        self._models.observe(beat)

    async def open(
        self, principal: Principal, request: ChatRequest, client: HttpClient, headers: Headers
    ) -> None:
        edge = self._edge
        request_id = uuid.uuid4().hex
        frame = ChatRequestFrame.model_validate(
            {**request.model_dump(), "type": "chat.request"}, context={"limits": edge.limits}
        )
        if refused := edge.guard.admit(principal, frame, request_id):
            client.send(refused)  # before anything of it reaches Kafka
            return
        tenant = edge.guard.tenant_id(principal)
        edge.telemetry.begin(
            request_id,
            tier=(request.priority or Tier.interactive).value,
            max_tokens=request.max_tokens,
            parent=headers,
        )
        try:
            reply_to, offset = await edge.open_request(request_id)
        except (TopologyError, KafkaError, BrokerUnavailable) as exc:
            edge.telemetry.end(request_id, outcome="reply_to_failed")
            edge.guard.release(request_id)
            log.error("request.reply_to_failed", request_id=request_id, error=repr(exc))
            client.send(edge.overloaded("could not prepare the result stream, try again"))
            return
        from shared.messages import RequestRecord

        fields: dict[str, Any] = request.model_dump()
        fields.update(request_id=request_id, tenant=tenant, reply_to=reply_to.model_dump())
        record = RequestRecord.model_validate(fields, context={"limits": edge.limits})
        claims = ResumeClaims(
            tenant=tenant,
            request_id=request_id,
            topic=reply_to.topic,
            partition=reply_to.partition,
            offset=offset,
            expires_at=time.time() + edge.settings.edge_resume_ttl_s,
        )
        edge.router.open(request_id, client.send, owner=client)
        edge.metrics.streams_open.set(len(edge.router))
        try:
            await edge.bounded(edge.telemetry.publish(edge.producer, edge.topics.requests, record))
        except (KafkaError, BrokerUnavailable) as exc:
            log.error("request.produce_failed", request_id=request_id, error=repr(exc))
            edge.telemetry.end(request_id, outcome="produce_failed")
            edge.router.close(request_id)
            edge._let_go(request_id, ended=True)
            client.send(edge.overloaded("could not queue the request, try again"))
            if isinstance(exc, BrokerUnavailable):
                await edge.withdraw(request_id)
            return
        edge.router.release(
            request_id,
            AcceptedFrame(
                request_id=request_id,
                resume_token=sign(claims, edge.resume_keys),
                tier=request.priority or Tier.interactive,
            ),
        )

    async def resume(
        self, principal: Principal, token: str, after: EventId, client: HttpClient
    ) -> None:
        edge = self._edge
        frame = StreamResumeFrame(
            type="stream.resume", resume_token=token, after_seq=after.seq, attempt=after.attempt
        )
        request_id: str | None = None
        try:
            claims = check_resume(
                token,
                edge.resume_keys,
                tenant=edge.guard.tenant_id(principal, token_kid(token)),
                results_topic=edge.topics.results,
                now=time.time(),
            )
            request_id = claims.request_id
            owner = cast("ChatSocket", client)  # only its `send` is used
            await edge.bounded(edge.resume(claims, frame, owner), RESUME_TIMEOUT_S)
        except ResumeRefused as exc:
            edge.metrics.resumes.labels(exc.code.value).inc()
            log.info("stream.resume_refused", request_id=request_id, code=exc.code.value)
            client.send(ErrorFrame(code=exc.code, message=exc.message, request_id=request_id))
        except (KafkaError, BrokerUnavailable) as exc:
            log.error("stream.resume_failed", request_id=request_id, error=repr(exc))
            client.send(
                edge.overloaded("could not read the stream now, try again", request_id=request_id)
            )

    def detach(self, client: HttpClient) -> None:
        self._edge.detach(client)

    async def cancel(self, request_id: str) -> None:
        try:
            await self._edge.bounded(self._edge.send_cancel(request_id, "client"))
        except (KafkaError, BrokerUnavailable) as exc:
            log.error("cancel.produce_failed", request_id=request_id, error=repr(exc))

    def written(self, frame: ServerFrame, stream: object) -> None:
        self._edge.telemetry.frame_written(frame)
