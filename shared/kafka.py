"""Kafka client factories: every producer idempotent with acks=all, consumers commit by hand."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
    for_code,
)
from pydantic import BaseModel

from shared.settings import TokenbusSettings

Headers = list[tuple[str, bytes]]


def make_producer(settings: TokenbusSettings, client_id: str) -> AIOKafkaProducer:
    """An idempotent producer (acks=all): retries never duplicate or reorder a partition."""
    return AIOKafkaProducer(
        bootstrap_servers=settings.bootstrap_servers,
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        linger_ms=0,
        request_timeout_ms=30000,
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


async def create_topics(
    settings: TokenbusSettings, partitions: Mapping[str, int], replication: int = 1
) -> list[str]:
    """Create the topics that do not exist yet; return the names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(name=name, num_partitions=count, replication_factor=replication)
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
