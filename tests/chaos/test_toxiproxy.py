"""Toxiproxy between Kafka clients and one node of a real three-node cluster.

The cluster is the session's (`three_nodes`, tests/conftest.py), proxied: clients reach each
node through its proxy only, while the brokers replicate directly. So a toxic on one node's
proxy slows or cuts the clients' traffic to that node, and replication goes on.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.protocol.metadata import MetadataRequest

from deploy.kafka import launcher
from shared.kafka import create_topics, make_producer
from shared.settings import TokenbusSettings
from tests.built_tools import WAITS_FOR_BUILD
from tests.chaos.toxiproxy import ProxiedCluster, Toxiproxy
from tests.stack import new_prefix, read_partition

# `three_nodes` waits for the Toxiproxy server if make test is still building it.
pytestmark = [pytest.mark.integration, WAITS_FOR_BUILD]

NODES = 3


@pytest.fixture
def proxied(three_nodes: ProxiedCluster) -> ProxiedCluster:
    """The session's proxied cluster, every node up and no toxic left."""
    return three_nodes.whole()


@pytest.fixture
def toxiproxy(proxied: ProxiedCluster) -> Iterator[Toxiproxy]:
    """The proxies, every toxic removed after the test whatever it left."""
    try:
        yield proxied.proxy
    finally:
        proxied.proxy.clear_all()


@pytest.fixture
def settings(proxied: ProxiedCluster) -> TokenbusSettings:
    return TokenbusSettings(
        KAFKA_BOOTSTRAP_SERVERS=proxied.cluster.bootstrap_servers, topic_prefix=new_prefix()
    )


@asynccontextmanager
async def producer_of(settings: TokenbusSettings) -> AsyncIterator[AIOKafkaProducer]:
    producer = make_producer(settings, client_id="toxiproxy-test")
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()


async def partitions(producer: AIOKafkaProducer, node: int, topic: str) -> list[dict[str, Any]]:
    """The topic's partitions (leader, replicas, isr) as node `node` describes them.

    Asked of one node by id: an admin client asks a node at random, which may be the one
    whose proxy holds every byte.
    """
    response = await asyncio.wait_for(
        producer.client.send(node, MetadataRequest([topic])), timeout=10
    )
    [entry] = response.to_object()["topics"]
    found: list[dict[str, Any]] = sorted(entry["partitions"], key=lambda p: p["partition"])
    return found


async def eventually(what: str, timeout_s: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := await check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.2)
    return found


async def new_topic(settings: TokenbusSettings, name: str, count: int) -> str:
    topic = f"{settings.topic_prefix}.{name}"
    await create_topics(settings, {topic: count}, replication=NODES)
    return topic


async def leaders(producer: AIOKafkaProducer, topic: str, count: int) -> dict[int, int]:
    """Partition -> leader once every partition of `topic` has one, as the producer sees it."""

    async def known() -> dict[int, int] | None:
        await producer.client.force_metadata_update()
        cluster = producer.client.cluster
        found = {p: cluster.leader_for_partition(TopicPartition(topic, p)) for p in range(count)}
        if any(leader is None or leader < 0 for leader in found.values()):
            return None
        return {p: int(leader) for p, leader in found.items() if leader is not None}

    led: dict[int, int] = await eventually(f"leaders of {topic}", 30, known)
    return led


def replica_lag_s(cluster: launcher.Cluster) -> float:
    """How long a follower that does not fetch stays in the ISR (server.properties)."""
    config = cluster.node(1).config_file.read_text()
    found = re.search(r"^replica\.lag\.time\.max\.ms=(\d+)", config, re.MULTILINE)
    assert found, "replica.lag.time.max.ms is not set in server.properties"
    return int(found.group(1)) / 1000


async def timed_send(producer: AIOKafkaProducer, topic: str, partition: int) -> float:
    began = time.monotonic()
    await producer.send_and_wait(topic, b"timed", partition=partition)
    return time.monotonic() - began


def test_clients_are_told_the_proxies_and_the_brokers_each_other(proxied: ProxiedCluster) -> None:
    for node in proxied.cluster.nodes:
        assert node.client_port not in (node.port, node.controller_port, node.broker_port)
        config = node.config_file.read_text()
        assert f"advertised.listeners=PLAINTEXT://127.0.0.1:{node.client_port}," in config
        assert f"BROKER://127.0.0.1:{node.broker_port}" in config
        assert "inter.broker.listener.name=BROKER" in config
    assert proxied.cluster.bootstrap_servers == ",".join(
        f"127.0.0.1:{n.client_port}" for n in proxied.cluster.nodes
    )


async def test_a_record_goes_through_the_proxies_and_back(
    proxied: ProxiedCluster, settings: TokenbusSettings
) -> None:
    topic = await new_topic(settings, "round-trip", 1)
    async with producer_of(settings) as producer:
        await producer.send_and_wait(topic, b"through the proxy", partition=0)
        ports = {b.port for b in producer.client.cluster.brokers()}
    assert ports == {n.client_port for n in proxied.cluster.nodes}

    assert await read_partition(settings, TopicPartition(topic, 0), 1) == [b"through the proxy"]


async def test_latency_on_the_leaders_proxy_slows_its_writes(
    toxiproxy: Toxiproxy, settings: TokenbusSettings
) -> None:
    topic = await new_topic(settings, "latency", 1)
    async with producer_of(settings) as producer:
        await producer.send_and_wait(topic, b"warm", partition=0)  # connected, metadata known
        leader = (await leaders(producer, topic, 1))[0]

        toxiproxy.latency(leader, ms=300)
        assert await timed_send(producer, topic, 0) >= 0.3

        toxiproxy.clear(leader)
        assert toxiproxy.toxics(leader) == []


async def test_a_black_holed_leader_holds_its_writes_until_cleared(
    toxiproxy: Toxiproxy, settings: TokenbusSettings
) -> None:
    # One partition per node (KRaft spreads leaders), so some partition is led elsewhere.
    topic = await new_topic(settings, "black-hole", NODES)
    async with producer_of(settings) as producer:
        for partition in range(NODES):
            await producer.send_and_wait(topic, b"warm", partition=partition)
        led = await leaders(producer, topic, NODES)
        target = 0
        holed = led[target]
        elsewhere = next((p for p, node in led.items() if node != holed), None)
        assert elsewhere is not None, f"every partition led by node {holed}: {led}"

        toxiproxy.black_hole(holed)
        held = asyncio.ensure_future(producer.send_and_wait(topic, b"held", partition=target))
        try:
            done, _ = await asyncio.wait({held}, timeout=2.0)
            assert not done, "a write to the black-holed leader completed"
            # The other leaders take writes meanwhile (acks=all: the black-holed node, a
            # follower there, fetches them over the brokers' own listener).
            await asyncio.wait_for(producer.send_and_wait(topic, b"ok", partition=elsewhere), 8)

            toxiproxy.clear(holed)
            await asyncio.wait_for(held, 45)
        finally:
            toxiproxy.clear(holed)  # else stopping the producer waits on the black hole
            held.cancel()
    # The write the black hole swallowed was sent again after the clear, and is there once.
    assert await read_partition(settings, TopicPartition(topic, target), 2) == [b"warm", b"held"]


async def test_replication_bypasses_the_clients_proxies(
    proxied: ProxiedCluster, toxiproxy: Toxiproxy, settings: TokenbusSettings
) -> None:
    topic = await new_topic(settings, "replication", 1)
    async with producer_of(settings) as producer:
        await producer.send_and_wait(topic, b"warm", partition=0)
        holed = (await leaders(producer, topic, 1))[0]
        healthy = next(n.node_id for n in proxied.cluster.nodes if n.node_id != holed)

        # Writes reach the leader; its answers (and, were replication proxied too, its
        # followers' fetched data) are dropped.
        toxiproxy.black_hole(holed, direction="downstream")
        written = asyncio.ensure_future(producer.send_and_wait(topic, b"written", partition=0))
        try:
            # A follower that has not caught up leaves the ISR after replica.lag.time.max.ms,
            # found by a check every half of that (with replication through the proxy too, it
            # left after 16 s): all three staying in past that shows they fetched the record.
            until = time.monotonic() + 1.5 * replica_lag_s(proxied.cluster) + 3
            while time.monotonic() < until:
                [p] = await partitions(producer, healthy, topic)
                assert sorted(p["isr"]) == list(range(1, NODES + 1)), p
                assert not written.done(), "the answer of a black-holed leader arrived"
                await asyncio.sleep(0.5)

            toxiproxy.clear(holed)
            await asyncio.wait_for(written, 45)
        finally:
            toxiproxy.clear(holed)  # else stopping the producer waits on the black hole
            written.cancel()
    # Its first answer was lost: the idempotent producer sent it again, the broker kept one.
    assert await read_partition(settings, TopicPartition(topic, 0), 2) == [b"warm", b"written"]
