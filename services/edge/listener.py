"""The edge's HTTP/WebSocket listener: uvicorn with limits on what a connection may hold.

uvicorn (0.54) bounds a connection's request head in size (`h11_max_incomplete_event_size`)
and an idle keep-alive connection in time, and the number of connections and requests
(`limit_concurrency`, answered 503); it bounds no head in time: a client that trickles its
head a byte at a time (slowloris) held its connection for ever; nor a write in time: a
client that stops reading an SSE stream held it, its buffers and its place among the
connections for ever. `TimedProtocol` adds both timeouts to uvicorn's h11 protocol (ADR 0045),
and a bound on the connections one client address holds at once (`max_per_ip`: its idle
keep-alive and WebSocket connections count, which no request-level limit sees; issue 37, N10).
It also sets each connection's kernel send buffer (`send_buffer_bytes`): the kernel's own
tuning grows it to 4 MB, which a client reading slowly fills before any frame of its queues
where the edge weighs it (issue 37, N1).
"""

from __future__ import annotations

import asyncio
import socket
import weakref
from typing import Any, ClassVar, cast

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.edge.settings import EdgeSettings
from services.edge.ws_protocol import ws_protocol_class

log = structlog.get_logger()


class TimedProtocol(H11Protocol):
    """uvicorn's h11 protocol, dropping a connection whose request head is not whole in time,
    or whose client does not take what is written to it in time.

    The head's clock runs while the connection waits for a head: from its start, and from
    the end of each answer (a keep-alive connection's next request); it stops when h11 has
    read a whole head (the request's body, an upgrade's WebSocket, have their own limits).
    The write's clock runs while the transport's buffer is above its high-water mark (the
    client reads nothing, its TCP window is shut); past it the connection is aborted, not
    closed (a close waits for the buffer to drain, which a non-reader never lets happen),
    and the app's `receive` says `http.disconnect`: the SSE answer lets go of its stream.
    """

    header_timeout_s: float = 10.0  # set by `protocol_class`
    write_timeout_s: float = 10.0
    max_per_ip: int = 0  # 0: no limit
    send_buffer_bytes: int = 0  # 0: the kernel's tuning
    # Client address -> its open connections' transports (one map per `protocol_class`, so
    # per server). Weak: a transport leaves with its connection, whether it stayed HTTP or
    # was handed to a WebSocket protocol (whose loss this protocol never hears of).
    open_by_ip: ClassVar[dict[str, weakref.WeakSet[asyncio.BaseTransport]]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._header_deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None
        if self.max_per_ip and not self._admitted(cast(asyncio.Transport, transport)):
            return
        if self.send_buffer_bytes and (sock := transport.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        self._await_head()

    def _admitted(self, transport: asyncio.Transport) -> bool:
        """Count the connection against its address; drop it if that is over its bound."""
        ip = self.client[0] if self.client else ""
        held = self.open_by_ip.setdefault(ip, weakref.WeakSet())
        for other in [t for t in held if t.is_closing()]:
            held.discard(other)
        if len(held) >= self.max_per_ip:
            log.info("listener.too_many_from_address", held=len(held), limit=self.max_per_ip)
            transport.abort()
            return False
        held.add(transport)
        if len(self.open_by_ip) > 4 * self.max_per_ip + 1024:  # forget addresses gone quiet
            for address in [a for a, ts in self.open_by_ip.items() if not ts]:
                del self.open_by_ip[address]
        return True

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.write_timeout_s, self._not_reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _not_reading(self) -> None:
        self._write_deadline = None
        if self.flow.write_paused:  # nothing taken since it filled up
            log.info("listener.write_timeout", timeout_s=self.write_timeout_s)
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_read():
            self._stop_clock()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None
        super().connection_lost(exc)

    def _head_read(self) -> bool:
        return self.conn.their_state is not h11.IDLE

    def _await_head(self) -> None:
        self._stop_clock()
        if not self.transport.is_closing() and not self._head_read():
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _stop_clock(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _too_slow(self) -> None:
        self._header_deadline = None
        if not self._head_read() and not self.transport.is_closing():
            self.transport.close()


def protocol_class(
    header_timeout_s: float,
    write_timeout_s: float,
    max_per_ip: int = 0,
    send_buffer_bytes: int = 0,
) -> type[TimedProtocol]:
    """`TimedProtocol` with these bounds (uvicorn builds its protocol from a class)."""
    bounds = {
        "header_timeout_s": header_timeout_s,
        "write_timeout_s": write_timeout_s,
        "max_per_ip": max_per_ip,
        "send_buffer_bytes": send_buffer_bytes,
        "open_by_ip": {},
    }
    return type("TimedProtocol", (TimedProtocol,), bounds)


def uvicorn_options(settings: EdgeSettings) -> dict[str, Any]:
    """What `uvicorn.Config` takes from the edge's settings: where it listens, its limits."""
    return {
        "host": settings.edge_host,
        "port": settings.edge_port,
        "http": protocol_class(
            settings.edge_header_timeout_s,
            settings.edge_http_write_timeout_s,
            settings.edge_max_connections_per_ip,
            settings.edge_send_buffer_bytes,
        ),
        "h11_max_incomplete_event_size": settings.edge_max_header_bytes,
        "timeout_keep_alive": settings.edge_keep_alive_timeout_s,
        "limit_concurrency": settings.edge_max_connections,
        # Read frames up to 4x the answered limit, so an oversized frame of an authenticated
        # socket gets a polite invalid_request instead of a closed socket; before the key,
        # each at most edge_max_unauthenticated_frame_bytes: a larger one closes the socket
        # by its header, unread. A message being received counts against the same budget
        # and has the same time as an HTTP body (ws_protocol.py).
        "ws_max_size": settings.edge_max_frame_bytes * 4,
        "ws": ws_protocol_class(
            settings.edge_max_unauthenticated_frame_bytes,
            settings.edge_body_timeout_s,
            settings.edge_body_budget_bytes,
        ),
    }
