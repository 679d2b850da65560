"""Real clients of a stack for tests: the WebSocket chat client (sends frames, collects each
request's stream; `check_complete` holds a stream to the sim engine's answer), the `openai`
SDK on the stack's OpenAI API, and a reader of its streams' server-sent events."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from services.worker.engines.sim_text import complete
from tests.stack import Stack


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

    @property
    def final_attempt(self) -> list[dict[str, Any]]:
        """The frames of the last attempt: everything after the last `chat.reset`."""
        resets = [i for i, f in enumerate(self.frames) if f["type"] == "chat.reset"]
        return self.frames[resets[-1] + 1 :] if resets else self.frames

    @property
    def resets(self) -> list[int]:
        """The attempt each `chat.reset` started, in order (empty: the first attempt ran)."""
        return [f["attempt"] for f in self.frames if f["type"] == "chat.reset"]


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


class ChatSession:
    """One socket with requests sent over time; frames filed as they arrive (any order)."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.by_client: dict[str, Transcript] = {}
        self._by_request: dict[str, Transcript] = {}
        self.ended: list[str] = []  # client ids in the order their streams ended

    async def send(self, request: dict[str, Any]) -> None:
        self.by_client[request["client_id"]] = Transcript(client_id=request["client_id"])
        await self.ws.send(json.dumps({"type": "chat.request", **request}))

    async def until(self, done: Any, within: float = 30) -> None:
        """Read frames until `done()` is true; fail after `within` seconds."""

        async def pump() -> None:
            while not done():
                frame = await recv_json(self.ws, within)
                if frame["type"] == "chat.accepted":
                    t = self.by_client[frame["client_id"]]
                    t.request_id = frame["request_id"]
                    self._by_request[frame["request_id"]] = t
                else:
                    t = self._by_request[frame["request_id"]]
                t.frames.append(frame)
                if frame["type"] in ("chat.done", "error") and t.client_id is not None:
                    self.ended.append(t.client_id)

        await asyncio.wait_for(pump(), within)

    def all_ended(self) -> bool:
        return len(self.ended) >= len(self.by_client)


async def upgrade_status(url: str, **kwargs: Any) -> int:
    """The HTTP status the server answers a WebSocket upgrade with (101: accepted)."""
    try:
        async with websockets.connect(url, open_timeout=20, **kwargs):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


async def close_of(ws: websockets.ClientConnection, timeout: float = 30) -> tuple[int, str]:
    """Read (and drop) frames until the server closes; its close code and reason."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed as exc:
        closed = exc.rcvd
    if closed is None:
        raise AssertionError("closed without a close frame from the server")
    return closed.code, closed.reason


def bearer(stack: Stack, tenant: str) -> dict[str, Any]:
    """`websockets.connect` arguments that send `tenant`'s key as a bearer token (to a URL
    without credentials: `stack.ws_url_as(None)`)."""
    return {"additional_headers": {"Authorization": f"Bearer {stack.keys[tenant]}"}}


def openai_sdk(stack: Stack, tenant: str = "default", port: int | None = None) -> openai.OpenAI:
    """The `openai` SDK on the OpenAI API of the stack's edge (or the edge on `port`) as
    `tenant`: no retries, so a test sees every error; 60 s for an answer. It keeps no
    connection open between requests: a client a test does not close (and one an error's
    traceback holds) then leaves no socket to the collector, whose warning would fail
    whichever later test it came in (stop 47's clean clones, twice)."""
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port or stack.edge_port}/v1",
        api_key=stack.keys[tenant],
        max_retries=0,
        timeout=60,
        http_client=openai.DefaultHttpxClient(limits=httpx.Limits(max_keepalive_connections=0)),
    )


def served_models(stack: Stack) -> list[str]:
    """The ids of the models the stack's edge lists on `/v1/models` now."""
    return [m.id for m in openai_sdk(stack).models.list()]


def check_complete(t: Transcript, request: dict[str, Any]) -> None:
    """One acceptance, one final chat.done, and the last attempt is the sim engine's whole
    answer to `request`, in order."""
    assert [f["type"] for f in t.frames].count("chat.accepted") == 1, t.frames
    assert t.final is not None, t.frames[-3:]
    assert t.final["type"] == "chat.done", t.frames[-3:]
    assert t.frames[-1] is t.final
    last = t.final_attempt
    deltas = [f for f in last if f["type"] == "chat.delta"]
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))
    plan = complete(request["prompt"], request["max_tokens"])
    assert "".join(d["text"] for d in deltas) == plan.text
    assert t.final["usage"]["completion_tokens"] == plan.completion_tokens


def sse_events(chunks: list[bytes]) -> list[tuple[str | None, object]]:
    """(id, data) of each server-sent event in `chunks` (one event a chunk, as the edge writes
    them); data is parsed JSON, or the `[DONE]` marker as a string."""
    out: list[tuple[str | None, object]] = []
    for chunk in chunks:
        fields = dict(line.split(": ", 1) for line in chunk.decode().strip().split("\n"))
        data = fields["data"]
        out.append((fields.get("id"), data if data == "[DONE]" else json.loads(data)))
    return out


def sse_data(chunks: list[bytes]) -> list[dict[str, Any]]:
    """The JSON object each server-sent event in `chunks` carries, the `[DONE]` marker left out."""
    out: list[dict[str, Any]] = []
    for _, data in sse_events(chunks):
        if data != "[DONE]":
            assert isinstance(data, dict), data
            out.append(data)
    return out
