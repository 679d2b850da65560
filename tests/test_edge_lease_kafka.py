"""Result-partition leases on the real broker: distinct owners, release, lapse, take-back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from services.edge.lease_keeper import LeaseKeeper, LeaseLost, ensure_lease_topic
from shared.kafka import create_topics, delete_topics, make_admin, make_producer
from shared.settings import TokenbusSettings
from tests.stack import Stack, free_port, new_prefix, wait_until

TTL_S = 2.0
PARTITIONS = 4


LeaseEnv = tuple[TokenbusSettings, str, AIOKafkaProducer]


@pytest.fixture
async def lease_env(bootstrap: str) -> AsyncIterator[LeaseEnv]:
    settings = TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=new_prefix())
    topic = f"{settings.topic_prefix}.results.leases"
    admin = make_admin(settings)
    await admin.start()
    try:
        await ensure_lease_topic(admin, topic, TTL_S)
    finally:
        await admin.close()
    producer = make_producer(settings, client_id="lease-test")
    await producer.start()
    try:
        yield settings, topic, producer
    finally:
        await producer.stop()
        await delete_topics(settings, [topic])


def keeper(env: LeaseEnv, name: str) -> LeaseKeeper:
    settings, topic, producer = env
    return LeaseKeeper(settings, topic, name, lambda: producer, TTL_S)


async def test_racing_edges_get_distinct_partitions_and_the_extra_one_gets_none(
    lease_env: LeaseEnv,
) -> None:
    keepers = [keeper(lease_env, f"edge-{i}") for i in range(PARTITIONS + 1)]
    got = await asyncio.gather(
        *(k.acquire(PARTITIONS, None, timeout_s=1.0) for k in keepers), return_exceptions=True
    )
    won = [g for g in got if isinstance(g, int)]
    lost = [g for g in got if isinstance(g, BaseException)]
    assert sorted(won) == list(range(PARTITIONS))
    assert len(lost) == 1
    assert isinstance(lost[0], RuntimeError)
    assert "no result partition free" in str(lost[0])


async def test_a_released_partition_is_free_at_once(
    lease_env: LeaseEnv,
) -> None:
    a, b = keeper(lease_env, "a"), keeper(lease_env, "b")
    assert await a.acquire(PARTITIONS, None, timeout_s=1.0) == 0
    await a.release()
    started = time.monotonic()
    assert await b.acquire(PARTITIONS, 0, timeout_s=5.0) == 0
    assert time.monotonic() - started < TTL_S / 2


async def test_a_dead_edges_partition_is_taken_only_after_its_lease_lapses(
    lease_env: LeaseEnv,
) -> None:
    dead, heir = keeper(lease_env, "dead"), keeper(lease_env, "heir")
    claimed_at = time.monotonic()
    assert await dead.acquire(PARTITIONS, 2, timeout_s=1.0) == 2
    # `dead` never renews, as after kill -9; `heir` is configured for the same partition.
    assert await heir.acquire(PARTITIONS, 2, timeout_s=4 * TTL_S) == 2
    waited = time.monotonic() - claimed_at
    assert waited >= TTL_S * 0.9, f"taken over after {waited:.2f} s, before the lease lapsed"


async def test_a_live_edge_keeps_its_partition_against_a_configured_rival(
    lease_env: LeaseEnv,
) -> None:
    holder, rival = keeper(lease_env, "holder"), keeper(lease_env, "rival")
    assert await holder.acquire(PARTITIONS, 1, timeout_s=1.0) == 1
    keeping = asyncio.create_task(holder.keep())
    try:
        with pytest.raises(RuntimeError, match="no result partition free"):
            await rival.acquire(PARTITIONS, 1, timeout_s=1.5 * TTL_S)
        assert not keeping.done()
    finally:
        keeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await keeping


async def test_a_holder_whose_lease_lapsed_while_away_takes_it_back(
    lease_env: LeaseEnv,
) -> None:
    # Time passes without a renewal (the broker hung, a long GC pause): nobody claimed the
    # partition meanwhile, so the holder claims it again instead of quitting.
    away = keeper(lease_env, "away")
    assert await away.acquire(PARTITIONS, 1, timeout_s=1.0) == 1
    await asyncio.sleep(TTL_S * 1.5)
    keeping = asyncio.create_task(away.keep())
    try:
        rival = keeper(lease_env, "rival")
        # One renewal beat: the late renewal is noticed and the claim lands.
        await asyncio.sleep(TTL_S)
        with pytest.raises(RuntimeError, match="no result partition free"):
            await rival.acquire(PARTITIONS, 1, timeout_s=1.5 * TTL_S)
        assert not keeping.done(), keeping
    finally:
        keeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await keeping


async def test_a_holder_whose_lapsed_partition_was_taken_gives_it_up(
    lease_env: LeaseEnv,
) -> None:
    away, heir = keeper(lease_env, "away"), keeper(lease_env, "heir")
    assert await away.acquire(PARTITIONS, 2, timeout_s=1.0) == 2
    # `away` cannot renew; `heir` wins the partition once the lease lapses.
    assert await heir.acquire(PARTITIONS, 2, timeout_s=4 * TTL_S) == 2
    with pytest.raises(LeaseLost, match="taken by heir"):
        await asyncio.wait_for(away.keep(), timeout=3 * TTL_S)


async def test_a_lease_topic_made_with_default_configs_is_switched_to_append_time(
    bootstrap: str,
) -> None:
    # `tokenbus topics create` and the test stacks make it as a plain topic.
    settings = TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=new_prefix())
    topic = f"{settings.topic_prefix}.results.leases"
    await create_topics(settings, {topic: 1})
    admin = make_admin(settings)
    producer = make_producer(settings, client_id="lease-test")
    await admin.start()
    await producer.start()
    try:
        await ensure_lease_topic(admin, topic, TTL_S)
        edge = LeaseKeeper(settings, topic, "edge", lambda: producer, TTL_S)
        # A claim checks that the broker stamped it with append time.
        assert await edge.acquire(PARTITIONS, None, timeout_s=1.0) == 0
    finally:
        await producer.stop()
        await admin.close()
        await delete_topics(settings, [topic])


def test_an_edge_started_before_its_results_topic_waits_for_it(
    bootstrap: str, log_dir: Path
) -> None:
    """A fresh or restarted broker may not list the results topic yet (finding 4): the edge
    retries with backoff and says so, and serves once the topic is there, same process."""
    stack = Stack(bootstrap=bootstrap, prefix=new_prefix(), log_dir=log_dir)
    stack.edge_port = free_port()
    stack.start_service("edge")
    try:
        log = log_dir / f"{stack.prefix}-edge.log"

        def retried() -> bool:
            stack.check_alive()
            return "what='lease_partition'" in (log.read_text() if log.exists() else "")

        wait_until(retried, 60, "the edge's logged retry of its lease")
        pid = stack.processes["edge"].pid
        asyncio.run(create_topics(stack.settings, stack.topics.partitions()))
        wait_until(stack.edge_ready, 60, "the edge's /healthz once the topics exist")
        assert stack.processes["edge"].poll() is None
        assert stack.processes["edge"].pid == pid
    finally:
        stack.stop()
