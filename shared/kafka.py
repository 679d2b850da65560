"""Kafka client factories: every producer idempotent with acks=all, consumers commit by hand.

Also the one replication rule for every topic the deployment makes: min(3, brokers)
copies, and two of them in sync before an acks=all write succeeds once there are three.
tests/test_producer_factory.py fails when a producer is built anywhere but here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
    for_code,
)
from faststream.kafka import KafkaBroker
from faststream.types import BrokerMiddleware
from pydantic import BaseModel

from shared.settings import TokenbusSettings

Headers = list[tuple[str, bytes]]

# More copies than this buy little on one rack and cost every write a further round trip.
MAX_REPLICATION_FACTOR = 3


def make_producer(
    settings: TokenbusSettings, client_id: str, transactional_id: str | None = None
) -> AIOKafkaProducer:
    """An idempotent producer (acks=all): retries never duplicate or reorder a partition.

    With `transactional_id` it is also transactional; starting it fences an older producer
    that used the same id.
    """
    return AIOKafkaProducer(
        bootstrap_servers=settings.bootstrap_servers,
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        transactional_id=transactional_id,
        linger_ms=0,
        request_timeout_ms=30000,
    )


def make_faststream_broker(
    settings: TokenbusSettings,
    client_id: str,
    middlewares: Sequence[BrokerMiddleware[Any, Any]] = (),
) -> KafkaBroker:
    """A FastStream broker whose publisher is the same idempotent acks=all producer."""
    return KafkaBroker(
        # A list: FastStream hands a string on as one host, "a:1,b:2" included.
        [server.strip() for server in settings.bootstrap_servers.split(",") if server.strip()],
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        logger=None,
        middlewares=tuple(middlewares),
    )


def make_consumer(
    settings: TokenbusSettings,
    *topics: str,
    group_id: str | None,
    client_id: str,
    auto_offset_reset: str = "earliest",
    isolation_level: str = "read_uncommitted",
    **extra: object,
) -> AIOKafkaConsumer:
    """A consumer that never commits on its own: the owner commits what it has handed on."""
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=settings.bootstrap_servers,
        group_id=group_id,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        isolation_level=isolation_level,
        **extra,
    )


def encode(model: BaseModel) -> bytes:
    return model.model_dump_json(exclude_none=False).encode()


def key_of(request_id: str) -> bytes:
    return request_id.encode()


async def wait_for_broker(settings: TokenbusSettings, timeout_s: float = 60.0) -> None:
    """Poll the broker until it answers metadata requests, or raise after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except KafkaConnectionError as exc:
            last = exc
        finally:
            await admin.close()
        await asyncio.sleep(0.5)
    raise TimeoutError(f"Kafka at {settings.bootstrap_servers} did not answer: {last}")


def replication_factor(brokers: int) -> int:
    """How many copies a topic gets on a cluster of `brokers`."""
    return max(1, min(MAX_REPLICATION_FACTOR, brokers))


def min_insync_replicas(replication: int) -> int:
    """Copies an acks=all write must reach: two of three, so one broker may be lost."""
    return 2 if replication >= 3 else 1


async def cluster_replication(admin: AIOKafkaAdminClient) -> int:
    """The replication factor for topics made now: from the brokers the cluster lists."""
    cluster = await admin.describe_cluster()
    return replication_factor(len(cluster["brokers"]))


def new_topic(
    name: str, partitions: int, replication: int, configs: Mapping[str, str] | None = None
) -> NewTopic:
    """The one way a topic is described: its replication, min ISR, then its own configs."""
    topic_configs = {"min.insync.replicas": str(min_insync_replicas(replication))}
    topic_configs.update(configs or {})
    return NewTopic(
        name=name,
        num_partitions=partitions,
        replication_factor=replication,
        topic_configs=topic_configs,
    )


async def create_topics(
    settings: TokenbusSettings,
    partitions: Mapping[str, int],
    replication: int | None = None,
    configs: Mapping[str, Mapping[str, str]] | None = None,
) -> list[str]:
    """Create the topics that do not exist yet; return the names created.

    `replication` defaults to the cluster's rule (`cluster_replication`); `configs` holds
    topic configs by name (compaction, retention) for the topics that need any.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        copies = replication if replication is not None else await cluster_replication(admin)
        new = [
            new_topic(name, count, copies, (configs or {}).get(name))
            for name, count in partitions.items()
            if name not in existing
        ]
        if new:
            try:
                response = await admin.create_topics(new)
            except TopicAlreadyExistsError:
                return []  # Another process created them between list and create.
            _raise_topic_errors(response.topic_errors)
        return [t.name for t in new]
    finally:
        await admin.close()


def _raise_topic_errors(topic_errors: Iterable[tuple[object, ...]]) -> None:
    """The admin API reports per-topic failures in the response, not as exceptions."""
    failures = []
    for entry in topic_errors:
        name, code = entry[0], int(str(entry[1]))
        if code not in (0, TopicAlreadyExistsError.errno):
            detail = entry[2] if len(entry) > 2 and entry[2] else for_code(code).__name__
            failures.append(f"{name}: {detail}")
    if failures:
        raise KafkaError("could not create topics: " + "; ".join(failures))


async def delete_topics(settings: TokenbusSettings, names: Iterable[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        doomed = [n for n in names if n in existing]
        if doomed:
            await admin.delete_topics(doomed)
    finally:
        await admin.close()
