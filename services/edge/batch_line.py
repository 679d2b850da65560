"""One line of a batch, asked on the bus and answered whole (ADR 0075): the request its body
names, in the background tier with the batch's window as its deadline, and the line its
outcome is in the output or error file, in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import ValidationError

from services.edge.gateway import Gateway
from services.edge.openai.batch_lines import ENDPOINTS, BatchLine
from services.edge.openai.errors import HttpError, invalid
from services.edge.openai.logprobs import wanted as logprobs_wanted
from services.edge.openai.routes import HttpClient
from services.edge.openai.tool_calls import tool_answer
from services.edge.openai.translate import Answer, Identity, Kind, frame_error, to_chat_request
from services.edge.protocol import AcceptedFrame, ErrorFrame
from shared.batch_jobs import BatchJob
from shared.messages import BatchRef, ErrorCode, RequestLimits, Tier, error_message

log = structlog.get_logger()

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
# A line refused for now (the edge is busy or restarting) is asked again after this.
RETRY_S = 1.0
# A line whose answer ended in a server error (`internal`: a stream given up after a broker
# outage, say; `overloaded`) is asked again, this many times in all; then the error is its
# outcome, as OpenAI's error file has it.
MAX_ASKS = 3


@dataclass(frozen=True)
class Asked:
    """A line's outcome: `output` is its line of the output file (`ok`) or the error file."""

    ok: bool
    output: dict[str, Any]


class GaveUp(Exception):
    """The line was let go of unanswered (the edge drains, or the batch stopped): another
    runner, or this one later, asks it again."""


def expired(custom_id: str) -> Asked:
    return Asked(
        False,
        {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": None,
            "error": {"code": "batch_expired", "message": EXPIRED_MESSAGE},
        },
    )


def custom_id_of(raw: bytes) -> str:
    """The line's custom_id (the input was checked on upload: every line has one)."""
    try:
        return str(json.loads(raw)["custom_id"])
    except (ValueError, KeyError, TypeError):
        return ""


class LineAsker:
    """Asks lines of one batch through the edge's gateway; `ask` returns the line's outcome
    or raises GaveUp."""

    def __init__(self, gateway: Gateway, job: BatchJob, limits: RequestLimits) -> None:
        self._gateway = gateway
        self._job = job
        self._limits = limits
        self.in_flight: dict[str, HttpClient] = {}  # request id -> its client

    async def ask(self, raw: bytes) -> Asked:
        batch = self._job.batch
        try:
            line = BatchLine.model_validate_json(raw)
        except ValidationError as exc:  # checked on upload: only a file changed since
            return _failed("", invalid(error_message(exc)))
        if line.url != batch.endpoint:
            return _failed(
                line.custom_id,
                invalid(f"url {line.url!r} is not the batch's endpoint {batch.endpoint!r}", "url"),
            )
        try:
            body = ENDPOINTS[line.url].model_validate(line.body)
        except ValidationError as exc:
            return _failed(line.custom_id, invalid(error_message(exc)))
        chat = to_chat_request(body, self._limits)
        if isinstance(chat, HttpError):
            return _failed(line.custom_id, chat)
        ref = BatchRef(batch_id=batch.id, custom_id=line.custom_id)
        kind: Kind = "chat" if line.url == "/v1/chat/completions" else "text"
        model = body.model or next(iter(self._gateway.models.served(time.time())), "tokenbus")
        asks = 0
        while True:
            left_ms = int((batch.expires_at - time.time()) * 1000)
            if left_ms <= 0:
                return expired(line.custom_id)
            request = chat.model_copy(
                update={"priority": Tier.background, "deadline_ms": left_ms, "batch_line": ref}
            )
            asks += 1
            client = HttpClient()
            await self._gateway.submit_line(
                request, tenant=self._job.tenant, plan=self._job.plan, client=client
            )
            answer: Answer | None = None
            try:
                while True:
                    frame, stream, weight = await self._next(client)
                    client.taken(weight)
                    if isinstance(frame, AcceptedFrame):
                        ident = Identity(
                            kind,
                            frame.request_id,
                            model,
                            int(time.time()),
                            logprobs_wanted(body),
                            tool_answer(body),
                        )
                        answer = Answer(ident)
                        self.in_flight[frame.request_id] = client
                        continue
                    if answer is None:
                        if isinstance(frame, ErrorFrame):
                            if frame.code in (ErrorCode.overloaded, ErrorCode.rate_limited):
                                break  # refused for now: asked again
                            return _failed(line.custom_id, frame_error(frame))
                        continue
                    answer.take(frame)
                    if answer.result is None:
                        continue
                    self._gateway.written(frame, stream)
                    if asks < MAX_ASKS and _transient(frame):
                        log.info("batch.line_asked_again", custom_id=line.custom_id, asks=asks)
                        break  # asked again, under a new request id
                    return _answered(line.custom_id, answer, frame)
            finally:
                if answer is not None:
                    self.in_flight.pop(answer.ident.request_id, None)
                client.release()
            await asyncio.sleep(RETRY_S)

    async def cancel_all(self) -> None:
        """Cancel every line in flight (the batch was cancelled or expired)."""
        for request_id, client in list(self.in_flight.items()):
            await self._gateway.cancel_stream(request_id, client)

    @staticmethod
    async def _next(client: HttpClient) -> tuple[Any, Any, int]:
        get = asyncio.ensure_future(client.frames.get())
        behind = asyncio.ensure_future(client.behind.wait())
        try:
            await asyncio.wait({get, behind}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            behind.cancel()
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            return get.result()
        raise GaveUp  # the edge drains: its streams are let go of


def _transient(final: object) -> bool:
    return isinstance(final, ErrorFrame) and final.code in (
        ErrorCode.internal,
        ErrorCode.overloaded,
    )


def _answered(custom_id: str, answer: Answer, final: object) -> Asked:
    request_id = answer.ident.request_id
    result = answer.result
    if isinstance(final, ErrorFrame) and final.code == ErrorCode.deadline_exceeded:
        return expired(custom_id)
    if isinstance(final, ErrorFrame) and final.code == ErrorCode.cancelled:
        raise GaveUp  # the batch's cancel: the line is not answered
    if isinstance(result, HttpError):
        return Asked(
            False,
            {
                "id": f"batch_req_{request_id}",
                "custom_id": custom_id,
                "response": {
                    "status_code": result.status,
                    "request_id": request_id,
                    "body": result.body.model_dump(),
                },
                "error": None,
            },
        )
    assert result is not None
    return Asked(
        True,
        {
            "id": f"batch_req_{request_id}",
            "custom_id": custom_id,
            "response": {
                "status_code": 200,
                "request_id": request_id,
                "body": result.model_dump(),
            },
            "error": None,
        },
    )


def _failed(custom_id: str, error: HttpError) -> Asked:
    """A line refused before it reached the bus."""
    return Asked(
        False,
        {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": {
                "status_code": error.status,
                "request_id": None,
                "body": error.body.model_dump(),
            },
            "error": None,
        },
    )
