"""uvicorn's WebSocket protocol, writing the frames sent in one loop turn with one write.

uvicorn's `websockets-sansio` protocol (its default) writes every `websocket.send` to the
transport at once: one socket write (a syscall) per WebSocket message. The edge's socket
writer sends every frame a fetch of results queued for the connection in one go, so here a
`websocket.send` only adds its frame to the `websockets` connection's output, and the output
is written once, at the end of the loop turn. Every frame is still its own WebSocket message
(the client protocol is unchanged); only the number of transport writes changes.

Ordering holds: every write of the connection (a close, a keepalive ping, a pong) takes all
pending output from the connection (`data_to_send`) in the order it was produced, so a frame
waiting for the turn's write goes out before anything produced after it. Flow control holds:
a send still waits while the transport is paused (`writable`), and at most one loop turn of
frames is held (bounded by the socket's outbox).
"""

from __future__ import annotations

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState


class CoalescingWebSocketsProtocol(WebSocketsSansIOProtocol):
    """`WebSocketsSansIOProtocol` with one transport write per loop turn for data frames.

    Pass as uvicorn's `ws` option. Everything but a data frame on an open connection
    (the handshake, a close, a refusal) is uvicorn's own `send`.
    """

    _flush_pending = False

    async def send(self, message: ASGISendEvent) -> None:
        if (
            message["type"] != "websocket.send"
            or not self.handshake_complete
            or self.close_sent
            or self.initial_response is not None
        ):
            await super().send(message)
            return
        await self.writable.wait()
        if self.disconnected:
            raise ClientDisconnected()
        if self.close_sent:  # closed while this send waited for the transport
            await super().send(message)
            return
        try:
            if (binary := message.get("bytes")) is not None:
                self.conn.send_binary(binary)
            elif (text := message.get("text")) is not None:
                self.conn.send_text(text.encode())
        except InvalidState:
            raise ClientDisconnected() from None
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write what the connection holds: the frames of this loop turn, in order."""
        self._flush_pending = False
        output = self.conn.data_to_send()
        if output and not self.transport.is_closing():
            self.transport.write(b"".join(output))
