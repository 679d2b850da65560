"""The edge's drain, its pure parts (services/edge/drain.py): the streams in flight are
waited for within the bound, then what is still attached is let go of; an SSE stream let
go of says where it stands, whether event ids were asked for or not."""

from __future__ import annotations

import json

from services.edge.drain import drain
from services.edge.openai.sse import EventId
from services.edge.openai.translate import Identity, SseStream
from services.edge.protocol import DeltaFrame


class FakeClient:
    """A client the drain may let go of (`drain` counts the calls)."""

    def __init__(self) -> None:
        self.drained = 0

    def send(self, frame: object, stream: object = None) -> None:
        raise AssertionError("the drain sends no frame itself")

    def drain(self) -> None:
        self.drained += 1


class FakeGateway:
    """Its clients end one by one: one leaves at each look, until `stay` are left."""

    def __init__(self, clients: list[FakeClient], stay: int = 0) -> None:
        self.draining = False
        self.clients = clients
        self.stay = stay

    def attached(self) -> list[FakeClient]:
        if len(self.clients) > self.stay:
            self.clients = self.clients[1:]
        return list(self.clients)


async def test_streams_that_end_within_the_bound_are_let_be() -> None:
    clients = [FakeClient() for _ in range(3)]
    gateway = FakeGateway(list(clients))
    assert await drain(gateway, within_s=5.0) == 0  # type: ignore[arg-type]
    assert gateway.draining
    assert [c.drained for c in clients] == [0, 0, 0]


async def test_streams_still_attached_at_the_bound_are_let_go_of_once() -> None:
    clients = [FakeClient() for _ in range(3)]
    gateway = FakeGateway(list(clients), stay=2)
    assert await drain(gateway, within_s=0.3) == 2  # type: ignore[arg-type]
    assert [c.drained for c in clients] == [0, 1, 1]


def test_an_sse_stream_let_go_of_names_its_last_event_without_ids_asked() -> None:
    sse = SseStream(Identity("chat", "r1", "m", 0), False, event_ids=False)
    for seq, text in enumerate(["The ", "bus "]):
        sse.take(DeltaFrame(request_id="r1", seq=seq, text=text))
    [marker] = sse.restarting()
    lines = marker.decode().splitlines()
    assert lines[0] == f"id: {EventId(0, 1)}"
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert error["code"] == "edge_restarting"
    assert "Last-Event-ID: 0:1" in error["message"]
