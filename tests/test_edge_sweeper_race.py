"""The result-topic sweeper when a topic goes away between its listing and its look, on a
real broker: the round ends in seconds, not at aiokafka's 40 s request timeout (issue 36's
shared-stack run found it: a round stalled, and a stream that ended meanwhile was swept)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from services.edge.metrics import EdgeMetrics
from services.edge.sweeper import LOOK_TIMEOUT_S, TopicSweeper
from shared.kafka import create_topics, delete_topics, make_admin, make_producer
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.stack import new_prefix


class ListedBefore:
    """The real admin client, whose first listing was taken before a topic was deleted."""

    def __init__(self, admin: Any, listing: list[str]) -> None:
        self.admin, self.listing = admin, listing

    async def list_topics(self) -> list[str]:
        listing, self.listing = self.listing, []
        return listing or list(await self.admin.list_topics())

    async def delete_topics(self, names: list[str]) -> Any:
        return await self.admin.delete_topics(names)


def test_a_topic_deleted_after_the_listing_does_not_stall_the_round(bootstrap: str) -> None:
    settings = TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=new_prefix())
    topics = Topics(settings.topic_prefix)
    live, gone = (topics.request_results(uuid.uuid4().hex) for _ in range(2))

    async def scenario() -> tuple[list[str], float]:
        await create_topics(settings, {live: 1, gone: 1})
        producer = make_producer(settings, client_id="sweeper-race")
        await producer.start()
        try:
            await producer.send_and_wait(live, b"a record written just now")
        finally:
            await producer.stop()
        admin = make_admin(settings)
        await admin.start()
        try:
            listing = list(await admin.list_topics())
            assert {live, gone} <= set(listing)
            await delete_topics(settings, [gone])  # between the listing and the look
            sweeper = TopicSweeper(
                ListedBefore(admin, listing),  # type: ignore[arg-type]
                settings,
                topics,
                mine=lambda topic: False,
                metrics=EdgeMetrics(),
                orphan_after_s=60,
                interval_s=1,
            )
            began = time.monotonic()
            swept = await sweeper.sweep(time.time())
            return swept, time.monotonic() - began
        finally:
            await admin.close()
            await delete_topics(settings, [live])

    swept, took = asyncio.run(scenario())
    assert swept == []  # the live topic was written just now: kept
    assert took < 2 * LOOK_TIMEOUT_S + 5, took
