"""The edge's WebSocket protocol: uvicorn's websockets-sansio one, handing its conn one
message at a time, bounded in size before the key and in bytes and time after it (issue 37,
N10 and N4).

uvicorn's protocol parses every frame of what it reads, each message up to `ws_max_size`
(4 MiB here). Before this class, a socket with no key could send 4 MiB frames, each read
whole before the edge's 4 KiB check before the key (`chat_socket.py`) refused it; and any
socket could hold an unfinished fragmented message of 4 MiB for as long as it stayed open,
as many of them as there were sockets. This protocol walks the frames' headers itself and

- hands the conn one message and holds the bytes that follow until the app has read it,
  at most `max_held_bytes` of them (past that it stops reading the socket): so a key sent
  in an `auth` frame applies to the very next frame, even one sent in the same write (the
  chat page does), and no socket queues messages faster than the app reads them;
- until the app says the socket has its key (`widen`, handed to it in the ASGI scope's
  extensions under `WIDEN`), lets a message be at most `pre_auth_bytes`: a larger frame's
  header closes the socket (1009) before its payload is read;
- counts every message being received against one budget for the listener's sockets
  together (`budget_bytes`), of which one tenant's sockets may hold an eighth (at least one
  whole message): past either the socket is closed 1013 (try again later); and gives a
  message `message_timeout_s` from its first frame to its last (else 1008).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from services.edge.budget import ByteBudget

# The ASGI scope extension whose "widen" the app calls with the tenant, once the socket has
# its key.
WIDEN = "tokenbus.widen"
_DATA_OPCODES = frozenset({0x0, 0x1, 0x2})  # continuation, text, binary
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013


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


class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sansio WebSocket protocol, one bounded message at a time."""

    # Set by `ws_protocol_class`, one budget per listener.
    pre_auth_bytes: ClassVar[int] = 4096
    message_timeout_s: ClassVar[float] = 30.0
    budget: ClassVar[ByteBudget] = ByteBudget(128 << 20)
    by_tenant: ClassVar[dict[str, int]] = {}  # tenant -> bytes its sockets' messages hold
    max_held_bytes: ClassVar[int] = 65536

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._full_size = self.conn.max_message_size
        self.conn.max_message_size = self.pre_auth_bytes
        self._wide = False
        self._tenant = ""  # whose socket, once widened
        self._held = bytearray()  # read, not yet handed to the conn
        self._frame_left = 0  # bytes of the frame being handed over still to come
        self._ends_message = False  # that frame is the last of a data message
        self._message_bytes = 0  # payload of the data message being received so far
        self._message_deadline: asyncio.TimerHandle | None = None
        self._waiting = False  # a whole message is with the app: hold what follows
        self._held_paused = False

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if not self.close_sent:
            # An ASGI extension is a dict: this one holds the call.
            self.scope["extensions"][WIDEN] = {"widen": self.widen}

    def widen(self, tenant: str) -> None:
        """The socket has `tenant`'s key: its messages may be up to `ws_max_size`, and count
        against the tenant's share of the budget."""
        self._wide = True
        self._tenant = tenant
        self.conn.max_message_size = self._full_size

    @property
    def tenant_share(self) -> int:
        return max(self._full_size or 0, self.budget.limit // 8)

    def data_received(self, data: bytes) -> None:
        if not self.handshake_initiated or self.close_sent:
            # The upgrade request; or the closing handshake, which uvicorn completes when
            # the client's close frame comes back (held back, it never would).
            super().data_received(data)
            return
        self._held += data
        self._hand_over()

    async def receive(self) -> Any:
        if self._waiting and self.queue.empty():  # the app has read the message it was given
            self._waiting = False
            self._hand_over()
        return await super().receive()

    def connection_lost(self, exc: Exception | None) -> None:
        self._message_done()
        self._held.clear()
        super().connection_lost(exc)

    def _hand_over(self) -> None:
        """Give the conn the held bytes up to the end of the next whole message."""
        while self._held and not self._waiting:
            if self.close_sent:  # the app closed it: what is left is the closing handshake's
                held, self._held = bytes(self._held), bytearray()
                self._frame_left = 0
                super().data_received(held)
                return
            if self.transport.is_closing():
                self._held.clear()
                return
            if self._frame_left == 0 and not self._next_frame():
                break
            n = min(self._frame_left, len(self._held))
            chunk = bytes(self._held[:n])
            del self._held[:n]
            self._frame_left -= n
            if self._frame_left == 0 and self._ends_message:
                self._waiting = True  # until the app has read it (`receive`)
                self._message_done()
            super().data_received(chunk)
        if len(self._held) > self.max_held_bytes:  # again after any resume of uvicorn's
            self._held_paused = True
            self.transport.pause_reading()
        elif self._held_paused:
            self._held_paused = False
            if not self.read_paused:
                self.transport.resume_reading()

    def _next_frame(self) -> bool:
        """Read the next frame's header from the held bytes and admit it; False if it is not
        whole yet or the socket was closed for it."""
        header = frame_header(self._held)
        if header is None:
            return False
        at, length, opcode, fin = header
        self._frame_left, self._ends_message = at + length, False
        if opcode not in _DATA_OPCODES:
            return True  # a control frame: 125 bytes at most, the conn's own business
        limit = self.conn.max_message_size
        if limit is not None and self._message_bytes + length > limit:
            # The conn refuses it by its header (1009) and closes: no payload is read.
            self._frame_left = 0
            header_bytes = bytes(self._held[:at])
            self._held.clear()
            super().data_received(header_bytes)
            return False
        held = self.by_tenant.get(self._tenant, 0)
        if self._wide and held + length > self.tenant_share:
            self._refuse(CLOSE_TRY_AGAIN_LATER, "the tenant's sockets are sending too much at once")
            return False
        if not self.budget.take(length):
            self._refuse(CLOSE_TRY_AGAIN_LATER, "the edge is receiving too much at once")
            return False
        self.by_tenant[self._tenant] = held + length
        if self._message_deadline is None:
            self._message_deadline = self.loop.call_later(self.message_timeout_s, self._too_slow)
        self._message_bytes += length
        self._ends_message = fin
        return True

    def _message_done(self) -> None:
        """The message is whole (or the socket gone): its bytes leave the budget."""
        if self._message_bytes:
            self.budget.give(self._message_bytes)
            left = self.by_tenant.get(self._tenant, 0) - self._message_bytes
            if left > 0:
                self.by_tenant[self._tenant] = left
            else:
                self.by_tenant.pop(self._tenant, None)
        self._message_bytes = 0
        if self._message_deadline is not None:
            self._message_deadline.cancel()
            self._message_deadline = None

    def _too_slow(self) -> None:
        self._message_deadline = None
        self._refuse(
            CLOSE_POLICY_VIOLATION, f"a message not whole within {self.message_timeout_s:g} s"
        )

    def _refuse(self, code: int, reason: str) -> None:
        """Close the socket at once, as uvicorn does on a frame it cannot parse."""
        self._message_done()
        self._held.clear()
        self._frame_left = 0
        if self.close_sent or self.transport.is_closing():
            return
        self.conn.send_close(code, reason)
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.transport.close()


def ws_protocol_class(
    pre_auth_bytes: int, message_timeout_s: float, budget_bytes: int
) -> type[BoundedWebSocketProtocol]:
    """`BoundedWebSocketProtocol` with these bounds and a budget of its own (uvicorn builds
    its protocol from a class: one class per listener)."""
    bounds = {
        "pre_auth_bytes": pre_auth_bytes,
        "message_timeout_s": message_timeout_s,
        "budget": ByteBudget(budget_bytes),
        "by_tenant": {},
    }
    return type("BoundedWebSocketProtocol", (BoundedWebSocketProtocol,), bounds)
