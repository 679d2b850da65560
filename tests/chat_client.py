"""A real WebSocket chat client for tests: sends frames, collects each request's stream."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import websockets


@dataclass
class Transcript:
    """Everything the server sent about one request, in arrival order."""

    client_id: str | None = None
    request_id: str | None = None
    frames: list[dict[str, Any]] = field(default_factory=list)

    @property
    def accepted(self) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == "chat.accepted"]

    @property
    def deltas(self) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == "chat.delta"]

    @property
    def text(self) -> str:
        return "".join(f["text"] for f in self.deltas)

    @property
    def final(self) -> dict[str, Any] | None:
        ends = [f for f in self.frames if f["type"] in ("chat.done", "error")]
        return ends[-1] if ends else None


async def recv_json(ws: websockets.ClientConnection, timeout: float = 30) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    return frame


async def run_requests(
    ws: websockets.ClientConnection, requests: list[dict[str, Any]], timeout: float = 60
) -> dict[str, Transcript]:
    """Send every request at once; return transcripts by client_id when all have ended."""
    by_client = {r["client_id"]: Transcript(client_id=r["client_id"]) for r in requests}
    by_request: dict[str, Transcript] = {}
    for r in requests:
        await ws.send(json.dumps({"type": "chat.request", **r}))
    open_ = set(by_client)

    async def pump() -> None:
        while open_:
            frame = await recv_json(ws, timeout)
            if frame["type"] == "chat.accepted":
                t = by_client[frame["client_id"]]
                t.request_id = frame["request_id"]
                by_request[frame["request_id"]] = t
            elif frame.get("request_id") in by_request:
                t = by_request[frame["request_id"]]
            elif frame.get("client_id") in by_client:
                t = by_client[frame["client_id"]]
            else:
                raise AssertionError(f"frame for no known request: {frame}")
            t.frames.append(frame)
            if frame["type"] in ("chat.done", "error"):
                open_.discard(t.client_id)

    await asyncio.wait_for(pump(), timeout)
    return by_client
