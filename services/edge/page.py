"""The headers every HTTP answer of the edge carries: the chat page's CSP and its companions.

The page renders a model's answers, which are untrusted: its sanitizer (static/chat.js) is
the first wall, this policy the second. Script and style load from the page's own files
only (nothing inline), the page talks to its own origin only (its WebSocket included: CSP 3
`'self'` matches ws:/wss: on the same host), and it loads no image, submits no form, takes
no `<base>` and is framed by no one. The API's JSON and SSE carry the same headers: they are
no documents to run, and one rule for all answers leaves no path without it.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'none'",
        "form-action 'none'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class SecurityHeaders:
    """ASGI middleware: adds `SECURITY_HEADERS` to every HTTP response (not WebSockets)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
