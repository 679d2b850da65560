"""Kafka client factories: every producer idempotent with acks=all, consumers commit by hand.

Also the one replication rule for every topic the deployment makes: min(3, brokers)
copies, and two of them in sync before an acks=all write succeeds once there are three.
tests/test_producer_factory.py fails when a producer is built anywhere but here.

Every client of every process is built here, so each one speaks the security protocol and
presents the credentials of `TokenbusSettings.kafka_*` (`client_security`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    IllegalSaslStateError,
    KafkaError,
    SaslAuthenticationFailed,
    TopicAlreadyExistsError,
    UnsupportedSaslMechanismError,
    for_code,
)
from aiokafka.helpers import create_ssl_context
from pydantic import BaseModel

from shared.settings import TokenbusSettings
from shared.topics import Topics

Headers = list[tuple[str, bytes]]

# More copies than this buy little on one rack and cost every write a further round trip.
MAX_REPLICATION_FACTOR = 3


def tls_context(settings: TokenbusSettings) -> ssl.SSLContext | None:
    """The TLS context of the SSL and SASL_SSL protocols (hostname checked); None without TLS.

    Without a CA file the system's trusted CAs verify the broker, as a managed service needs.
    """
    if not settings.kafka_security_protocol.endswith("SSL"):
        return None
    key_password = settings.kafka_ssl_key_password
    context: ssl.SSLContext = create_ssl_context(
        cafile=settings.kafka_ssl_cafile,
        certfile=settings.kafka_ssl_certfile,
        keyfile=settings.kafka_ssl_keyfile,
        password=key_password.get_secret_value() if key_password else None,
    )
    return context


def client_security(settings: TokenbusSettings) -> dict[str, Any]:
    """aiokafka's keyword arguments for the configured protocol, TLS context and SASL login."""
    protocol = settings.kafka_security_protocol
    security: dict[str, Any] = {"security_protocol": protocol}
    context = tls_context(settings)
    if context is not None:
        security["ssl_context"] = context
    if protocol.startswith("SASL_"):
        password = settings.kafka_sasl_password
        security.update(
            sasl_mechanism=settings.kafka_sasl_mechanism,
            sasl_plain_username=settings.kafka_sasl_username,
            sasl_plain_password=password.get_secret_value() if password else None,
        )
    return security


def make_producer(
    settings: TokenbusSettings,
    client_id: str,
    transactional_id: str | None = None,
    request_timeout_ms: int | None = None,
    *,
    durable: bool = True,
) -> AIOKafkaProducer:
    """An idempotent producer (acks=all): retries never duplicate or reorder a partition.

    With `transactional_id` it is also transactional; starting it fences an older producer
    that used the same id. `durable=False`: acks=1 and no idempotence, for records that are
    worth nothing once late (heartbeats: ADR 0056). `request_timeout_ms`: the
    `kafka_producer_request_timeout_ms` setting unless the caller bounds its writes itself.
    """
    if request_timeout_ms is None:
        request_timeout_ms = settings.kafka_producer_request_timeout_ms
    return AIOKafkaProducer(
        bootstrap_servers=settings.bootstrap_servers,
        client_id=client_id,
        acks="all" if durable else 1,
        enable_idempotence=durable,
        transactional_id=transactional_id,
        linger_ms=0,
        request_timeout_ms=request_timeout_ms,
        **client_security(settings),
    )


def make_consumer(
    settings: TokenbusSettings,
    *topics: str,
    group_id: str | None,
    client_id: str,
    auto_offset_reset: str = "earliest",
    isolation_level: str = "read_uncommitted",
    fetch_max_wait_ms: int | None = None,
    long_poll: bool = False,
    **extra: object,
) -> AIOKafkaConsumer:
    """A consumer that never commits on its own: the owner commits what it has handed on.

    `fetch_max_wait_ms` is how long the broker holds a fetch that finds nothing; it answers
    as soon as a record arrives, so a long poll costs no latency while records flow and
    saves the empty fetches of an idle one. It does delay a seek, resume or new assignment
    on the same broker by up to that long. Default: the `long_poll_ms` setting for a
    `long_poll` reader, else the `fetch_max_wait_ms` setting.
    """
    if fetch_max_wait_ms is None:
        fetch_max_wait_ms = settings.long_poll_ms if long_poll else settings.fetch_max_wait_ms
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=settings.bootstrap_servers,
        group_id=group_id,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        fetch_max_wait_ms=fetch_max_wait_ms,
        isolation_level=isolation_level,
        session_timeout_ms=settings.kafka_session_timeout_ms,
        heartbeat_interval_ms=settings.kafka_session_timeout_ms * 3 // 10,
        **client_security(settings),
        **extra,
    )


def make_admin(
    settings: TokenbusSettings, client_id: str = "tokenbus-admin"
) -> AIOKafkaAdminClient:
    """An admin client (topics, configs, offsets, ACLs) with the process's security settings."""
    return AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap_servers,
        client_id=client_id,
        **client_security(settings),
    )


def encode(model: BaseModel) -> bytes:
    return model.model_dump_json(exclude_none=False).encode()


def key_of(request_id: str) -> bytes:
    return request_id.encode()


class KafkaLoginRefused(ConnectionError):
    """The broker answered but refused this client's TLS handshake or SASL login."""


_LOGIN_ERRORS = (
    SaslAuthenticationFailed,
    AuthenticationFailedError,
    UnsupportedSaslMechanismError,
    IllegalSaslStateError,
    ssl.SSLError,
)


async def login_refusal(settings: TokenbusSettings) -> str | None:
    """Why the broker refuses this client's login, or None if it does not (or is not up).

    aiokafka's bootstrap reports every failure as "Unable to bootstrap"; one connection
    made here names the cause, so a wrong password fails at once instead of being waited out.
    """
    security = client_security(settings)
    for server in settings.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            conn = await create_conn(host, int(port), client_id="tokenbus-login", **security)
        except _LOGIN_ERRORS as exc:
            who = settings.kafka_sasl_username or "(no SASL user)"
            return (
                f"Kafka at {server} refused the login of {who} "
                f"({settings.kafka_security_protocol}, {settings.kafka_sasl_mechanism}): "
                f"{type(exc).__name__}: {exc}"
            )
        except (OSError, KafkaError, TimeoutError):
            continue  # not up yet: not a refusal
        conn.close()
    return None


async def wait_for_broker(settings: TokenbusSettings, timeout_s: float = 60.0) -> None:
    """Poll the broker until it answers metadata requests, or raise after `timeout_s`.

    Raises `KafkaLoginRefused` at once when the broker refuses the credentials.
    """
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        admin = make_admin(settings)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except _LOGIN_ERRORS:
            raise
        except (KafkaError, OSError) as exc:
            # Not only refused connections: one node of a cluster away answers
            # `NodeNotReadyError` when the client picks it (ingest exited on that at start
            # in a chaos run while a node was down). A refused login is told apart below.
            last = exc
        finally:
            await admin.close()
        if (refusal := await login_refusal(settings)) is not None:
            raise KafkaLoginRefused(refusal)
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


async def topic_partitions(
    admin: AIOKafkaAdminClient, topic: str, expected: int
) -> list[TopicPartition]:
    """The topic's partitions as the cluster has them (`expected` of them if it says none)."""
    described = await admin.describe_topics([topic])
    count = len(described[0]["partitions"]) if described else 0
    return [TopicPartition(topic, p) for p in range(count or expected)]


async def create_topics(
    settings: TokenbusSettings,
    partitions: Mapping[str, int],
    replication: int | None = None,
    configs: Mapping[str, Mapping[str, str]] | None = None,
) -> list[str]:
    """Create the topics that do not exist yet; return the names created.

    `replication` defaults to the cluster's rule (`cluster_replication`); `configs` holds
    topic configs by name (compaction, retention) for the topics that need any; the topics
    of `Topics.single_copy` get one copy per partition whatever the replication. Returns
    once the broker describes every topic created: a busy broker answers the create before
    its metadata shows them, and a service started then finds its topic missing.
    """
    admin = make_admin(settings)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        copies = replication if replication is not None else await cluster_replication(admin)
        single_copy = Topics(settings.topic_prefix).single_copy()
        new = [
            new_topic(name, count, 1 if name in single_copy else copies, (configs or {}).get(name))
            for name, count in partitions.items()
            if name not in existing
        ]
        if new:
            try:
                response = await admin.create_topics(new)
            except TopicAlreadyExistsError:
                return []  # Another process created them between list and create.
            _raise_topic_errors(response.topic_errors)
            await _until_described(admin, [t.name for t in new])
        return [t.name for t in new]
    finally:
        await admin.close()


TOPICS_VISIBLE_TIMEOUT_S = 60.0


async def _until_described(admin: AIOKafkaAdminClient, names: list[str]) -> None:
    deadline = time.monotonic() + TOPICS_VISIBLE_TIMEOUT_S
    while True:
        described = await admin.describe_topics(names)
        missing = [d["topic"] for d in described if d["error_code"] != 0 or not d["partitions"]]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"created, but not described after {TOPICS_VISIBLE_TIMEOUT_S:g} s: {missing}"
            )
        await asyncio.sleep(0.2)


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
    admin = make_admin(settings)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        doomed = [n for n in names if n in existing]
        if doomed:
            await admin.delete_topics(doomed)
    finally:
        await admin.close()
