"""The ingest process: requests in, tier topics or the DLQ out, every record once.

Wiring only: the clients, the handling (handling.py) and the read loop (reader.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from aiokafka.admin import AIOKafkaAdminClient

from services.ingest.handling import Ingest
from services.ingest.reader import RequestReader
from services.ingest.response_cache import CacheFollower, ResponseCache
from services.ingest.settings import IngestSettings
from services.ingest.telemetry import IngestTelemetry
from shared.health import Ready
from shared.kafka import make_admin, make_consumer, make_producer, wait_for_broker
from shared.process import for_life
from shared.producers import RenewingProducer
from shared.topics import Topics

log = structlog.get_logger()


async def serve(settings: IngestSettings, built: Callable[[Ready], None] = lambda _: None) -> None:
    """Wait for the broker, build the clients, run until cancelled (SIGTERM/SIGINT); `built`
    is shown the request reader before it runs (its readiness is what `/readyz` answers)."""
    while True:
        try:
            await wait_for_broker(settings, timeout_s=60)
            break
        except TimeoutError as exc:
            log.warning("broker.unreachable", error=str(exc))
    topics = Topics(settings.topic_prefix)
    admin = make_admin(settings, client_id="ingest-admin")
    # Renewed if an outage breaks its sequence numbers (shared/producers.py).
    producer = RenewingProducer(
        lambda: make_producer(
            settings, client_id="ingest", request_timeout_ms=settings.ingest_publish_timeout_ms
        )
    )
    consumer = make_consumer(
        settings,
        group_id=f"{settings.topic_prefix}.ingest",
        client_id="ingest",
        long_poll=True,
    )
    # Reads the tier topics' and the DLQ's tails back at each assignment (memory.py): one
    # for the process's life, so no TLS connection is closed mid-response per recall.
    tails = make_consumer(settings, group_id=None, client_id="ingest-recall")
    async with contextlib.AsyncExitStack() as stack:
        await admin.start()
        stack.push_async_callback(admin.close)
        await producer.start()
        stack.push_async_callback(producer.stop)
        follower = _cache_follower(settings, admin, topics)
        if follower is not None:
            # Loaded before the first request is read: a restarted ingest hits at once.
            await follower.load()
        cache = follower.cache if follower is not None else None
        await tails.start()
        stack.push_async_callback(tails.stop)
        telemetry = IngestTelemetry(topics.requests)
        ingest = Ingest(settings, producer, admin, telemetry, cache, tails=tails)
        reader = RequestReader(consumer, ingest, settings.ingest_commit_interval_ms / 1000)
        built(reader)
        # The shared topic and each configured application's own (ADR 0044).
        consumer.subscribe([topics.requests, *ingest.apps.topics], listener=reader.listener())
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        log.info("ingest.started", cache=cache is not None, apps=list(settings.apps))
        async with asyncio.TaskGroup() as tasks:
            if follower is not None:
                tasks.create_task(for_life("cache follower", follower.follow()))
            tasks.create_task(for_life("request reader", reader.run()))


def _cache_follower(
    settings: IngestSettings, admin: AIOKafkaAdminClient, topics: Topics
) -> CacheFollower | None:
    """The response cache and its reader of the cache topic; None when the cache is off."""
    if not settings.ingest_cache:
        return None
    cache = ResponseCache(
        settings.ingest_cache_max_entries,
        settings.ingest_cache_max_bytes,
        max_age_s=settings.cache_retention_ms / 1000,
    )
    # Assigned and sought once, at start: a new cache entry ends the long poll at once.
    consumer = make_consumer(settings, group_id=None, client_id="ingest-cache", long_poll=True)
    return CacheFollower(cache, consumer, admin, topics.cache)
