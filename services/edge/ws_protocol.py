"""The edge's WebSocket protocol: uvicorn's websockets-sansio one, holding a socket without
its key to one small message at a time (issue 37, N10).

uvicorn's protocol parses every frame of what it reads, each up to `ws_max_size` (4 MiB
here): before this class, a socket with no key could send 4 MiB frames, each received
whole before the edge's 4 KiB check before the key (`chat_socket.py`) refused it. Until
the app says the socket is authenticated (`widen`, handed to it in the ASGI scope's
extensions under `WIDEN`), this protocol

- lets each message be at most `pre_auth_bytes` (a larger frame's header closes the socket
  with 1009, before its payload is read);
- hands the conn one message and holds the bytes that follow until the app has read that
  message, so a key sent in an `auth` frame applies to the very next frame, even when the
  client sent both in one write (the chat page does);
- holds at most `max_held_bytes` of them, and stops reading the socket past that.

Once widened, it is uvicorn's protocol with `ws_max_size`, unchanged.
"""

from __future__ import annotations

from typing import Any, ClassVar

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

# The ASGI scope extension whose "widen" the app calls, with no argument, once the socket
# has its key.
WIDEN = "tokenbus.widen"
_DATA_OPCODES = frozenset({0x0, 0x1, 0x2})  # continuation, text, binary


def frame_header(data: bytes | bytearray) -> tuple[int, int, int, bool] | None:
    """(header length, payload length, opcode, fin) of the frame `data` starts with; None
    if its header is not whole yet (RFC 6455, 5.2)."""
    if len(data) < 2:
        return None
    fin, opcode, masked, length = data[0] & 0x80, data[0] & 0x0F, data[1] & 0x80, data[1] & 0x7F
    at = 2
    if length == 126:
        if len(data) < 4:
            return None
        length, at = int.from_bytes(data[2:4], "big"), 4
    elif length == 127:
        if len(data) < 10:
            return None
        length, at = int.from_bytes(data[2:10], "big"), 10
    if masked:
        at += 4
    if len(data) < at:
        return None
    return at, length, opcode, bool(fin)


class GatedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sansio WebSocket protocol, one bounded message at a time until `widen`."""

    pre_auth_bytes: ClassVar[int] = 4096  # set by `ws_protocol_class`
    max_held_bytes: ClassVar[int] = 65536

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._full_size = self.conn.max_message_size
        self.conn.max_message_size = self.pre_auth_bytes
        self._wide = False
        self._held = bytearray()  # read, not yet handed to the conn
        self._frame_left = 0  # bytes of the frame being handed over still to come
        self._ends_message = False  # that frame is the last of a data message
        self._message_bytes = 0  # payload of the data message being handed over so far
        self._waiting = False  # a whole message is with the app: hold what follows
        self._held_paused = False

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if not self.close_sent:
            # An ASGI extension is a dict: this one holds the call.
            self.scope["extensions"][WIDEN] = {"widen": self.widen}

    def widen(self) -> None:
        """The socket has its key: messages up to `ws_max_size`, read as uvicorn reads them."""
        if self._wide:
            return
        self._wide = True
        self.conn.max_message_size = self._full_size
        held, self._held = bytes(self._held), bytearray()
        self._resume_held()
        if held and not self.transport.is_closing():
            super().data_received(held)

    def data_received(self, data: bytes) -> None:
        if self._wide or not self.handshake_initiated:
            super().data_received(data)  # the upgrade request, or a socket with its key
            return
        self._held += data
        self._hand_over()

    async def receive(self) -> Any:
        if self._waiting and self.queue.empty():  # the app has read the message it was given
            self._waiting = False
            self._hand_over()
        return await super().receive()

    def _hand_over(self) -> None:
        """Give the conn the held bytes up to the end of the next whole message."""
        while self._held and not self._waiting and not self._wide:
            if self.close_sent or self.transport.is_closing():
                self._held.clear()
                return
            if self._frame_left == 0:
                header = frame_header(self._held)
                if header is None:
                    break  # its header is not whole yet
                at, length, opcode, fin = header
                self._frame_left = at + length
                self._ends_message = False
                if opcode in _DATA_OPCODES:
                    self._message_bytes += length
                    self._ends_message = fin
                    if self._message_bytes > self.pre_auth_bytes:
                        # The conn refuses it by its header (1009) and closes: no payload read.
                        self._frame_left = 0
                        super().data_received(bytes(self._held[:at]))
                        self._held.clear()
                        return
            n = min(self._frame_left, len(self._held))
            chunk = bytes(self._held[:n])
            del self._held[:n]
            self._frame_left -= n
            if self._frame_left == 0 and self._ends_message:
                self._waiting = True
                self._message_bytes = 0
            super().data_received(chunk)
        if len(self._held) > self.max_held_bytes:  # again after any resume of uvicorn's
            self._held_paused = True
            self.transport.pause_reading()
        elif self._held_paused:
            self._resume_held()

    def _resume_held(self) -> None:
        if self._held_paused:
            self._held_paused = False
            if not self.read_paused:
                self.transport.resume_reading()


def ws_protocol_class(pre_auth_bytes: int) -> type[GatedWebSocketProtocol]:
    """`GatedWebSocketProtocol` with this bound (uvicorn builds its protocol from a class)."""
    bounds = {"pre_auth_bytes": pre_auth_bytes}
    return type("GatedWebSocketProtocol", (GatedWebSocketProtocol,), bounds)
