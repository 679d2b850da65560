"""The edge's broker probe (`BrokerLink._ask_nodes`) tells a broker away from its own busy loop.

Fakes stand in for the producer's cluster view and the one-node asks: what is under test is
the judgement alone. (Chaos seed 294815970: an edge busy with 700 resumes in 15 s saw all
three nodes time out on a 1.5 s metadata ask, called the broker away, and refused 38 new
requests while every node was up.)
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from services.edge import broker_link
from services.edge.broker_link import BrokerLink


class FakeCluster:
    def brokers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(host="127.0.0.1", port=port) for port in (1, 2, 3)]


def _link(ask: object) -> BrokerLink:
    link = object.__new__(BrokerLink)
    link.producer = SimpleNamespace(client=SimpleNamespace(cluster=FakeCluster()))  # type: ignore[assignment]
    link._edge_id = "edge-test"
    link._ask = ask  # type: ignore[assignment,method-assign]
    return link


def test_nodes_that_never_answer_on_a_free_loop_are_the_broker_away() -> None:
    async def never(host: str, port: int) -> None:
        await asyncio.sleep(60)

    async def scenario() -> None:
        began = time.monotonic()
        assert await _link(never)._ask_nodes() is False
        assert time.monotonic() - began < broker_link.PROBE_TIMEOUT_S + 1.0

    asyncio.run(scenario())


def test_a_probe_while_the_edges_loop_is_held_up_is_undecided_not_away() -> None:
    async def held_up(host: str, port: int) -> None:
        await asyncio.sleep(0.2)
        # The loop's other work, while the asks wait: three of them hold it 0.9 s in all.
        time.sleep(0.3)  # noqa: ASYNC251 - blocking the loop is the point
        await asyncio.sleep(60)

    async def scenario() -> None:
        assert await _link(held_up)._ask_nodes() is True

    asyncio.run(scenario())
