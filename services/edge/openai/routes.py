"""The OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`
and `/v1/models/{id}`.

Each request rides the edge's own stream routing (`Streams`, the edge's side of it): the
same bus, tiers, deadlines, quotas, cancels and traces as a WebSocket request. The HTTP
client is the stream's owner; when it goes away, the stream is detached and cancelled
after the WebSocket's disconnect grace unless it is resumed (`Last-Event-ID` and the
`X-Tokenbus-Resume-Token` response header, on a repeat of the request).

A streaming answer's status is decided by its acceptance: what is refused before the
request is on the bus (invalid, unauthorized, unknown model, quota, overload, a bad resume)
is an HTTP error (400, 401, 404, 429, 503...), as for a non-streaming request. Once it is
accepted the 200 and its headers go out at once, and `: keep-alive` comments while no event
flows, so a proxy's read timeout does not end a long queue; a later failure (a deadline
passed in the queue, a re-run after text) is an error event in the stream, as vLLM sends it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import structlog
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from services.edge.budget import ByteBudget
from services.edge.keys import Principal
from services.edge.openai.errors import (
    HttpError,
    bodies_busy,
    http_error,
    invalid,
    restarting,
    too_large,
    too_slow,
    unknown_model,
)
from services.edge.openai.ignored import ignored_fields
from services.edge.openai.logprobs import wanted as logprobs_wanted
from services.edge.openai.request_ids import note_request_id
from services.edge.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from services.edge.openai.sse import KEEPALIVE, EventId, parse_event_id
from services.edge.openai.tool_calls import tool_answer
from services.edge.openai.translate import (
    Answer,
    Identity,
    Kind,
    OpenAIRequest,
    SseStream,
    frame_error,
    to_chat_request,
)
from services.edge.outbox import frame_weight
from services.edge.protocol import AcceptedFrame, ErrorFrame, ServerFrame, StreamResumedFrame
from shared.messages import (
    ChatRequest,
    ErrorCode,
    RequestLimits,
    error_message,
    unknown_model_message,
)

log = structlog.get_logger()

RESUME_TOKEN_HEADER = "X-Tokenbus-Resume-Token"
# Asked for, each SSE event carries `id: <attempt>:<seq>` (what a resume's Last-Event-ID
# names). Not by default: OpenAI's and vLLM's servers send `data:` lines only, and clients
# that read an event as one `data:` line (`vllm bench serve`) fail on an `id:` line.
EVENT_IDS_HEADER = "X-Tokenbus-Event-Ids"


def wants_event_ids(headers: Headers) -> bool:
    return headers.get(EVENT_IDS_HEADER, "").strip().lower() in ("1", "true", "yes")


class HttpClient:
    """One HTTP request's end of its stream: the owner the router delivers frames to.

    Bounded, as a WebSocket's outbox: a client that lets `max_frames` pile up (it stopped
    reading, so its writes wait) has fallen `behind`; its answer lets go of its stream.
    """

    def __init__(
        self,
        max_frames: int = 0,
        max_bytes: int | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        # (frame, the stream it belongs to: reported back with `Streams.written`, its weight)
        self.frames: asyncio.Queue[tuple[ServerFrame, object, int]] = asyncio.Queue(max_frames)
        self.behind = asyncio.Event()
        self.revoked = False  # its key was revoked: let go of, as one behind is
        self.restarting = False  # the edge drains: let go of, told where to go on (drain.py)
        # Bounded in weight too, and within the edge's budget (services/edge/outbox.py).
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.budget = budget
        self.closed = False  # released: nothing more is queued

    def revoke(self) -> None:
        self.revoked = True
        self.behind.set()

    def drain(self) -> None:
        self.restarting = True
        self.behind.set()

    def send(self, frame: ServerFrame, stream: object = None) -> None:
        if self.behind.is_set() or self.closed:
            return  # let go of: its stream is detached, and resumed from where it was read
        weight = frame_weight(frame)
        if self.max_bytes is not None and self.queued_bytes + weight > self.max_bytes:
            self.behind.set()
            return
        if self.budget is not None and not self.budget.take(weight):
            self.behind.set()
            return
        try:
            self.frames.put_nowait((frame, stream, weight))
        except asyncio.QueueFull:
            if self.budget is not None:
                self.budget.give(weight)
            self.behind.set()
            return
        self.queued_bytes += weight

    def taken(self, weight: int) -> None:
        """A queued frame was taken to be written: its weight is free again."""
        self.queued_bytes -= weight
        if self.budget is not None:
            self.budget.give(weight)

    def release(self) -> None:
        """The answer is over: what is still queued is never written."""
        self.closed = True
        while not self.frames.empty():
            _, _, weight = self.frames.get_nowait()
            self.taken(weight)


class Streams(Protocol):
    """What the handlers need of the edge. Errors reach the client as `error` frames."""

    @property
    def limits(self) -> RequestLimits: ...

    def authenticate(self, headers: Headers) -> Principal | HttpError: ...

    def served_models(self) -> dict[str, int]:
        """Model name -> when first seen (Unix seconds), for the models live workers serve."""
        ...

    def max_model_len(self) -> dict[str, int]:
        """Model name -> its context length, where its live workers say."""
        ...

    def unknown_model(self, request: ChatRequest) -> tuple[str, str] | None:
        """(field, message) if the request names a model no live worker serves."""
        ...

    def routes(self) -> frozenset[str]:
        """The routes' names (TOKENBUS_ROUTES): models whose answer a cascade may replace."""
        ...

    async def open(
        self, principal: Principal, request: ChatRequest, client: HttpClient, headers: Headers
    ) -> None:
        """Submit `request`; `chat.accepted` (or an error) then its stream reach `client`."""
        ...

    async def resume(
        self, principal: Principal, token: str, after: EventId, client: HttpClient
    ) -> None:
        """Resume a stream after `after`; `stream.resumed` (or an error) then the rest."""
        ...

    def detach(self, client: HttpClient) -> None:
        """The client went away: its stream waits out the disconnect grace, then is cancelled."""
        ...

    async def cancel(self, request_id: str, client: HttpClient) -> None: ...

    def written(self, frame: ServerFrame, stream: object) -> None:
        """A frame's content reached the client (telemetry)."""
        ...

    def open_socket(self, principal: Principal) -> HttpError | None:
        """A streaming answer takes one of its tenant's `sockets` places, as a WebSocket
        does, until `close_socket`; `rate_limited` if none is free."""
        ...

    def close_socket(self, principal: Principal) -> None: ...

    def watch(self, principal: Principal, client: HttpClient) -> Callable[[], None]:
        """Revoke `client` when `principal`'s key is revoked, as a WebSocket is closed;
        returns what stops the watch."""
        ...


class Disconnect:
    """Watches a request's `receive` (its body already read) for the client going away."""

    def __init__(self, receive: Receive) -> None:
        self.gone = asyncio.Event()
        self._task = asyncio.create_task(self._watch(receive), name="openai-disconnect")

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    def stop(self) -> None:
        self._task.cancel()


async def next_frame(
    client: HttpClient, disconnect: Disconnect, quiet_s: float
) -> tuple[ServerFrame, object] | None:
    """The client's next frame and its stream; None if the client left, fell behind, or
    nothing came within `quiet_s`."""
    get = asyncio.ensure_future(client.frames.get())
    gone = asyncio.ensure_future(disconnect.gone.wait())
    behind = asyncio.ensure_future(client.behind.wait())
    try:
        await asyncio.wait(
            {get, gone, behind}, timeout=quiet_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        gone.cancel()
        behind.cancel()
        if not get.done():
            get.cancel()
    if get.done() and not get.cancelled():
        frame, stream, weight = get.result()
        client.taken(weight)
        return frame, stream
    return None


def error_response(error: HttpError) -> Response:
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=error.headers)


# The bytes of request bodies the edge holds while they are read, all clients together, are
# bounded by a `ByteBudget` (issue 37, N4: 1,500 connections each holding an unfinished 1 MiB
# body exceeded the edge's memory); a body that would pass it is refused (503).
# A client refused for the body budget may try again this soon: bodies finish in seconds.
BODY_RETRY_AFTER_MS = 1000


async def read_body(
    request: Request,
    limit: int,
    budget: ByteBudget | None = None,
    timeout_s: float | None = None,
) -> bytes | HttpError:
    """The request's body as it streams in (chunked or not), or why not: past `limit`
    bytes (413), not whole within `timeout_s` (408), more than the edge's `budget` of
    bodies being read (503). The rest is never read, and the connection is closed with the
    answer. Its bytes count against `budget` while it is read."""
    chunks: list[bytes] = []
    size = 0  # bytes read, and held against `budget`
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if size + len(chunk) > limit:
                    return too_large(limit)
                if budget is not None and not budget.take(len(chunk)):
                    log.warning("openai.body_budget_full", held=budget.held, limit=budget.limit)
                    return bodies_busy(BODY_RETRY_AFTER_MS)
                size += len(chunk)
                chunks.append(chunk)
    except TimeoutError:
        log.info("openai.body_too_slow", read=size, timeout_s=timeout_s)
        return too_slow(timeout_s or 0.0)
    finally:
        if budget is not None:
            budget.give(size)
    return b"".join(chunks)


class SseResponse(Response):
    """An SSE answer: writes what `stream` makes of the client's frames until it ends.

    Owns the stream from here: when the client goes away first (or falls behind), the
    stream is detached; when the stream asks for it (a new attempt after text), the request
    is cancelled; when it ends, whatever the reason, `on_end` gives back its socket place.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        streams: Streams,
        client: HttpClient,
        disconnect: Disconnect,
        sse: SseStream,
        headers: Mapping[str, str],
        on_end: Callable[[], None],
        keepalive_s: float,
    ) -> None:
        # As StreamingResponse: no body, so no Content-Length; the events follow in `__call__`.
        self.status_code = 200
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams
        self._client = client
        self._disconnect = disconnect
        self._sse = sse
        self._on_end = on_end
        self._keepalive_s = keepalive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # The headers at once (uvicorn writes them with this message), before any event.
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while not self._sse.ended and not self._left():
                got = await next_frame(self._client, self._disconnect, self._keepalive_s)
                if got is None:
                    if not self._left():
                        await send(
                            {"type": "http.response.body", "body": KEEPALIVE, "more_body": True}
                        )
                    continue
                frame, stream = got
                await self._write(send, self._sse.take(frame))
                self._streams.written(frame, stream)
            if self._client.revoked and not self._sse.ended:
                # Its key was revoked: the request is cancelled now (no resume can follow),
                # and the stream ends with the error, as a WebSocket closes with 1008.
                self._sse.cancel = True
                revoked = ErrorFrame(
                    code=ErrorCode.unauthorized,
                    message="the request's API key was revoked",
                    request_id=self._sse.ident.request_id,
                )
                await self._write(send, self._sse.take(revoked))
            elif self._client.restarting and not self._sse.ended:
                # The edge drains: the stream is detached (below) and waits out the grace for
                # the client to go on at another edge, from the event this one names.
                await self._write(send, self._sse.restarting())
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            if self._sse.ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError as exc:  # the client's connection broke mid-write
            log.info("openai.client_gone", error=repr(exc), request_id=self._sse.ident.request_id)
        finally:
            await self._let_go()

    def _left(self) -> bool:
        """The client went away, or fell behind (its frames piled up unread)."""
        return self._disconnect.gone.is_set() or self._client.behind.is_set()

    async def _write(self, send: Send, chunks: list[bytes]) -> None:
        if chunks:
            await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})

    async def _let_go(self) -> None:
        self._disconnect.stop()
        try:
            if self._sse.cancel:
                await self._streams.cancel(self._sse.ident.request_id, self._client)
            if not self._sse.ended:
                behind = self._client.behind.is_set()
                log.info("openai.client_left", request_id=self._sse.ident.request_id, behind=behind)
                self._streams.detach(self._client)  # cancelled after the grace unless resumed
        finally:
            self._on_end()


class OpenAIApi:
    """The handlers; `clock` stamps `created` (Unix seconds); a quiet stream gets a
    `: keep-alive` comment every `keepalive_s`."""

    def __init__(
        self,
        streams: Streams,
        max_body_bytes: int,
        max_frames: int = 4096,
        clock: Callable[[], float] = time.time,
        *,
        keepalive_s: float,  # TOKENBUS_EDGE_SSE_KEEPALIVE_S
        body_timeout_s: float | None = None,  # TOKENBUS_EDGE_BODY_TIMEOUT_S
        body_budget_bytes: int | None = None,  # TOKENBUS_EDGE_BODY_BUDGET_BYTES
        max_outbox_bytes: int | None = None,  # TOKENBUS_EDGE_OUTBOX_BYTES
        outbox_budget: ByteBudget | None = None,  # the edge's, shared with its WebSockets
    ) -> None:
        self._streams = streams
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._bodies = None if body_budget_bytes is None else ByteBudget(body_budget_bytes)
        self._max_outbox_bytes = max_outbox_bytes
        self._outbox_budget = outbox_budget
        self._max_frames = max_frames  # frames queued for one client (HttpClient)
        self._clock = clock
        self._keepalive_s = keepalive_s

    async def models(self, request: Request) -> Response:
        principal = self._streams.authenticate(request.headers)
        if isinstance(principal, HttpError):
            return error_response(principal)
        return JSONResponse(ModelList(data=list(self._cards().values())).model_dump())

    async def model(self, request: Request) -> Response:
        """`/v1/models/{id}`: one served model's card, or OpenAI's 404 `model_not_found`."""
        principal = self._streams.authenticate(request.headers)
        if isinstance(principal, HttpError):
            return error_response(principal)
        name: str = request.path_params["model"]
        cards = self._cards()
        if (card := cards.get(name)) is None:
            return error_response(unknown_model(unknown_model_message(name, cards)))
        return JSONResponse(card.model_dump())

    def _cards(self) -> dict[str, ModelCard]:
        """Model name -> its card, for the models live workers serve."""
        lengths = self._streams.max_model_len()
        return {
            m: ModelCard(id=m, created=t, max_model_len=lengths.get(m))
            for m, t in self._streams.served_models().items()
        }

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "text")

    async def _complete(self, request: Request, kind: Kind) -> Response:
        # 1) Who asks: nothing is read of the body before it is known.
        principal = self._streams.authenticate(request.headers)
        if isinstance(principal, HttpError):
            return error_response(principal)
        # 2) A place among the tenant's `sockets`, taken before the body is read (an
        # unfinished body holds it, so one key cannot hold the edge's body budget: issue 37,
        # N4) and kept while a stream streams, as a WebSocket's is.
        if refused := self._streams.open_socket(principal):
            return error_response(refused)
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self._streams.close_socket(principal)

        response: Response | None = None
        try:
            # 3) What it asks: nothing reaches Kafka before it is known good.
            body = await self._body(request, kind)
            if isinstance(body, HttpError):
                response = error_response(body)
                return response
            if ignored := ignored_fields(body):
                log.info("openai.fields_ignored", fields=ignored, endpoint=request.url.path)
            if not body.stream:
                give_back()  # a whole answer holds no place while it is computed
                response = await self._serve(request, principal, body, kind, lambda: None)
                return response
            response = await self._serve(request, principal, body, kind, give_back)
            return response
        finally:
            if not isinstance(response, SseResponse):
                give_back()  # the SSE answer gives it back when it ends

    async def _serve(
        self,
        request: Request,
        principal: Principal,
        body: OpenAIRequest,
        kind: Kind,
        on_end: Callable[[], None],
    ) -> Response:
        served = self._streams.served_models()
        token = request.headers.get(RESUME_TOKEN_HEADER)
        model = body.model or next(iter(served), "tokenbus")
        client = HttpClient(self._max_frames, self._max_outbox_bytes, self._outbox_budget)
        # Its key revoked mid-answer, the answer stops, as a WebSocket closes (issue 37).
        unwatch = self._streams.watch(principal, client)
        try:
            response = await self._stream_or_answer(
                request, principal, body, kind, model, token, client, unwatch, on_end
            )
        except BaseException:
            unwatch()
            client.release()
            raise
        if not isinstance(response, SseResponse):
            unwatch()
            client.release()
        return response

    async def _stream_or_answer(
        self,
        request: Request,
        principal: Principal,
        body: OpenAIRequest,
        kind: Kind,
        model: str,
        token: str | None,
        client: HttpClient,
        unwatch: Callable[[], None],
        on_end: Callable[[], None],
    ) -> Response:
        def ended() -> None:  # an SSE answer's end
            unwatch()
            client.release()
            on_end()

        # 3) Open (or resume) the stream; its first frame says whether it was accepted.
        if token is not None:
            after = self._after(request.headers)
            if isinstance(after, HttpError):
                return error_response(after)
            if not body.stream:
                return error_response(invalid("a resume needs `stream: true`", "stream"))
            await self._streams.resume(principal, token, after or EventId(0, -1), client)
        else:
            chat = to_chat_request(body, self._streams.limits)
            if isinstance(chat, HttpError):
                return error_response(chat)
            if unknown := self._streams.unknown_model(chat):
                field, message = unknown
                return error_response(unknown_model(message, field))
            after = None
            await self._streams.open(principal, chat, client, request.headers)
        # 4) Answer: whole, or as events once the first one is known.
        disconnect = Disconnect(request.receive)
        try:
            response = await self._answer(
                request.scope, body, kind, model, client, disconnect, after, token, ended
            )
        except BaseException:
            disconnect.stop()
            self._streams.detach(client)
            raise
        if not isinstance(response, SseResponse):
            disconnect.stop()
        return response

    async def _answer(
        self,
        scope: Scope,
        body: OpenAIRequest,
        kind: Kind,
        model: str,
        client: HttpClient,
        disconnect: Disconnect,
        after: EventId | None,
        token: str | None,
        on_end: Callable[[], None],
    ) -> Response:
        head: dict[str, str] = {}
        answer: Answer | None = None
        # A resume names its place by event id; a new stream has ids only when asked.
        event_ids = token is not None or wants_event_ids(Headers(scope=scope))
        while True:
            got = await next_frame(client, disconnect, self._keepalive_s)
            if got is None:
                if client.restarting and answer is not None:
                    # The edge drains: the client's retry (at another edge) is the one run.
                    await self._streams.cancel(answer.ident.request_id, client)
                    return error_response(restarting())
                if disconnect.gone.is_set() or client.behind.is_set():
                    self._streams.detach(client)  # cancelled after the grace
                    if client.revoked:
                        return error_response(
                            http_error(ErrorCode.unauthorized, "the request's API key was revoked")
                        )
                    return Response(status_code=499)
                continue
            frame, stream = got
            if isinstance(frame, ErrorFrame):
                # Refused before acceptance (quota, overload, a bad resume), or a whole
                # answer that failed: the answer's status says so.
                if frame.request_id is not None:
                    note_request_id(scope, frame.request_id)
                self._streams.written(frame, stream)
                return error_response(frame_error(frame))
            if isinstance(frame, AcceptedFrame | StreamResumedFrame):
                note_request_id(scope, frame.request_id)
                ident = Identity(
                    kind,
                    frame.request_id,
                    model,
                    int(self._clock()),
                    logprobs_wanted(body),
                    tool_answer(body),
                )
                token = frame.resume_token if isinstance(frame, AcceptedFrame) else token
                head = {RESUME_TOKEN_HEADER: token or ""}
                if body.stream:  # on the bus: the headers go out now, the events follow
                    options = body.stream_options
                    sse = SseStream(
                        ident,
                        options is not None and options.include_usage,
                        after,
                        event_ids=event_ids,
                        hold=model in self._streams.routes(),
                        continuous_usage=options is not None and options.continuous_usage_stats,
                    )
                    return SseResponse(
                        self._streams, client, disconnect, sse, head, on_end, self._keepalive_s
                    )
                answer = Answer(ident)
                continue
            if answer is None:
                continue  # nothing else comes before acceptance
            answer.take(frame)
            if answer.result is None:
                continue
            self._streams.written(frame, stream)
            if isinstance(answer.result, HttpError):
                return error_response(answer.result)
            return JSONResponse(answer.result.model_dump(), headers=head)

    async def _body(self, request: Request, kind: Kind) -> OpenAIRequest | HttpError:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            return too_large(self._max_body_bytes)
        raw = await read_body(request, self._max_body_bytes, self._bodies, self._body_timeout_s)
        if isinstance(raw, HttpError):
            return raw
        try:
            data = json.loads(raw)
        except RecursionError:  # arrays in arrays... past the interpreter's stack
            return invalid("body: JSON nested too deeply")
        except ValueError:
            return invalid("body: not valid JSON")
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            return invalid(error_message(exc))

    @staticmethod
    def _after(headers: Headers) -> EventId | HttpError | None:
        value = headers.get("last-event-id")
        if value is None:
            return None
        after = parse_event_id(value)
        if after is None:
            return invalid("Last-Event-ID: expected `<attempt>:<seq>`, as the stream's ids")
        return after
