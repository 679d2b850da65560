"""Server CPU per WebSocket frame: uvicorn's protocol vs one transport write per loop turn.

A real uvicorn (uvloop) sends N delta-sized text frames, B per loop turn with one
`send_text` each (as the edge's socket writer does after a fetch); a `websockets` client in
this process reads them. The server's CPU (process_time over the sends) is printed per
frame. `coalescing` is the experiment of ADR 0039, kept here only: a subclass of uvicorn's
`websockets-sansio` protocol that adds a data frame to the connection's output and writes
the output once at the end of the loop turn (each frame still its own message). From the
repo root:

    B=8 .venv/bin/python docs/perf/ws_frame_cost.py sansio
    B=8 .venv/bin/python docs/perf/ws_frame_cost.py coalescing
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import sys
import time

import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from uvicorn._types import ASGISendEvent
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState

N = int(os.environ.get("N", "40000"))
B = int(os.environ.get("B", "8"))
FRAME = json.dumps({"type": "chat.delta", "request_id": "0" * 32, "seq": 12, "text": "tok " * 4})


class CoalescingWebSocketsProtocol(WebSocketsSansIOProtocol):
    """One transport write per loop turn for the data frames sent in it."""

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
        self._flush_pending = False
        output = self.conn.data_to_send()
        if output and not self.transport.is_closing():
            self.transport.write(b"".join(output))


async def endpoint(ws: WebSocket) -> None:
    await ws.accept()
    t0 = time.process_time()
    for _ in range(N // B):
        for _ in range(B):
            await ws.send_text(FRAME)
        await asyncio.sleep(0)  # the writer waits for the next fetch's frames
    await ws.send_text("end")
    cpu = time.process_time() - t0
    print(json.dumps({"ws": os.environ["WS"], "batch": B, "us_per_frame": round(1e6 * cpu / N, 2)}))
    await ws.receive()


def serve(port: int, kind: str) -> None:
    os.environ["WS"] = kind
    proto = CoalescingWebSocketsProtocol if kind == "coalescing" else "websockets-sansio"
    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    uvicorn.run(app, port=port, ws=proto, log_level="warning", loop="uvloop")


async def read_all(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            client = await websockets.connect(f"ws://127.0.0.1:{port}/ws", max_queue=None)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    count = 0
    async for message in client:
        if message == "end":
            break
        count += 1
    await client.close()
    assert count == N // B * B, count


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "sansio"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.Process(target=serve, args=(port, kind))
    server.start()
    try:
        asyncio.run(read_all(port))
        time.sleep(0.5)
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
