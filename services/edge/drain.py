"""The edge's drain: what SIGTERM does (issue 38, item 3: rolling upgrades).

Before, SIGTERM cut every connection at once: WebSocket clients resumed elsewhere, but an
OpenAI SDK stream failed and the SDK sent a non-streaming call again as a new request. Now
the first SIGTERM (or SIGINT) drains: `/readyz` turns 503 so the load balancer sends no
more, new requests and resumes are refused `overloaded` (with the retry hint: the client
goes to another edge), and the streams in flight are served on for up to `edge_drain_s`.
Whatever is still attached then is let go of as a restart requires (`Client.drain`): a
socket closes 1012 (service restart) and resumes elsewhere, an SSE stream ends with an
`edge_restarting` event naming the event to go on from (`Last-Event-ID`), a whole answer
still running is refused 503 and its request cancelled, so the client's retry is its one
run. Then uvicorn shuts down as before. A second signal, or a lost lease (another edge may
own the results partition), stops the edge at once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import structlog
import uvicorn

from services.edge.streams import Client

log = structlog.get_logger()

POLL_S = 0.1  # how often the drain looks whether streams are still attached
# After the clients are let go of: their last events and close frames go out before uvicorn
# closes the connections.
LET_GO_S = 0.5


class Drained(Protocol):
    """What the drain needs of the edge's gateway."""

    draining: bool

    def attached(self) -> list[Client]: ...


async def drain(gateway: Drained, within_s: float) -> int:
    """Take no new work, wait up to `within_s` for the attached streams to end, then let go
    of the clients still attached; how many there were."""
    gateway.draining = True
    attached = gateway.attached()
    log.info("edge.draining", clients=len(attached), within_s=within_s)
    deadline = time.monotonic() + within_s
    while attached and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        attached = gateway.attached()
    for client in attached:
        client.drain()
    if attached:
        await asyncio.sleep(LET_GO_S)
    log.info("edge.drained", let_go=len(attached))
    return len(attached)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains the edge before it stops.

    `start_drain` is the edge's: it returns the drain to await, or None where the edge must
    stop at once (no gateway: it is starting, or lost its lease).
    """

    def __init__(
        self, config: uvicorn.Config, start_drain: Callable[[], asyncio.Task[int] | None]
    ) -> None:
        super().__init__(config)
        self._start_drain = start_drain
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None  # kept: a task held by no one may go

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self.should_exit or sig not in _DRAINED_BY:
            super().handle_exit(sig, frame)  # a second signal: at once
            return
        # A signal handler may run in the middle of the loop's own work: the drain starts
        # from the loop's next turn.
        asyncio.get_running_loop().call_soon_threadsafe(self._begin, sig)
        self._draining = True

    def _begin(self, sig: int) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: int) -> None:
        try:
            if (running := self._start_drain()) is not None:
                await running
        finally:
            super().handle_exit(sig, None)


_DRAINED_BY = frozenset({signal.SIGTERM, signal.SIGINT})
