"""The socket side of the SDK: one request's stream over one WebSocket at a time.

A dropped socket (an edge killed, a network blip, the edge closing a slow reader with 1013)
is replaced by a new one to the next edge in the list, which is sent `stream.resume` with
what `StreamState` says was shown; the caller sees the answer once, whole, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from services.edge.protocol import DoneFrame, ErrorFrame
from shared.messages import ErrorCode
from tokenbus.client.framing import (
    Delta,
    ResumeLater,
    StreamBroken,
    StreamState,
    parse_frame,
    reconnect_order,
)

log = structlog.get_logger("tokenbus.client")

# HTTP answers to the upgrade that no retry changes: a bad key (403), a bad URL (404).
_FINAL_STATUSES = frozenset({400, 401, 403, 404})


class ChatError(Exception):
    """The edge ended or refused the request: `code` is one of the protocol's error codes."""

    def __init__(self, code: str, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


class ConnectionLost(Exception):
    """No edge in the list could be reached within the reconnect timeout."""


class ChatStream:
    """One request: iterate for its deltas (`async for delta in stream`); `cancel()` stops it.

    Iterate once. After the iteration `done` holds finish_reason, usage and timings (None if
    cancelled) and `text` the answer. Leaving the loop early (break, an exception) cancels the
    request on the edge.
    """

    def __init__(
        self,
        urls: Sequence[str],
        headers: dict[str, str],
        body: dict[str, Any],
        *,
        reconnect_timeout_s: float,
        open_timeout_s: float,
    ) -> None:
        self._urls = list(urls)
        self._headers = headers
        self._body = body
        self._reconnect_timeout_s = reconnect_timeout_s
        self._open_timeout_s = open_timeout_s
        self.state = StreamState(client_id=uuid.uuid4().hex)
        self.url: str = self._urls[0]  # the edge serving the stream now
        self.reconnects = 0
        self._ws: ClientConnection | None = None
        self._cancelled = False
        self._cancel_sent: ClientConnection | None = None
        # When the stream last lost its footing (a drop, a deferred resume); None: going well.
        self._trouble_since: float | None = None
        self._iterated = False

    @property
    def request_id(self) -> str | None:
        return self.state.request_id

    @property
    def text(self) -> str:
        """The answer so far (of the attempt being shown)."""
        return self.state.text

    @property
    def done(self) -> DoneFrame | None:
        return self.state.end if isinstance(self.state.end, DoneFrame) else None

    async def cancel(self) -> None:
        """Ask the edge to stop the request; the iteration then ends without an error."""
        self._cancelled = True
        await self._send_cancel()

    async def _send_cancel(self) -> None:
        """Send `chat.cancel` once per socket, when the socket owns the stream: after its
        acceptance, or after `stream.resumed` (an edge refuses others' cancels)."""
        ws, frame = self._ws, self.state.cancel_frame()
        if ws is None or frame is None or self.state.resuming or self._cancel_sent is ws:
            return
        self._cancel_sent = ws
        # If the socket is gone, it is sent again on the next once the stream is resumed there.
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps(frame))

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._iterated:
            raise RuntimeError("a ChatStream is iterated once")
        self._iterated = True
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while True:
            ws = await self._connect()
            dropped = False
            try:
                await ws.send(json.dumps(self._opening()))
                while True:  # until the stream ends or the socket drops (ConnectionClosed)
                    frame = parse_frame(await ws.recv())
                    if not self.state.concerns(frame):
                        continue
                    delta = self.state.receive(frame)
                    if self.state.accepted and not self.state.resuming:
                        self._trouble_since = None
                    if self._cancelled:
                        await self._send_cancel()
                    if delta is not None:
                        yield delta
                    if self.state.finished:
                        self._finish()
                        return
            except ConnectionClosed as exc:
                dropped = True
                log.info("client.socket_dropped", url=self.url, code=_close_code(exc))
            except ResumeLater as exc:
                dropped = True
                log.info("client.resume_later", url=self.url, retry_after_ms=exc.retry_after_ms)
                await asyncio.sleep((exc.retry_after_ms or 500) / 1000)
            finally:
                if not dropped and not self.state.finished:
                    # Left early (break, an error, a cancelled task): stop the request.
                    self._cancelled = True
                    await self._send_cancel()
                self._ws = None
                await ws.close()
            self.reconnects += 1

    def _opening(self) -> dict[str, Any]:
        if self.state.accepted:
            return self.state.resume_frame()
        return self.state.request_frame(self._body)

    def _finish(self) -> None:
        end = self.state.end
        if isinstance(end, ErrorFrame):
            if end.code == ErrorCode.cancelled and self._cancelled:
                return
            raise ChatError(end.code.value, end.message, end.retry_after_ms)

    async def _connect(self) -> ClientConnection:
        """A socket to the edge serving the stream, or the next ones in turn."""
        if self._trouble_since is None:
            self._trouble_since = time.monotonic()
        deadline = self._trouble_since + self._reconnect_timeout_s
        order = [self.url] if self.reconnects == 0 else reconnect_order(self._urls, self.url)
        pause = 0.05
        last: Exception | None = None
        while time.monotonic() < deadline:
            for url in order:
                try:
                    ws = await websockets.connect(
                        url, additional_headers=self._headers, open_timeout=self._open_timeout_s
                    )
                except InvalidStatus as exc:
                    if exc.response.status_code in _FINAL_STATUSES:
                        body = (
                            exc.response.body.decode(errors="replace") if exc.response.body else ""
                        )
                        raise ChatError(
                            ErrorCode.unauthorized.value
                            if exc.response.status_code in (401, 403)
                            else ErrorCode.invalid_request.value,
                            f"{url}: HTTP {exc.response.status_code} {body}".strip(),
                        ) from exc
                    last = exc
                except (OSError, TimeoutError, InvalidHandshake) as exc:
                    # Refused, timed out, or the edge died in the handshake: try the next.
                    last = exc
                else:
                    if url != self.url:
                        log.info("client.reconnected", url=url, previous=self.url)
                    self.url = url
                    self._ws = ws
                    return ws
            order = reconnect_order(self._urls, self.url)
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 2.0)
        raise ConnectionLost(
            f"no edge of {self._urls} answered within {self._reconnect_timeout_s} s: {last!r}"
        )


def _close_code(exc: ConnectionClosed) -> int | None:
    return exc.rcvd.code if exc.rcvd is not None else None


__all__ = ["ChatError", "ChatStream", "ConnectionLost", "StreamBroken"]
