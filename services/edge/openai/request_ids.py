"""`X-Request-Id` on every response of the OpenAI API, errors included: written in one place.

The handlers note the id once the edge knows it (a stream accepted, resumed, or refused by
the guard with its id); an answer given before any id existed (invalid body, unknown key,
unknown model, a 404 route) gets a fresh one, so every answer can be quoted in a report.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-Id"
OPENAI_PATHS = "/v1/"
_SCOPE_KEY = "tokenbus.request_id"


def note_request_id(scope: Scope, request_id: str) -> None:
    """The id the answer to this HTTP request carries (the id of its tokenbus request)."""
    scope[_SCOPE_KEY] = request_id


def new_request_id() -> str:
    return uuid.uuid4().hex  # the form of the edge's own request ids


class RequestIds:
    """ASGI middleware: sets `X-Request-Id` on each HTTP response under `/v1/`.

    Caller: Starlette, around the routes. Affects: only the response's headers.
    """

    def __init__(self, app: ASGIApp, new_id: Callable[[], str] = new_request_id) -> None:
        self.app = app
        self._new_id = new_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(OPENAI_PATHS):
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers[REQUEST_ID_HEADER] = scope.get(_SCOPE_KEY) or self._new_id()
            await send(message)

        await self.app(scope, receive, send_with_id)
