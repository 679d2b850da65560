"""The edge's side of the OpenAI API (`routes.Streams`): keys, quotas, and the gateway."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
from starlette.datastructures import Headers

from services.edge.auth import AmbiguousCredentials, Guard, KeyHolder, key_from_headers
from services.edge.gateway import Gateway
from services.edge.keys import Principal
from services.edge.models import ModelDirectory
from services.edge.openai.errors import HttpError, http_error
from services.edge.openai.routes import HttpClient
from services.edge.openai.sse import EventId
from services.edge.protocol import ErrorFrame, ServerFrame, StreamResumeFrame
from services.edge.streams import ResultStream
from shared.messages import ChatRequest, ErrorCode, Heartbeat, RequestLimits, error_message
from shared.records import read

log = structlog.get_logger()


def authenticate(guard: Guard, headers: Headers) -> Principal | HttpError:
    """The principal of a request's `Authorization: Bearer <key>`, as a socket's upgrade.

    With an `Origin` (a browser) only Bearer counts: cached Basic credentials are ambient.
    """
    try:
        key = key_from_headers(headers.getlist("authorization"), browser="origin" in headers)
    except AmbiguousCredentials as exc:
        return http_error(ErrorCode.unauthorized, f"unusable credentials: {exc}")
    if key is None:
        return http_error(
            ErrorCode.unauthorized, "no API key: send it as `Authorization: Bearer <key>`"
        )
    principal = guard.keys.lookup(key)
    if principal is None:
        log.info("auth.refused", reason="unknown_key", via="http")
        return http_error(ErrorCode.unauthorized, "unknown or revoked API key")
    return principal


NOT_READY = ErrorFrame(
    code=ErrorCode.overloaded, message="the edge is not ready", retry_after_ms=1000
)


class EdgeStreams:
    """`routes.Streams` on one edge: admitted by its guard, carried by its gateway.

    Caller: the OpenAI handlers; `heartbeat` the edge's result reader.
    Affects: the model directory; the rest is the gateway's and the guard's.
    """

    def __init__(
        self,
        guard: Guard,
        gateway: Callable[[], Gateway | None],
        limits: RequestLimits,
        models: ModelDirectory,
    ) -> None:
        self.models = models  # the gateway's too: the WebSocket refuses unknown models by it
        self._guard = guard
        self._gateway = gateway  # None until the edge reached Kafka, and while it stops
        self._limits = limits
        self._models = models

    @property
    def limits(self) -> RequestLimits:
        return self._limits

    def authenticate(self, headers: Headers) -> Principal | HttpError:
        return authenticate(self._guard, headers)

    def served_models(self) -> dict[str, int]:
        return self._models.served(time.time())

    def max_model_len(self) -> dict[str, int]:
        return self._models.max_model_len(time.time())

    def unknown_model(self, request: ChatRequest) -> tuple[str, str] | None:
        return self._models.unknown(request, time.time())

    def routes(self) -> frozenset[str]:
        return frozenset(self._models.routes)

    def heartbeat(self, value: bytes) -> None:
        """One record of the workers topic."""
        try:
            beat = read(Heartbeat, value)
        except ValueError as exc:
            log.warning("heartbeat.invalid", error=error_message(exc)[:200])
            return
        self._models.observe(beat, time.time())

    async def open(
        self, principal: Principal, request: ChatRequest, client: HttpClient, headers: Headers
    ) -> None:
        gateway = self._gateway()
        if gateway is None:
            client.send(NOT_READY)
            return
        # The client's own `traceparent`, if it sent one.
        await gateway.submit(request, principal=principal, client=client, parent=headers)

    async def resume(
        self, principal: Principal, token: str, after: EventId, client: HttpClient
    ) -> None:
        gateway = self._gateway()
        if gateway is None:
            client.send(NOT_READY)
            return
        if refused := self._guard.charge(principal, "stream.resume"):
            client.send(refused)
            return
        frame = StreamResumeFrame(
            type="stream.resume", resume_token=token, after_seq=after.seq, attempt=after.attempt
        )
        await gateway.resume_stream(frame, principal=principal, client=client)

    def detach(self, client: HttpClient) -> None:
        if (gateway := self._gateway()) is not None:
            gateway.detach(client)

    async def cancel(self, request_id: str, client: HttpClient) -> None:
        if (gateway := self._gateway()) is not None:
            await gateway.cancel_stream(request_id, client)

    def open_socket(self, principal: Principal) -> HttpError | None:
        refusal = self._guard.quotas.open_socket(principal.tenant, principal.limits)
        if refusal is None:
            return None
        log.info("quota.refused", limit=refusal.limit, key_id=principal.key_id, via="http")
        return http_error(
            ErrorCode.rate_limited,
            f"rate_limited ({refusal.limit}): {refusal.message}",
            retry_after_ms=refusal.retry_after_ms,
        )

    def close_socket(self, principal: Principal) -> None:
        self._guard.close_socket(principal)

    def watch(self, principal: Principal, client: HttpClient) -> Callable[[], None]:
        watched = KeyHolder(principal)
        self._guard.watch(watched, client.revoke)
        return lambda: self._guard.unwatch(watched)

    def written(self, frame: ServerFrame, stream: object) -> None:
        gateway = self._gateway()
        if gateway is not None and (stream is None or isinstance(stream, ResultStream)):
            gateway.written(frame, stream)
